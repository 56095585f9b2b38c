"""What the model itself holds during a micro-batch: traced on fake tensors (stored), or the formula.

One micro-batch of the plan's own shape (and of half its sequence) through a 1- and a 2-layer copy
of the model, forward and backward, on fake tensors (no memory; only the number of blocks is
extrapolated), computing as the strategy does (`compute_precision`: bf16 parameters under FSDP2's
mixed precision and DeepSpeed's bf16, autocast under DDP), with each weight gradient dropped once
accumulated (the strategies keep gradients elsewhere, counted apart by paratune.costs.memory; FSDP2's,
kept until a block's backward ends, are traced held that long). `activation_model="formula"` uses
DESIGN.md's formula instead (s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits; 2·s·b·h with
recompute), and so does a model the trace cannot follow. Traces are kept under
PARATUNE_HOME/activation_traces, keyed by the shape, torch, transformers and this module's source.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Literal

from paratune.config.sizes import config_sizes
from paratune.config.plan import Plan
from paratune.model.shapes import BYTES, ModelShape, compute_precision, mlp_width, model_shape

ActivationModel = Literal["trace", "formula"]


# The moments of a micro-batch whose bytes the trace measures (the model's own tensors only:
# saved activations, the loss's buffers, the weight gradients being formed).
PHASES = ("forward", "logits", "loss", "head", "first_grad", "after_head", "blocks", "embedding")


# Traced for FSDP2 only (`held_phases`): the start of the last block's forward (its all-gather) and
# its end; the end of the first block's backward, with its gradients (before its post-backward's
# reduce-scatter copies them) and without them.
_BLOCK_END = ("gather", "block_forward", "block_end", "block_reduced")


@dataclass(frozen=True)
class PhaseBytes:
    """Bytes the model holds at one moment of a micro-batch: fixed + per_token·n + (blocks − 1)·
    (layer_fixed + layer_per_token·n), traced at the plan's own micro-batch shape (exact there,
    whatever grows with the sequence's square: attention masks, eager attention's probabilities)
    and at half its sequence (which splits what grows with tokens from what does not, for the
    tensor-parallel share). The fixed parts are weight gradients being formed (an LM head's, or a
    tied embedding's contribution that autograd holds until the embedding's own backward adds to
    it) and, under autocast, the low-precision weight copies."""

    fixed: float
    per_token: float
    layer_fixed: float = 0.0
    layer_per_token: float = 0.0
    # The logits' part of per_token (bytes a token per vocabulary entry a rank holds, `_logits_sharded`):
    # already a rank's; the rest of per_token (the first block, the embedding's output, the norm)
    # is the unsharded model's, which a tensor-parallel rank holds its share of.
    vocab_per_token: float = 0.0

    def at(self, tokens: float, blocks: int, layer_share: float = 1.0, fixed_share: float = 1.0) -> tuple[float, float]:
        """(bytes that grow with tokens, fixed bytes) for `blocks` blocks of `tokens` tokens;
        `layer_share`/`fixed_share`: the part a tensor-parallel rank holds of a block's
        activations (and of what else grows with tokens, the logits aside) and of the weights'
        gradients."""
        extra = max(0, blocks - 1)
        logits = min(self.vocab_per_token, self.per_token)
        grows = tokens * ((self.per_token - logits) * layer_share + logits + extra * self.layer_per_token * layer_share)
        return max(0.0, grows), max(0.0, self.fixed + extra * self.layer_fixed) * fixed_share


@dataclass(frozen=True)
class ActivationCoefficients:
    """What one micro-batch's forward saves for backward: bytes per token, per decoder block and
    for the rest, and bytes that do not grow with tokens (autocast's low-precision weight copies,
    saved for backward when the parameters themselves are fp32, as under DDP); and, per moment of
    the micro-batch (`PHASES`), what the model holds then (`phases`)."""

    per_layer: float
    rest: float
    method: str
    per_layer_fixed: float = 0.0
    rest_fixed: float = 0.0
    phases: dict[str, PhaseBytes] = field(default_factory=dict)
    # The same moments with the weight gradients FSDP2 holds until its groups' post-backward: a
    # block's as far as its backward has formed them, the root's to the end (`_trace_micro_batch`).
    held_phases: dict[str, PhaseBytes] = field(default_factory=dict)


def _fit_phase(values: dict[tuple[int, int], float], half: int, full: int) -> PhaseBytes:
    """a + b·n + (L − 1)(c + d·n) through bytes measured at L = 1, 2 blocks and n = half, full tokens."""
    b = (values[(1, full)] - values[(1, half)]) / (full - half)
    step_half, step_full = values[(2, half)] - values[(1, half)], values[(2, full)] - values[(1, full)]
    d = (step_full - step_half) / (full - half)
    return PhaseBytes(fixed=values[(1, full)] - full * b, per_token=b, layer_fixed=step_full - full * d,
                      layer_per_token=d)


class _LiveBytes:
    """A dispatch mode counting the storage bytes that ops create under it and that are still
    alive (freed storages leave through weakref finalizers), and the most at once per phase.
    Storages it is told about beforehand (parameters, buffers) are never counted. `held`: bytes
    of weight gradients the trace has dropped but FSDP2 would still hold (`_trace_micro_batch`);
    `held_peak`: the most of live + held at once per phase."""

    def __new__(cls, known):  # noqa: ANN001, ANN204 - built lazily: torch is imported on first use
        import weakref

        from torch.utils import _pytree as pytree
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        class LiveBytes(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.seen = WeakIdKeyDictionary()
                for storage in known:
                    self.seen[storage] = 0
                self.live, self.phase, self.peak = 0, PHASES[0], {}
                self.held, self.held_peak = 0, {}

            def _free(self, nbytes: int) -> None:
                self.live -= nbytes

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                import torch

                out = func(*args, **(kwargs or {}))
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        if storage not in self.seen:
                            nbytes = storage.nbytes()
                            self.seen[storage] = nbytes
                            self.live += nbytes
                            weakref.finalize(storage, self._free, nbytes)
                self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.live)
                self.held_peak[self.phase] = max(self.held_peak.get(self.phase, 0), self.live + self.held)
                return out

        return LiveBytes()


@contextlib.contextmanager
def _grouped_mm_traceable():
    """MoE experts (transformers' grouped_mm path, the one a CPU or GPU run takes) under fake
    tensors: torch's meta kernel for grouped_mm accepts only bf16 (the CUDA kernel's rule), while
    the CPU kernel the trials run also takes fp32. transformers' own fallback op has the same
    signature, output and saved tensors (input, weight: what grouped_mm's autograd saves) and a
    fake kernel for any dtype; route the call there for the trace only."""
    import torch

    try:
        import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback
        fallback = torch.ops.transformers.grouped_mm_fallback
    except (ImportError, AttributeError, RuntimeError):
        yield
        return
    functional = torch.nn.functional
    saved = {name: getattr(owner, name) for owner, name in ((functional, "grouped_mm"), (torch, "_grouped_mm"))
             if hasattr(owner, name)}

    def grouped_mm(input, weight, *args, offs=None, **kwargs):  # noqa: ANN001, ANN202, A002 - torch's signature
        return fallback(input, weight, offs=offs)

    try:
        if "grouped_mm" in saved:
            functional.grouped_mm = grouped_mm
        if "_grouped_mm" in saved:
            torch._grouped_mm = grouped_mm
        yield
    finally:
        for name, fn in saved.items():
            setattr(functional if name == "grouped_mm" else torch, name, fn)


@contextlib.contextmanager
def _masks_as_in_a_real_run():
    """transformers counts fake tensors as tracing (`is_tracing`) and then cannot take two
    data-dependent decisions a real run takes on these inputs (one unpadded sequence per row,
    positions 0..n-1): that no sequences are packed (`find_packed_sequence_indices`) and that
    SDPA's `is_causal` needs no mask (`_ignore_causal_mask_sdpa`). Under fake tensors it would
    build a batch x s x s mask (quadratic in the sequence) and, with a mask, repeat GQA's keys
    and values instead of SDPA's native GQA: memory a real run never allocates. For the trace
    only, both decisions are taken as the real run takes them."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    decide = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if packed is None or decide is None or not hasattr(masking_utils, "is_tracing"):
        yield
        return

    def as_in_a_real_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - transformers' signature
        tracing = masking_utils.is_tracing
        masking_utils.is_tracing = lambda tensor=None: False
        try:
            return decide(*args, **kwargs)
        finally:
            masking_utils.is_tracing = tracing

    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    masking_utils._ignore_causal_mask_sdpa = as_in_a_real_run
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = packed
        masking_utils._ignore_causal_mask_sdpa = decide


def _trace_micro_batch(config, tokens: int, checkpointing: str, precision: str, sequences: int = 1,
                       fake: bool = True, peft_json: str = "") -> tuple[float, dict[str, float], dict[str, float]]:
    """One micro-batch (`sequences` sequences, `tokens` tokens in all) forward and backward on
    fake tensors (no memory; `fake=False`: on real ones, the check of the fake trace): the bytes
    its forward saves (live when the loss exists), the most bytes alive in each phase, and the
    most in each phase with the gradients FSDP2 holds (below).

    `precision` (`compute_precision`): "fp32"; "bf16", autocast over fp32 parameters (DDP); or
    "bf16-params", the parameters themselves in bf16 and no autocast (FSDP2's
    MixedPrecisionPolicy computes with bf16 unsharded parameters, DeepSpeed's bf16 engine casts
    the model): the residual stream, the norms' outputs and the gradients are then bf16 too, and
    there are no cached weight copies.

    Every parameter's gradient is dropped once accumulated (a post-accumulate hook): the
    strategies keep gradients in their own places (buckets, shards, partitions), counted apart;
    what the trace keeps is what the model itself holds, including a gradient while it is being
    formed and a tied weight's first contribution, which autograd holds until the second arrives.
    FSDP2 instead keeps each unsharded gradient where autograd put it until its group's
    post-backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `post_backward`, run
    when the gradients of the group's inputs arrive): a block's until its own backward ends, the
    root's (embedding, head, final norm) until the end of backward. The third result counts the
    dropped gradients as held that long, so a block's gradients count only as far as its backward
    has formed them (at the peak of its backward, while its activations are still alive, only the
    first few are).

    `peft_json` (a plan's `peft`): LoRA adapters on a frozen base, which forms no gradient and keeps
    no linear input for one; the first block (its input needs no gradient) keeps less, which the
    1/2-layer fit puts outside the blocks, and FSDP2 releases its gradients when backward ends."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from paratune.model.materialize import attn_implementation
    from paratune.model.build import decoder_blocks
    from paratune.parallel.recompute import checkpoint_blocks

    modes = (FakeTensorMode(), _grouped_mm_traceable(), _masks_as_in_a_real_run()) if fake else ()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        dtype = {"dtype": torch.bfloat16} if precision == "bf16-params" else {}
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config), **dtype)
        model.train()
        if peft_json:
            from paratune.model.adapters import add_traced_adapters

            add_traced_adapters(model, peft_json, precision)
        if checkpointing in ("full", "selective", "selective_op"):  # the runtime's own checkpoint (tp's is not traced)
            checkpoint_blocks(model, checkpointing)
        ids = torch.randint(0, config_sizes(config).vocab, (sequences, tokens // sequences))
        known = [t.untyped_storage() for t in (*model.parameters(), *model.buffers())]
        tracker = _LiveBytes(known)
        blocks = decoder_blocks(model)
        owner = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}  # root: none
        held: dict[int, int] = {}  # parameter -> bytes of its gradient FSDP2 would still hold

        def consumed(param) -> None:  # noqa: ANN001 - the strategy takes the gradient away
            if "first_grad" not in tracker.peak:  # the first gradient: a snapshot with it
                tracker.peak["first_grad"] = tracker.live
                tracker.held_peak["first_grad"] = tracker.live + tracker.held
                if tracker.phase in ("loss", "head"):
                    tracker.phase = "after_head"
            nbytes = param.grad.numel() * param.grad.element_size()
            tracker.held += nbytes - held.get(id(param), 0)  # a tied weight's gradient accumulates in one
            held[id(param)] = nbytes
            param.grad = None

        for param in model.parameters():
            if param.requires_grad:  # a frozen parameter has no gradient (and takes no hook)
                param.register_post_accumulate_grad_hook(consumed)

        def block_done(index: int):  # the block's post-backward: FSDP2 reduce-scatters its gradients
            def release(grad):  # noqa: ANN001, ANN202
                first = index == len(blocks) - 1 and "block_end" not in tracker.held_peak
                if first:  # the first block in backward ends: its gradients, then without them
                    tracker.held_peak["block_end"] = tracker.live + tracker.held
                for pid in [pid for pid in held if owner.get(pid) == index]:
                    tracker.held -= held.pop(pid)
                if first:
                    tracker.held_peak["block_reduced"] = tracker.live + tracker.held
            return release

        def watch_input(index: int):
            def hook(module, args, kwargs):  # noqa: ANN001, ANN202
                x = args[0] if args else kwargs.get("hidden_states")
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(block_done(index))
                if index == len(blocks) - 1 and tracker.phase == "forward":  # FSDP2 all-gathers it now
                    tracker.held_peak.setdefault("gather", tracker.live)
            return hook

        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(watch_input(index), with_kwargs=True)

        def last_block_forward_ends(module, args, output):  # noqa: ANN001, ANN202
            if tracker.phase == "forward":
                tracker.held_peak.setdefault("block_forward", tracker.live)

        blocks[-1].register_forward_hook(last_block_forward_ends)

        def enters(phase: str):  # when the gradient of a module's output arrives, `phase` begins
            def hook(module, args, output):  # noqa: ANN001, ANN202
                out = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(out, torch.Tensor) and out.requires_grad and not getattr(module, "_paratune_traced", False):
                    module._paratune_traced = True
                    out.register_hook(lambda grad: setattr(tracker, "phase", phase))
            return hook

        model.get_output_embeddings().register_forward_pre_hook(lambda module, args: setattr(tracker, "phase", "logits"))
        model.get_output_embeddings().register_forward_hook(enters("head"))
        blocks[-1].register_forward_hook(enters("blocks"))
        model.get_input_embeddings().register_forward_hook(enters("embedding"))
        with tracker:
            autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                        else torch.autocast("cpu", enabled=False))
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            saved = tracker.live
            tracker.phase = "loss"
            loss.backward()
            del loss
            if "block_end" not in tracker.held_peak:  # LoRA, 1 block: its post-backward at the end
                tracker.held_peak["block_end"] = tracker.live + tracker.held
                tracker.held -= sum(held.pop(pid) for pid in [pid for pid in held if owner.get(pid) == len(blocks) - 1])
                tracker.held_peak["block_reduced"] = tracker.live + tracker.held
    return saved, dict(tracker.peak), dict(tracker.held_peak)


@lru_cache(maxsize=256)
def _traced_coefficients(config_json: str, checkpointing: str, precision: str, micro_batch: int = 1,
                         seq_len: int = 128, layer_counts: tuple[int, ...] = (1, 2),
                         peft_json: str = "") -> ActivationCoefficients:
    """Trace one micro-batch (`micro_batch` sequences of `seq_len` tokens, and of half as many) of
    a 1- and a 2-layer copy of the model on fake tensors (`_trace_micro_batch`; the cost is the
    number of ops, not their size): their differences give one block's and the rest's bytes, what
    grows with tokens and what does not, for the saved activations and for each phase. Exact at
    the micro-batch's own shape; only the number of blocks is extrapolated (blocks repeat).
    `layer_counts` (1,): the 1-layer copy only, for what lies outside the blocks (the per-layer
    parts are then 0): the wider-vocabulary trace of `_logits_sharded`, at half the cost."""
    from paratune.model.build import config_from_key

    full, half = micro_batch * seq_len, micro_batch * max(1, seq_len // 2)
    saved: dict[tuple[int, int], float] = {}
    phases: dict[str, dict[tuple[int, int], float]] = {p: {} for p in PHASES}
    held: dict[str, dict[tuple[int, int], float]] = {p: {} for p in (*PHASES, *_BLOCK_END)}
    for layers in layer_counts:
        config = config_from_key(config_json, num_hidden_layers=layers)
        for tokens in (half, full):
            saved[(layers, tokens)], peaks, held_peaks = _trace_micro_batch(config, tokens, checkpointing, precision,
                                                                            sequences=micro_batch, peft_json=peft_json)
            for phase in PHASES:
                phases[phase][(layers, tokens)] = peaks.get(phase, 0.0)
            for phase in held:
                held[phase][(layers, tokens)] = held_peaks.get(phase, 0.0)
    if layer_counts == (1,):  # no second block: the per-layer parts are left 0
        for values in (saved, *phases.values(), *held.values()):
            values.update({(2, n): values[(1, n)] for n in (half, full)})
    fit = _fit_phase(saved, half, full)
    return ActivationCoefficients(per_layer=fit.layer_per_token, rest=fit.per_token, method="traced (fake tensors)",
                                  per_layer_fixed=max(0.0, fit.layer_fixed), rest_fixed=max(0.0, fit.fixed),
                                  phases={p: _fit_phase(v, half, full) for p, v in phases.items()},
                                  held_phases={p: _fit_phase(v, half, full) for p, v in held.items()})


def _formula_coefficients(shape: ModelShape, checkpointing: str, precision: str, seq_len: int,
                          scores: bool = False) -> ActivationCoefficients:
    """DESIGN.md: s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits (x2 in fp32), the 5·a·s/h
    being attention's s x s scores, which only eager attention keeps (`scores`; SDPA's flash and
    memory-efficient kernels keep a logsumexp a row); 2·s·b·h with full recompute; the rest is
    the logits (tokens x vocab) in fp32. Phases: the loss's two fp32 logits-sized gradients and
    the LM head's gradient at the start of backward, the embedding's gradient at the end."""
    scale = BYTES[precision] / 2
    h, a = shape.hidden, shape.heads
    per_layer = (2 * h if checkpointing == "full" else h * (34 + (5 * a * seq_len / h if scores else 0.0))) * scale
    if checkpointing == "selective":  # SAVED_OPS' outputs: q, k, v, attention, o, gate, up, down; the input
        kv = (shape.kv_heads or a) * shape.head_dim
        per_layer = 2 * (4 * h + 2 * kv + 2 * mlp_width(shape)) * scale + 4 * a
    if checkpointing == "selective_op":  # every second matmul's output not kept: q, v, gate, down (k, o, up
        kv = (shape.kv_heads or a) * shape.head_dim  # recomputed); attention's; the input
        per_layer = 2 * (3 * h + kv + mlp_width(shape)) * scale + 4 * a
    rest = 4.0 * shape.vocab + 2 * h * scale
    head_grad = 4.0 * (shape.head or shape.embedding)
    phases = {"forward": PhaseBytes(0.0, per_layer, 0.0, per_layer),
              "logits": PhaseBytes(0.0, per_layer + rest, 0.0, per_layer),
              "loss": PhaseBytes(0.0, per_layer + rest + 8.0 * shape.vocab, 0.0, per_layer),
              "head": PhaseBytes(head_grad, per_layer + rest + 4.0 * shape.vocab, 0.0, per_layer),
              "first_grad": PhaseBytes(head_grad, per_layer + rest, 0.0, per_layer),
              "after_head": PhaseBytes(0.0 if shape.head else head_grad, per_layer + rest, 0.0, per_layer),
              "blocks": PhaseBytes(0.0 if shape.head else head_grad, per_layer, 0.0, per_layer),
              "embedding": PhaseBytes(4.0 * shape.embedding * (1 if shape.head else 3), 0.0)}
    # FSDP2's held gradients (`_trace_micro_batch`), with no trace to say how far a block's backward
    # has gone at its peak: the head's from its backward on, and a whole block's during its own.
    g = BYTES[precision]
    held = {**phases, "after_head": replace(phases["after_head"], fixed=phases["after_head"].fixed + g * shape.head),
            "blocks": replace(phases["blocks"], fixed=phases["blocks"].fixed + g * (shape.head + shape.block)),
            "embedding": replace(phases["embedding"], fixed=phases["embedding"].fixed + g * shape.head)}
    return ActivationCoefficients(per_layer=per_layer, rest=rest, method="formula (DESIGN.md)", phases=phases,
                                  held_phases=held)


TRACE_STORE_DIR = "activation_traces"  # under paratune_home(): one JSON file per traced shape


def _trace_store_path(config_json: str, checkpointing: str, precision: str, micro_batch: int, seq_len: int,
                      layer_counts: tuple[int, ...] = (1, 2), peft_json: str = "") -> Path:
    """Where a trace's coefficients are kept between processes. The key holds everything the
    trace depends on: the shape, torch and transformers (their ops and modeling code) and this
    module's own source (the trace and the fits), so a change to any of them traces again."""
    import hashlib

    import torch
    import transformers

    from paratune.config.home import paratune_home

    from paratune.parallel.recompute import policy_key

    saved_ops = policy_key(checkpointing)  # what the policy saves is part of what is traced
    text = json.dumps([config_json, checkpointing, precision, micro_batch, seq_len, torch.__version__,
                       transformers.__version__, hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]
                      + ([saved_ops] if saved_ops else []) + ([list(layer_counts)] if layer_counts != (1, 2) else [])
                      + ([peft_json] if peft_json else []))
    return paratune_home() / TRACE_STORE_DIR / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _coefficients_from_json(text: str) -> ActivationCoefficients:
    raw = json.loads(text)
    phases = {k: PhaseBytes(**v) for k, v in raw.pop("phases").items()}
    held = {k: PhaseBytes(**v) for k, v in raw.pop("held_phases").items()}
    return ActivationCoefficients(**raw, phases=phases, held_phases=held)


def _stored_trace(config_json: str, checkpointing: str, precision: str, micro_batch: int,
                  seq_len: int, layer_counts: tuple[int, ...] = (1, 2), peft_json: str = "") -> ActivationCoefficients:
    """The trace from the store, else traced now and stored: `paratune plan` and the sweep
    (driver, resumed driver) trace a space's shapes once (the 8B space's 24 shapes: ~25 s on
    2 cores). A store that cannot be read or written only costs the trace."""
    from dataclasses import asdict

    path = None
    try:
        path = _trace_store_path(config_json, checkpointing, precision, micro_batch, seq_len, layer_counts, peft_json)
        return _coefficients_from_json(path.read_text())
    except Exception:  # noqa: BLE001 - not stored yet, or unreadable: trace it
        pass
    coefficients = _traced_coefficients(config_json, checkpointing, precision, micro_batch, seq_len, layer_counts, peft_json)
    if path is None:
        return coefficients
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(coefficients)))
        tmp.replace(path)  # atomic: a concurrent reader sees the whole file or none
    except Exception:  # noqa: BLE001 - e.g. a read-only home: the next process traces again
        pass
    return coefficients


@lru_cache(maxsize=256)
def _traced_or_reason(config_json: str, checkpointing: str, precision: str, micro_batch: int, seq_len: int,
                      layer_counts: tuple[int, ...] = (1, 2), peft_json: str = "") -> ActivationCoefficients | str:
    """The trace, or why it failed (remembered, so a model the trace cannot follow is tried once)."""
    try:
        return _stored_trace(config_json, checkpointing, precision, micro_batch, seq_len, layer_counts, peft_json)
    except Exception as err:  # noqa: BLE001 - a model the fake-tensor trace cannot follow
        return f"{type(err).__name__}: {err}"


def _trace(config_json: str, checkpointing: str, plan: Plan, layer_counts: tuple[int, ...] = (1, 2)
           ) -> ActivationCoefficients | str:
    return _traced_or_reason(config_json, checkpointing, compute_precision(plan), plan.micro_batch,
                             max(1, plan.seq_len // plan.cp), layer_counts, plan.peft.model_dump_json() if plan.peft else "")


def _with_vocab(config_json: str, vocab: int) -> str:
    return json.dumps({**json.loads(config_json), "vocab_size": vocab})


def _logits_sharded(coeff: ActivationCoefficients, at_v: ActivationCoefficients, at_2v: ActivationCoefficients,
                    vocab: int, vocab_held: float) -> ActivationCoefficients:
    """The coefficients with the logits of `vocab_held` vocabulary entries per token instead of
    `vocab`'s. Every logits-sized buffer (the head's output, its fp32 copy, the loss's
    log-probabilities, their gradients) grows linearly with the vocabulary and nothing else that
    grows with tokens does, so a second trace at twice the vocabulary gives each moment's bytes
    per token per vocabulary entry exactly; only the per-token part outside the blocks changes
    (the head's weight gradient, fixed, is already divided over tp ranks), so the wider trace is
    of the 1-layer copy alone (`layer_counts` (1,)): 2 fake micro-batches, not 4."""
    def moved(c: PhaseBytes, a: PhaseBytes, b: PhaseBytes) -> PhaseBytes:
        slope = max(0.0, (b.per_token - a.per_token) / vocab)
        return replace(c, per_token=max(0.0, c.per_token - slope * (vocab - vocab_held)), vocab_per_token=slope * vocab_held)

    def each(mine: dict, narrow: dict, wide: dict) -> dict:
        return {k: moved(v, narrow[k], wide[k]) if k in narrow and k in wide else v for k, v in mine.items()}

    slope = (at_2v.rest - at_v.rest) / vocab
    return replace(coeff, rest=max(0.0, coeff.rest - slope * (vocab - vocab_held)),
                   phases=each(coeff.phases, at_v.phases, at_2v.phases),
                   held_phases=each(coeff.held_phases, at_v.held_phases, at_2v.held_phases))


def _every_nth_block(none: ActivationCoefficients, full: ActivationCoefficients, blocks: int,
                     every: int) -> ActivationCoefficients:
    """`layers` checkpointing: transformers' every_n_layers recomputes blocks 0, N, 2N, ... whole
    (`layer_index % every_n_layers == 0`, modeling_utils.py) and keeps the others' activations:
    ceil(L/N) of a stage's L blocks. Block 0 (in the fits' per-token part) is a full block; of the
    L - 1 others (the per-layer part) ceil(L/N) - 1 are. Each moment is the mix of the full and
    the none traces by that share: exact for what the blocks save; in a recomputed block's own
    backward the moment is the none trace's block for it (within one block's activations)."""
    recomputed = math.ceil(blocks / every)
    share = (recomputed - 1) / (blocks - 1) if blocks > 1 else 0.0

    def mix(f: PhaseBytes, n: PhaseBytes) -> PhaseBytes:
        return replace(f, layer_fixed=share * f.layer_fixed + (1 - share) * n.layer_fixed,
                       layer_per_token=share * f.layer_per_token + (1 - share) * n.layer_per_token)

    return replace(full, per_layer=share * full.per_layer + (1 - share) * none.per_layer,
                   per_layer_fixed=share * full.per_layer_fixed + (1 - share) * none.per_layer_fixed,
                   method=f"{full.method}; 'layers': {recomputed} of {blocks} blocks recomputed (full and none traces mixed)",
                   phases={k: mix(v, none.phases[k]) for k, v in full.phases.items() if k in none.phases},
                   held_phases={k: mix(v, none.held_phases[k]) for k, v in full.held_phases.items()
                                if k in none.held_phases})


def vocab_held(plan: Plan, vocab: int, hidden: int) -> float:
    """Vocabulary entries of logits a rank holds per token of its micro-batch, by the loss's form
    (paratune.levers.loss_form): standard: all of them (under tp the head's output is gathered on
    every rank); vocab_parallel: its 1/tp shard; chunked: the whole vocabulary for one chunk of
    tokens at a time (the runtime's chunk size, paratune.levers.loss.chunk_tokens), spread over
    the micro-batch's tokens."""
    from paratune.levers import loss_form
    from paratune.levers.loss import chunk_tokens

    form = loss_form(plan)
    if form == "vocab_parallel":
        return vocab / plan.tp
    if form == "chunked":
        tokens = plan.micro_batch * plan.seq_len // plan.cp
        return vocab * min(1.0, chunk_tokens(tokens, vocab, hidden) / tokens)
    return float(vocab)


def _eager_attention(plan: Plan) -> bool:
    """Whether the plan's model runs eager attention (keeps s x s scores; paratune.model.materialize's
    choice: SDPA where the family supports it)."""
    from paratune.model.shapes import model_config_key

    return _eager_attention_of(model_config_key(plan))


@lru_cache(maxsize=64)
def _eager_attention_of(config_key: str) -> bool:
    """Per config key: building the config from its key costs ~2 ms, asked for twice a plan."""
    from paratune.model.materialize import attn_implementation
    from paratune.model.build import config_from_key

    return attn_implementation(config_from_key(config_key)) == "eager"


def activation_coefficients(plan: Plan, model: ActivationModel = "trace") -> ActivationCoefficients:
    """Traced (the default), or DESIGN.md's formula when asked for or when the trace fails (the
    method then says why); for the plan's checkpointing mode (`layers`: `_every_nth_block`) and
    the logits its loss form holds (`vocab_held`, `_logits_sharded`). Compile changes none of it
    (it fuses kernels; what autograd saves is modelled as eager's)."""
    shape = model_shape(plan)
    ac = plan.activation_checkpointing
    blocks = math.ceil(shape.layers / plan.pp)
    held_vocab = vocab_held(plan, shape.vocab, shape.hidden)

    def formula(mode: str, vocab: int | None = None) -> ActivationCoefficients:
        return _formula_coefficients(replace(shape, vocab=vocab or shape.vocab), mode, plan.precision, plan.seq_len,
                                     scores=_eager_attention(plan))

    def shaped(get) -> ActivationCoefficients | str:  # noqa: ANN001 - get(mode, vocab)
        # The logits' bytes per vocabulary entry lie outside the blocks: the same whatever the
        # checkpointing (tested), so they are measured once, with full recompute (the cheapest
        # trace, and one most spaces hold): its trace at V beside a 1-layer one at 2V. Under tp
        # too (the logits are a rank's own; the rest of what grows with tokens is divided).
        pair = ((get("full", None), get("full", 2 * shape.vocab)) if held_vocab != shape.vocab or plan.tp > 1
                else None)
        if pair is not None and any(isinstance(t, str) for t in pair):
            return next(t for t in pair if isinstance(t, str))
        modes = {}
        for mode in (("none", "full") if ac == "layers" else (ac,)):
            coeff = get(mode, None)
            if isinstance(coeff, str):
                return coeff
            modes[mode] = _logits_sharded(coeff, *pair, shape.vocab, held_vocab) if pair else coeff
        if ac == "layers":
            return _every_nth_block(modes["none"], modes["full"], blocks, plan.checkpoint_every)
        return modes[ac]

    formula_coeff = shaped(formula)
    if model != "trace":
        return formula_coeff
    from paratune.model.shapes import model_config_key

    from paratune.costs.moe import rank_trace_config

    key = rank_trace_config(model_config_key(plan), plan.ep)
    traced = shaped(lambda mode, vocab: _trace(_with_vocab(key, vocab), mode, plan, (1,)) if vocab
                    else _trace(key, mode, plan))
    if isinstance(traced, str):
        return replace(formula_coeff, method=f"formula (DESIGN.md; the trace failed: {traced[:200]})")
    return traced
