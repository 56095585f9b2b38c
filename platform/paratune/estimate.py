"""Predict before you spend: peak memory per GPU, communication per step and step time of a plan.

Memory follows docs/DESIGN.md ("Memory model"), per rank, as the largest of the moments of a
step (`memory_moments`, `PHASE_WHEN`): the last micro-batch's forward end, loss backward, LM
head backward, first weight gradient, the backward before the blocks, of its first and of its
last block, the embedding's gradient, the gradient reduction after it, and the optimizer step;
under FSDP2 also its last block's all-gather and forward and its first block's reduce-scatter.
At each moment, in five parts:
- weights, gradients, optimizer states: bytes per parameter by strategy and precision, divided by
  the ranks that shard them (ZeRO/FSDP over dp; TP and PP split the model first), where each
  framework holds them at that moment;
- activations: what the model itself holds then, *traced*: one micro-batch of the plan's own
  shape (and of half its sequence) through a 1- and a 2-layer copy of the model, forward and
  backward, on fake tensors (no memory; only the number of blocks is extrapolated), computing as
  the strategy does (`compute_precision`: bf16 parameters under FSDP2's mixed precision and
  DeepSpeed's bf16, autocast under DDP), with each weight gradient dropped once accumulated (the
  strategies keep gradients elsewhere, counted apart; FSDP2's, kept until a block's backward
  ends, are traced held that long). `activation_model="formula"` uses DESIGN.md's formula
  instead (s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits; 2·s·b·h with recompute), and so does
  a model the trace cannot follow;
- communication buffers (DDP's buckets are the gradients' home; DeepSpeed's reduce bucket and its
  flattened copy; FSDP2's all-gathered blocks and reduce-scatter inputs).
What each framework holds when was read from its source and checked against PyTorch's MemTracker
on gloo workers (bench/estimate_accuracy.py part 3, out of sample on decoder families the model
was not built on): DDP's buckets and, with no_sync accumulation, the micro-batches' gradients
beside them; FSDP2's root gathered through the backward with the block it prefetches, the
unsharded gradients of a block until its reduce-scatter and of the root until the end, a
block's all-gather output in forward, nothing prefetched on one rank; ZeRO's bucket from the
first gradient (ZeRO-1 until the boundary, ZeRO-3 for good), ZeRO-3's persistent (small) tensors
never fetched, the others released after their backward; on CPU (gloo, torch's single-tensor
AdamW) and on GPUs (NCCL, the multi-tensor AdamW) where they differ.
Construction is checked apart (`construction_bytes`): the model is built in fp32 before any
optimizer exists, and a plan that cannot even be built is rejected like one that cannot train.

Where this differs from DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs_*`, checked in tests/test_estimate.py): DeepSpeed counts
fp16/bf16 weights and gradients (4P) plus 16P/N for the fp32 master, moments and fp32 gradient
partition (ZeRO-2; ZeRO-3 accumulates that partition in fp32 and has no 16-bit one). paratune
counts the same model states for ZeRO-2 in bf16 at the optimizer step (tested equal), and then:
(a) the fp32 copy of the gradient partition exists only at the step, not at the backward peak, so
the peak is the larger of the moments; (b) in fp32 DeepSpeed still makes an fp32 copy of each
partition (seen in its flat groups), so the "master" is counted in fp32 too; (c) for ZeRO-3,
DeepSpeed's estimator holds one largest layer (params + grads, 4 bytes) in flight, while its
runtime keeps gathered parameters resident up to stage3_max_live_parameters (1e9 elements by
default), and 0.19.8 accumulates the gradient partition in the model dtype (then an fp32 copy at
the step): paratune counts both; (d) the reduce bucket, which DeepSpeed's estimator leaves out, is
counted at its configured size (the default 5e8 elements is 2 GB in fp32, even for a tiny model).

Time is a roofline: compute = model FLOPs (x4/3 with full recompute) over the device's dense
peak; communication = ring-collective bytes over the slowest link the group spans; the DP part
overlaps with backward, TP's does not; PP adds its bubble. Three constants (compute efficiency,
communication efficiency, a fixed per-step overhead) are fitted from measured trials
(`fit_time_constants`); until then DESIGN.md's reference MFU (~40%) and 70% of link bandwidth.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Literal

from paratune.plan import Plan

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2}
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default
ActivationModel = Literal["trace", "formula"]


# --------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class Device:
    """One accelerator (per-GPU figures). Links: the bandwidth one GPU gets in a ring collective."""

    name: str
    memory_gib: float
    tflops: dict[str, float]  # dense peak per precision
    intra_node_gbps: float  # GB/s per GPU inside a node (NVLink)
    inter_node_gbps: float  # GB/s per GPU across nodes (InfiniBand/EFA)
    gpus_per_node: int = 8
    host_link_gbps: float = 25.0  # GB/s between a GPU and host memory (PCIe): what offload pays
    gpu: str | None = None  # the GPU model (paratune.measure.GPU_PEAK_TFLOPS key): how `auto` finds it

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


DEVICE_FIELDS = ("memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps", "gpus_per_node", "host_link_gbps", "gpu")
_REQUIRED_DEVICE_FIELDS = ("memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps")


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _device_from_spec(name: str, spec: object, source: str, base: dict | None = None) -> Device:
    """One device table entry, checked field by field: a wrong one is named with its value and
    what is allowed. An entry of a user file that names a shipped device overrides only the fields
    it gives (`base`: the shipped entry)."""
    where = f"{source}: device '{name}'"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: got {spec!r}; allowed: a mapping of fields ({', '.join(DEVICE_FIELDS)})")
    unknown = [k for k in spec if k not in DEVICE_FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (value {spec[unknown[0]]!r}); allowed fields: "
                         f"{', '.join(DEVICE_FIELDS)}")
    merged = {**(base or {}), **spec}
    missing = [k for k in _REQUIRED_DEVICE_FIELDS if k not in merged]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (required: {', '.join(_REQUIRED_DEVICE_FIELDS)}; "
                         f"optional: gpus_per_node, host_link_gbps, gpu)")
    for field_name in ("memory_gib", "intra_node_gbps", "inter_node_gbps", "host_link_gbps"):
        if field_name in merged and not _positive_number(merged[field_name]):
            raise ValueError(f"{where}: {field_name}: got {merged[field_name]!r}; allowed: a number > 0")
    tflops = merged["tflops"]
    if (not isinstance(tflops, dict) or not tflops
            or any(not isinstance(k, str) or not _positive_number(v) for k, v in tflops.items())):
        raise ValueError(f"{where}: tflops: got {tflops!r}; allowed: a mapping of precision to dense peak "
                         f"TFLOP/s > 0, e.g. {{bf16: 989, fp32: 67}}")
    if not set(tflops) & set(BYTES):
        raise ValueError(f"{where}: tflops: got {tflops!r}; it must give a peak for at least one of "
                         f"{', '.join(BYTES)} (the precisions a plan trains in)")
    gpus = merged.get("gpus_per_node", 8)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"{where}: gpus_per_node: got {gpus!r}; allowed: a whole number >= 1")
    gpu = merged.get("gpu")
    if gpu is not None:
        from paratune.measure import GPU_PEAK_TFLOPS

        if gpu not in GPU_PEAK_TFLOPS:
            raise ValueError(f"{where}: gpu: got {gpu!r}; allowed: {', '.join(sorted(GPU_PEAK_TFLOPS))} "
                             "(or leave it out: the entry is then found by name only)")
    return Device(name=name, memory_gib=float(merged["memory_gib"]), tflops={k: float(v) for k, v in tflops.items()},
                  intra_node_gbps=float(merged["intra_node_gbps"]), inter_node_gbps=float(merged["inter_node_gbps"]),
                  gpus_per_node=gpus, host_link_gbps=float(merged.get("host_link_gbps", 25.0)), gpu=gpu)


def load_devices(extra: str | Path | None = None) -> dict[str, Device]:
    """The shipped device table (presets/devices.json), extended or overridden by a user file
    (JSON or YAML: device name -> fields, as README's `--devices my_gpus.yaml`). A user entry with
    a shipped name overrides the fields it gives; a new name needs memory_gib, tflops and the two
    link bandwidths."""
    text = resources.files("paratune").joinpath("presets/devices.json").read_text()
    shipped = {k: v for k, v in json.loads(text).items() if not k.startswith("_")}
    devices = {name: _device_from_spec(name, spec, "presets/devices.json") for name, spec in shipped.items()}
    if extra is not None:
        from paratune.plan import read_yaml_mapping

        path = Path(extra)
        for name, spec in read_yaml_mapping(path, "device table", ValueError).items():
            if str(name).startswith("_"):  # comments, as in the shipped table
                continue
            devices[str(name)] = _device_from_spec(str(name), spec, str(path), shipped.get(str(name)))
    return devices


def get_device(name: str, extra: str | Path | None = None) -> Device:
    devices = load_devices(extra)
    if name not in devices:
        raise ValueError(f"device: got '{name}'; allowed: {', '.join(sorted(devices))} (or add it with --devices FILE)")
    return devices[name]


# --------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by place (exact, from the real architecture) and the sizes the model uses."""

    total: int
    embedding: int
    head: int  # untied LM head (0 when tied)
    layer: int  # one decoder block
    rest: int  # final norm and anything else outside the blocks
    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    compute: int  # N in 6N
    largest_leaf: int = 0  # parameters of the largest module that owns them directly (its own, not its children's)
    kv_heads: int = 0  # key/value heads (GQA); 0 = heads
    largest_layer: int = 0  # the largest decoder block (blocks differ: DeepSeek-V3's dense first ones); 0 = layer
    # ZeRO-3's persistent parameters (`_tensor_layout`): in tensors small enough to stay gathered
    persistent: int = 0
    # ... and the others (partitioned, gathered when used) by place: the embedding's, the untied
    # head's, the largest block's
    gathered_embedding: int = 0  # untied; a tied one is the head's
    gathered_head: int = 0
    gathered_layer: int = 0
    gathered_blocks: int = 0  # all the blocks'
    first_layer: int = 0  # the first block (the last in backward); 0 = layer
    gathered_first: int = 0  # ... its fetched tensors

    @property
    def first(self) -> int:
        return self.first_layer or self.layer

    @property
    def block(self) -> int:
        """One block where one is held whole at a time (gathered, its gradients, its
        reduce-scatter input): the largest, so the peak is the largest block's. `layer` (the mean)
        is for what all the blocks hold together."""
        return self.largest_layer or self.layer


# DeepSpeed's stage3_param_persistence_threshold default (deepspeed/runtime/zero/config.py, 1e5
# elements; paratune's DeepSpeed config leaves it, and stage3_model_persistence_threshold, alone).
ZERO3_PERSISTENCE_THRESHOLD = 100_000


@lru_cache(maxsize=64)
def _tensor_layout(key: str) -> dict[str, int]:
    """Counted on the whole model built on the meta device (no memory; blocks may differ, so no
    one-block copy): `largest_leaf`, the parameters of the largest module that holds parameters
    itself (nn.Linear, nn.Embedding, a norm, packed experts): what DeepSpeed's zero.Init builds
    whole before partitioning it; and ZeRO-3's persistent parameters: each tensor of at most
    ZERO3_PERSISTENCE_THRESHOLD elements is marked `ds_persist` (partition_parameters.py
    `_convert_to_deepspeed_param`, parameter_offload.py `mark_persistent_parameters`): gathered
    after every step (stage3.py `_post_step`) and never released in forward or backward
    (partitioned_param_coordinator.py `__params_to_release`), so never fetched either; the others
    (`gathered_*`: of the embedding, the untied head, the largest block) are."""
    import torch
    from transformers import AutoModelForCausalLM

    from paratune.models import config_from_key, decoder_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_key(key))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())

    def fetched(params) -> int:  # noqa: ANN001
        return sum(p.numel() for p in params if p.numel() > ZERO3_PERSISTENCE_THRESHOLD)

    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    small = sum(p.numel() for p in model.parameters() if p.numel() <= ZERO3_PERSISTENCE_THRESHOLD)
    stack = decoder_blocks(model)
    blocks = [fetched(block.parameters()) for block in stack]
    return {"largest_leaf": largest, "persistent": small,
            "gathered_embedding": 0 if tied else fetched([embedding.weight]),
            "gathered_head": 0 if head is None else fetched([head.weight]),
            "gathered_layer": max(blocks), "gathered_blocks": sum(blocks), "gathered_first": blocks[0],
            "first_layer": sum(p.numel() for p in stack[0].parameters())}


@lru_cache(maxsize=64)
def _shape_from_key(key: str) -> ModelShape:
    from paratune.models import config_from_key, parameter_counts, parameter_layout

    config = config_from_key(key)
    layout, heads = parameter_layout(config), config.num_attention_heads
    tensors = _tensor_layout(key)
    return ModelShape(
        total=layout["total"], embedding=layout["embedding"], head=layout["head"], layer=layout["layer"],
        rest=layout["total"] - layout["embedding"] - layout["head"] - layout["layer"] * layout["layers"],
        layers=layout["layers"], hidden=config.hidden_size, vocab=config.vocab_size, heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        compute=parameter_counts(config)["compute"], largest_leaf=tensors["largest_leaf"],
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        largest_layer=layout.get("largest_layer", layout["layer"]), persistent=tensors["persistent"],
        gathered_embedding=tensors["gathered_embedding"], gathered_head=tensors["gathered_head"],
        gathered_layer=tensors["gathered_layer"], gathered_blocks=tensors["gathered_blocks"],
        first_layer=tensors["first_layer"], gathered_first=tensors["gathered_first"])


def model_shape(plan: Plan) -> ModelShape:
    from paratune.models import build_config, config_key

    return _shape_from_key(config_key(build_config(plan.model, plan.model_overrides)))


# --------------------------------------------------------------------------- activations
# The moments of a micro-batch whose bytes the trace measures (the model's own tensors only:
# saved activations, the loss's buffers, the weight gradients being formed).
PHASES = ("forward", "logits", "loss", "head", "first_grad", "after_head", "blocks", "embedding")
PHASE_WHEN = {
    "gather": "the all-gather of the last micro-batch's last decoder block in forward",
    "block_forward": "the end of the last micro-batch's last decoder block's forward",
    "forward": "the last micro-batch's forward, before the LM head",
    "logits": "the end of the last micro-batch's forward (logits and loss)",
    "loss": "the start of the last micro-batch's backward (the loss's gradient, up to the logits')",
    "head": "the LM head's backward in the last micro-batch (its weight gradient forming)",
    "first_grad": "the last micro-batch's first weight gradient (the LM head's, or the final norm's when tied)",
    "after_head": "the last micro-batch's backward after the LM head, before its blocks",
    "blocks": "the backward of the last micro-batch's first decoder block",
    "next_block": "the backward of the last micro-batch's second decoder block in backward",
    "last_block": "the backward of the last micro-batch's last decoder block (the first one)",
    "embedding": "the end of the last micro-batch's backward (the embedding's gradient)",
    "block_reduce": "the reduce-scatter after the last micro-batch's first decoder block in backward",
    "reduce": "the gradient reduction after the last micro-batch's backward",
    "step": "the optimizer step",
}


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

    def at(self, tokens: float, blocks: int, layer_share: float = 1.0, fixed_share: float = 1.0) -> tuple[float, float]:
        """(bytes that grow with tokens, fixed bytes) for `blocks` blocks of `tokens` tokens;
        `layer_share`/`fixed_share`: the part a tensor-parallel rank holds of a block's
        activations and of the weights' gradients."""
        extra = max(0, blocks - 1)
        grows = tokens * (self.per_token + extra * self.layer_per_token * layer_share)
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
                       fake: bool = True) -> tuple[float, dict[str, float], dict[str, float]]:
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
    first few are)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from paratune.materialize import attn_implementation
    from paratune.models import decoder_blocks
    from paratune.parallel.runner import enable_full_recompute

    modes = (FakeTensorMode(), _grouped_mm_traceable(), _masks_as_in_a_real_run()) if fake else ()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        dtype = {"dtype": torch.bfloat16} if precision == "bf16-params" else {}
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config), **dtype)
        model.train()
        if checkpointing == "full":
            enable_full_recompute(model)
        ids = torch.randint(0, config.vocab_size, (sequences, tokens // sequences))
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
    return saved, dict(tracker.peak), dict(tracker.held_peak)


@lru_cache(maxsize=256)
def _traced_coefficients(config_json: str, checkpointing: str, precision: str, micro_batch: int = 1,
                         seq_len: int = 128) -> ActivationCoefficients:
    """Trace one micro-batch (`micro_batch` sequences of `seq_len` tokens, and of half as many) of
    a 1- and a 2-layer copy of the model on fake tensors (`_trace_micro_batch`; the cost is the
    number of ops, not their size): their differences give one block's and the rest's bytes, what
    grows with tokens and what does not, for the saved activations and for each phase. Exact at
    the micro-batch's own shape; only the number of blocks is extrapolated (blocks repeat)."""
    from paratune.models import config_from_key

    full, half = micro_batch * seq_len, micro_batch * max(1, seq_len // 2)
    saved: dict[tuple[int, int], float] = {}
    phases: dict[str, dict[tuple[int, int], float]] = {p: {} for p in PHASES}
    held: dict[str, dict[tuple[int, int], float]] = {p: {} for p in (*PHASES, *_BLOCK_END)}
    for layers in (1, 2):
        config = config_from_key(config_json, num_hidden_layers=layers)
        for tokens in (half, full):
            saved[(layers, tokens)], peaks, held_peaks = _trace_micro_batch(config, tokens, checkpointing, precision,
                                                                            sequences=micro_batch)
            for phase in PHASES:
                phases[phase][(layers, tokens)] = peaks.get(phase, 0.0)
            for phase in held:
                held[phase][(layers, tokens)] = held_peaks.get(phase, 0.0)
    fit = _fit_phase(saved, half, full)
    return ActivationCoefficients(per_layer=fit.layer_per_token, rest=fit.per_token, method="traced (fake tensors)",
                                  per_layer_fixed=max(0.0, fit.layer_fixed), rest_fixed=max(0.0, fit.fixed),
                                  phases={p: _fit_phase(v, half, full) for p, v in phases.items()},
                                  held_phases={p: _fit_phase(v, half, full) for p, v in held.items()})


def _formula_coefficients(shape: ModelShape, checkpointing: str, precision: str, seq_len: int) -> ActivationCoefficients:
    """DESIGN.md: s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits (x2 in fp32); 2·s·b·h with
    full recompute; the rest is the logits (tokens x vocab) in fp32. Phases: the loss's two fp32
    logits-sized gradients and the LM head's gradient at the start of backward, the embedding's
    gradient at the end."""
    scale = BYTES[precision] / 2
    h, a = shape.hidden, shape.heads
    per_layer = (2 * h if checkpointing == "full" else h * (34 + 5 * a * seq_len / h)) * scale
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


def _fully_sharded(plan: Plan) -> bool:
    """Whether the plan runs FSDP2's `fully_shard` (on the whole mesh when it is one rank): the
    fsdp strategy without model parallelism (paratune.parallel.fsdp), or with it and more than one
    replica (paratune.parallel.nd shards over dp x cp; with a single replica it applies no FSDP)."""
    if plan.strategy != "fsdp" or plan.fsdp is None or plan.fsdp.sharding == "no_shard":
        return False
    return (plan.tp == plan.pp == plan.cp == 1) or _replicas(plan) > 1


def compute_precision(plan: Plan) -> str:
    """How the plan's bf16 compute is made (paratune.parallel): "bf16-params" where the
    parameters the forward uses are bf16 themselves (FSDP2's MixedPrecisionPolicy: the fsdp
    strategy, except a model-parallel plan with one replica, which runs without FSDP2; DeepSpeed's
    bf16 engine, which casts the model), else "bf16", autocast over fp32 parameters (DDP, and the
    single-replica model-parallel plans); "fp32" in fp32."""
    if plan.precision != "bf16":
        return plan.precision
    if plan.strategy == "zero":
        return "bf16-params"
    if plan.strategy == "fsdp" and ((plan.tp == plan.pp == plan.cp == 1) or _replicas(plan) > 1):
        return "bf16-params"
    return "bf16"


TRACE_STORE_DIR = "activation_traces"  # under paratune_home(): one JSON file per traced shape


def _trace_store_path(config_json: str, checkpointing: str, precision: str, micro_batch: int, seq_len: int) -> Path:
    """Where a trace's coefficients are kept between processes. The key holds everything the
    trace depends on: the shape, torch and transformers (their ops and modeling code) and this
    module's own source (the trace and the fits), so a change to any of them traces again."""
    import hashlib

    import torch
    import transformers

    from paratune.trial import paratune_home

    text = json.dumps([config_json, checkpointing, precision, micro_batch, seq_len, torch.__version__,
                       transformers.__version__, hashlib.sha256(Path(__file__).read_bytes()).hexdigest()])
    return paratune_home() / TRACE_STORE_DIR / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _coefficients_from_json(text: str) -> ActivationCoefficients:
    raw = json.loads(text)
    phases = {k: PhaseBytes(**v) for k, v in raw.pop("phases").items()}
    held = {k: PhaseBytes(**v) for k, v in raw.pop("held_phases").items()}
    return ActivationCoefficients(**raw, phases=phases, held_phases=held)


def _stored_trace(config_json: str, checkpointing: str, precision: str, micro_batch: int,
                  seq_len: int) -> ActivationCoefficients:
    """The trace from the store, else traced now and stored: `paratune plan` and the sweep
    (driver, resumed driver) trace a space's shapes once (the 8B space's 24 shapes: ~25 s on
    2 cores). A store that cannot be read or written only costs the trace."""
    from dataclasses import asdict

    path = None
    try:
        path = _trace_store_path(config_json, checkpointing, precision, micro_batch, seq_len)
        return _coefficients_from_json(path.read_text())
    except Exception:  # noqa: BLE001 - not stored yet, or unreadable: trace it
        pass
    coefficients = _traced_coefficients(config_json, checkpointing, precision, micro_batch, seq_len)
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
def _traced_or_reason(config_json: str, checkpointing: str, precision: str, micro_batch: int,
                      seq_len: int) -> ActivationCoefficients | str:
    """The trace, or why it failed (remembered, so a model the trace cannot follow is tried once)."""
    try:
        return _stored_trace(config_json, checkpointing, precision, micro_batch, seq_len)
    except Exception as err:  # noqa: BLE001 - a model the fake-tensor trace cannot follow
        return f"{type(err).__name__}: {err}"


def activation_coefficients(plan: Plan, model: ActivationModel = "trace") -> ActivationCoefficients:
    """Traced (the default), or DESIGN.md's formula when asked for or when the trace fails (the
    method then says why)."""
    shape = model_shape(plan)
    formula = _formula_coefficients(shape, plan.activation_checkpointing, plan.precision, plan.seq_len)
    if model != "trace":
        return formula
    from paratune.models import build_config, config_key

    traced = _traced_or_reason(config_key(build_config(plan.model, plan.model_overrides)),
                               plan.activation_checkpointing, compute_precision(plan), plan.micro_batch,
                               max(1, plan.seq_len // plan.cp))
    if isinstance(traced, str):
        return replace(formula, method=f"formula (DESIGN.md; the trace failed: {traced[:200]})")
    return traced


# --------------------------------------------------------------------------- memory
@dataclass
class MemoryEstimate:
    """Predicted peak bytes per rank, by part, at the moment of the step that holds the most
    (`phase`, one of PHASE_WHEN); `phases`: the total at each moment considered."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    method: str = ""
    phase: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers}

    def overflow(self, capacity_bytes: float) -> str | None:
        """None if it fits; else the reason, naming the part that overflows."""
        if self.total <= capacity_bytes:
            return None
        parts = self.parts()
        big = max(parts, key=parts.get)
        states = self.weights + self.gradients + self.optimizer
        if states > capacity_bytes:
            what = f"weights+grads+optimizer {states / GiB:.1f} GiB alone"
        else:
            what = f"{big} {parts[big] / GiB:.1f} GiB is the largest part"
        return f"predicted {self.total / GiB:.1f} GiB > {capacity_bytes / GiB:.1f} GiB per GPU ({what})"


def _replicas(plan: Plan) -> int:
    """Ranks that hold the same model-parallel slice and share its gradients: dp, and cp with it
    (context-parallel ranks see parts of the same sequences, so they are data-parallel for the
    weights: FSDP2 shards over dp x cp, DDP all-reduces over it)."""
    return plan.dp_degree * plan.cp


def _stage_blocks(plan: Plan, shape: ModelShape) -> float:
    """Parameters of the decoder blocks one rank's stage holds (before TP): all of them without
    pipeline stages (layers x the mean block: exact where blocks differ); with stages, the
    heaviest stage's, as many of the largest block as a stage holds (DeepSeek-V3's dense first
    blocks sit on the first stage, the others hold only MoE blocks)."""
    if plan.pp == 1:
        return shape.layers * shape.layer
    return math.ceil(shape.layers / plan.pp) * shape.block


def _local_params(plan: Plan, shape: ModelShape) -> tuple[float, float]:
    """(parameters this rank's model-parallel slice holds, of which in one decoder block: the
    mean block, so that the blocks hold layers x that).

    TP shards every block and the (vocab-parallel) embedding and head; norms are small and
    counted as sharded. PP gives a stage its layers; the heavier end stage (embedding on the
    first, norm and head on the last) sets the peak.

    ZeRO's tp is DeepSpeed's AutoTP: it splits the blocks' linear layers and the LM head, but
    keeps an untied input embedding whole on every rank (tied, both are vocab-split)."""
    t, p = plan.tp, plan.pp
    blocks = _stage_blocks(plan, shape)
    if plan.strategy == "zero" and t > 1:
        whole = shape.embedding + shape.rest if shape.head else 0.0
        return (blocks + shape.head + (0 if shape.head else shape.embedding)) / t + whole, shape.layer / t
    if p > 1:
        ends = max(shape.embedding, shape.head + shape.rest if shape.head else shape.embedding + shape.rest)
    else:
        ends = shape.embedding + shape.head + shape.rest
    return (blocks + ends) / t, shape.layer / t


@dataclass(frozen=True)
class _Held:
    """Parameter counts of what one rank's model-parallel slice holds, by place."""

    local: float  # every parameter of the slice
    layer: float  # one decoder block held whole (gathered, its gradients): the largest block
    first: float  # the first block, the last one in backward
    root: float  # outside the blocks: embedding, untied head, final norm
    head: float  # an untied LM head (0 when tied)
    embedding: float
    largest: float  # the largest single parameter tensor

    @classmethod
    def of(cls, plan: Plan, shape: ModelShape) -> "_Held":
        local, _ = _local_params(plan, shape)
        t = plan.tp
        root = max(0.0, local - _stage_blocks(plan, shape) / t)
        return cls(local=local, layer=shape.block / t, first=shape.first / t, root=root, head=min(shape.head / t, root),
                   embedding=min(shape.embedding / t, root), largest=(shape.largest_leaf or shape.block) / t)


def _on_host(plan: Plan, device: "Device | None") -> bool:
    """Whether the ranks are CPU processes (gloo, torch's single-tensor AdamW) rather than GPUs
    (NCCL, torch's multi-tensor AdamW): the plan's device, else the device table entry."""
    if plan.device != "auto":
        return plan.device == "cpu"
    return device is not None and device.name == "cpu"


def _adamw_temporaries(params: float, largest: float, host: bool, state_bytes: int = 4) -> float:
    """Bytes torch's AdamW allocates for one step, beyond its states: on CPU the single-tensor
    path builds `exp_avg_sq.sqrt() / bias_correction` for one tensor at a time (two tensors of the
    largest parameter alive at once); on GPU the multi-tensor (foreach) path builds
    `_foreach_sqrt(exp_avg_sqs)` for every parameter at once."""
    return state_bytes * (2 * largest if host else params)


@dataclass
class _Moment:
    """One moment of the step: bytes per part."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    comm_buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers


def _model_phase_bytes(plan: Plan, shape: ModelShape, coeff: ActivationCoefficients,
                       keeps_weight_copies: bool, held: bool = False) -> dict[str, tuple[float, float]]:
    """phase -> (activation bytes, weight-gradient bytes being formed) the model of one rank holds
    at that moment of its last micro-batch (`ActivationCoefficients.phases`), for its tokens
    (a context-parallel rank: its part of each sequence), its blocks (a pipeline stage: its own,
    and the saved activations of the other micro-batches it holds at once) and its tensor-parallel
    share. `keeps_weight_copies`: the parameters are fp32 under autocast (DDP), so the bf16 copies
    of the weights autocast saves for backward exist; otherwise the trace has none. `held`: with
    the gradients FSDP2 holds until its groups' post-backward (`held_phases`), counted with those
    being formed."""
    tokens = plan.micro_batch * plan.seq_len // plan.cp
    layers_here = math.ceil(shape.layers / plan.pp)
    in_flight = 1
    if plan.pp > 1:  # micro-batches whose activations a stage holds at once
        in_flight = plan.grad_accum if plan.pp_schedule == "gpipe" else min(plan.grad_accum, plan.pp)
    tp_share = 1.0 / plan.tp if plan.sequence_parallel or plan.tp == 1 else 0.5 + 0.5 / plan.tp
    others = (in_flight - 1) * tokens * (coeff.per_layer * layers_here * tp_share + coeff.rest)
    copies = (coeff.per_layer_fixed * layers_here + coeff.rest_fixed) / plan.tp  # saved for backward
    out = {}
    phases = coeff.held_phases if held and coeff.held_phases else coeff.phases
    for phase, bytes_ in phases.items():
        acts, fixed = bytes_.at(tokens, layers_here, tp_share, 1.0 / plan.tp)
        # In forward no weight gradient exists: what does not grow with tokens is autocast's cache
        # of low-precision weight copies (kept until the autocast region ends). In backward, the
        # copies saved for it, and the rest is gradients being formed.
        held_copies = fixed if phase in ("forward", "logits") else min(fixed, copies) if phase != "embedding" else 0.0
        out[phase] = (acts + others + (held_copies if keeps_weight_copies else 0.0), fixed - held_copies)
    if "blocks" in phases:  # the last block's backward: the others' activations are gone
        acts, fixed = phases["blocks"].at(tokens, 1, tp_share, 1.0 / plan.tp)
        out["last_block"] = (acts + others, fixed)
        if held and layers_here > 2:  # the second block's (with two, the last): the first's activations gone
            acts, fixed = phases["blocks"].at(tokens, layers_here - 1, tp_share, 1.0 / plan.tp)
            out["next_block"] = (acts + others, fixed)
    return out


# Phases from the first weight gradient on: DeepSpeed's stage 1/2 gradient hooks have run.
_AFTER_FIRST_GRAD = ("first_grad", "after_head", "blocks", "last_block", "embedding")


def _ddp_moments(plan: Plan, shape: ModelShape, held: _Held, model: dict[str, tuple[float, float]], host: bool) -> dict[str, _Moment]:
    """DDP (torch.nn.parallel.DistributedDataParallel, fp32 parameters; bf16 is autocast).

    The reducer allocates its buckets when DDP is built: 4 bytes a parameter (fp32 gradients),
    for as long as DDP lives. With gradient_as_bucket_view (the default) the gradients are views
    of them, but zero_grad(set_to_none=True) drops the views: the micro-batches under no_sync()
    accumulate into fresh tensors (another 4 bytes a parameter), which the synchronised backward
    copies into the buckets (`mul_out`, divided by the world size) and replaces by views, one
    parameter at a time, last layers first. Without bucket views, param.grad and the buckets are
    separate all the time."""
    p, ga = held.local, plan.grad_accum
    view = plan.ddp is None or plan.ddp.gradient_as_bucket_view
    weights, optim, buckets = 4 * p, 8 * p, 4 * p
    after_head = ("after_head", "blocks")
    if view:  # the accumulated tensors, until the synchronised backward replaces them by views
        outside = ({**{ph: p for ph in PHASES}, **{ph: p - held.head for ph in after_head},
                    "last_block": held.embedding + held.first, "embedding": held.embedding} if ga > 1 else {})
    else:  # param.grad, beside the buckets
        outside = ({ph: p for ph in (*PHASES, "last_block")} if ga > 1
                   else {"after_head": held.head, "blocks": held.head, "last_block": p - held.embedding - held.first,
                         "embedding": p - held.embedding})
    moments = {}
    for phase, (acts, forming) in model.items():
        moments[phase] = _Moment(weights, buckets + 4 * outside.get(phase, 0.0) + forming, optim, acts)
    moments["step"] = _Moment(weights, buckets + (0.0 if view else 4 * p), optim + _adamw_temporaries(p, held.largest, host))
    return moments


def _fsdp_moments(plan: Plan, shape: ModelShape, held: _Held, model: dict[str, tuple[float, float]], host: bool) -> dict[str, _Moment]:
    """FSDP2 (`fully_shard` per block and the root; `replicate` for no_shard).

    Sharded: fp32 shards, their moments and (once reduced) gradient shards, 4 + 8 + 4 bytes per
    parameter / shard ranks. The root (embedding, untied head, final norm) is all-gathered for
    the whole forward (the loss is computed inside it) and, when backward starts, again by the
    root's pre-backward, which also prefetches the last block; it stays whole until its own
    post-backward, at the end of backward. Blocks are gathered one at a time in forward
    (reshard_after_forward), and in backward the block being computed plus the next one,
    prefetched (FSDP2's default backward prefetch, or `prefetch` blocks). A block's unsharded
    gradients stay where autograd put them until its post-backward reduce-scatters them
    (foreach_reduce: the fp32 input is a copy of the whole block's gradients, kept until the next
    block's reduce-scatter starts), the root's until the end of backward: the model's moments are
    traced with those gradients held (`held_phases`: at the peak of a block's backward only the
    gradients it has formed so far exist, not the whole block's). At the root's reduce-scatter,
    after the root is resharded: the root's gradients and the reduce-scatter input (a copy), then
    the output (a shard) while foreach_reduce's loop variable still holds the group's last
    gradient (the head's when untied); gloo implements reduce-scatter as an all-reduce of a copy
    of its input (seen: an input-sized tensor more).

    On a one-rank mesh (`fully_shard` of a single rank: _fsdp_param_group.py `unshard` and
    `wait_for_unshard`, _fsdp_collectives.py `foreach_reduce`) there is no collective: `unshard`
    issues no all-gather, so a prefetch holds nothing, and each group's unsharded parameters are
    allocated (and, in bf16, cast from the fp32 shards) when the group is about to be used; the
    "reduce-scatter" copies its fp32 input into an output of the same size, the gradient shard."""
    f = plan.fsdp
    assert f is not None
    s, ga, pb = _fsdp_shard_degree(plan), plan.grad_accum, BYTES[plan.precision]
    p, blk, root = held.local, held.layer, held.root
    layers_here = math.ceil(shape.layers / plan.pp)
    compute, reduce = pb, 4  # unsharded parameters and gradients in the compute dtype; reduce-scatter in fp32
    moments: dict[str, _Moment] = {}
    if not _fully_sharded(plan):
        # no_shard: FSDP2's replicate, DDP semantics (no-sync accumulation between micro-batches),
        # with bf16 unsharded parameters beside the fp32 ones under mixed precision; or a
        # model-parallel plan with one replica, which applies no FSDP2 (autocast: its weight
        # copies are the trace's).
        copy = compute * p if compute != 4 and compute_precision(plan) == "bf16-params" else 0.0
        weights = 4 * p + copy
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(weights, (4 * p if ga > 1 else 0.0) + forming, 8 * p, acts, reduce * blk)
        moments["step"] = _Moment(4 * p, 4 * p, 8 * p + _adamw_temporaries(p, held.largest, host))
        return _fsdp_offloaded(plan, moments, p, s)
    alone = s == 1  # a one-rank mesh: no all-gather, no reduce-scatter
    shards, optim = 4 * p / s, 8 * p / s
    if ga > 1:  # gradient shards accumulated from the earlier micro-batches
        reduced = {phase: 4 * p / s for phase in (*PHASES, *_BLOCK_END, "next_block", "last_block", "reduce")}
    else:  # the blocks' shards appear as their reduce-scatters finish
        reduced = {"next_block": 4 * blk / s, "last_block": 4 * (p - root - held.first) / s,
                   "embedding": 4 * (p - root) / s, "reduce": 4 * (p - root) / s}
    blocks_whole = layers_here * blk if not f.reshards_after_forward else 0.0
    ahead = 0 if alone else max(1, f.prefetch)  # blocks gathered ahead of the one in use
    in_backward = layers_here * blk if not f.reshards_after_forward else blk * (1 + ahead)
    # The root's pre-backward prefetches the last block's all-gather (FSDP2's implicit backward
    # prefetch), so it is whole from the start of backward (on more than one rank).
    prefetched = blk if f.reshards_after_forward and not alone else 0.0
    gathered = {"forward": blocks_whole, "logits": blocks_whole, **{ph: blocks_whole + prefetched for ph in PHASES[2:]},
                "blocks": in_backward, "next_block": in_backward - (blk if not f.reshards_after_forward else 0.0),
                "last_block": held.first, "embedding": 0.0}
    # The previous block's reduce-scatter input, kept until the next post-backward: none yet during
    # the first block's backward.
    rs_input = {"next_block": reduce * blk, "last_block": reduce * blk, "embedding": reduce * blk}
    ends = {phase: model.pop(phase) for phase in _BLOCK_END if phase in model}
    # In forward a block's all-gather output stays beside its unsharded parameters until the next
    # block's copy-out (`wait_for_unshard`: the implicit prefetch's all_gather_state); the last
    # block's until the root's post-forward (_fsdp_state.py `_post_forward`), after the loss.
    output = 0.0 if alone else compute * blk
    kept = {"forward": output, "logits": output}
    for phase, (acts, grads) in model.items():  # grads: those FSDP2 holds and those being formed
        moments[phase] = _Moment(shards + compute * (root + gathered[phase]), reduced.get(phase, 0.0) + grads, optim,
                                 acts, rs_input.get(phase, 0.0) + kept.get(phase, 0.0))
    if "gather" in ends and "block_forward" in ends:
        # The last block's all-gather: the previous block's output (the root's, with one block) not
        # yet freed, its own output and its unsharded parameters being copied out of it.
        before = layers_here * blk - blk if not f.reshards_after_forward else 0.0
        previous = 0.0 if alone else compute * (blk if layers_here > 1 else root)
        acts, grads = ends["gather"]
        moments["gather"] = _Moment(shards + compute * (root + before + blk), reduced.get("forward", 0.0) + grads,
                                    optim, acts, previous + output)
        acts, grads = ends["block_forward"]
        moments["block_forward"] = _Moment(shards + compute * (root + before + blk),
                                           reduced.get("forward", 0.0) + grads, optim, acts, output)
    if "block_end" in ends and "block_reduced" in ends:
        # The first block's post-backward: resharded, then its reduce-scatter.
        after = shards + compute * (root + in_backward - blk)  # what it prefetched (or all but it) stays whole
        (acts, grads), (acts_after, grads_after) = ends["block_end"], ends["block_reduced"]
        # foreach_reduce: the fp32 input beside the unsharded gradients it copies; once they are
        # freed, the output (a shard; the whole block on one rank) and gloo's copy of the input.
        copy_in = _Moment(after, reduced.get("blocks", 0.0) + grads, optim, acts, reduce * blk)
        scatter = _Moment(after, reduced.get("blocks", 0.0) + grads_after, optim, acts_after,
                          reduce * blk + reduce * blk / s + (reduce * blk if host and not alone else 0.0))
        moments["block_reduce"] = max(copy_in, scatter, key=lambda m: m.total)
    gloo_copy = reduce * root if host and not alone else 0.0
    copy_in = _Moment(shards, reduced["reduce"] + compute * root, optim, 0.0, reduce * root)
    scatter = _Moment(shards, reduced["reduce"] + compute * held.head + reduce * root / s, optim, 0.0,
                      reduce * root + gloo_copy)
    moments["reduce"] = max(copy_in, scatter, key=lambda m: m.total)
    moments["step"] = _Moment(shards, 4 * p / s, optim + _adamw_temporaries(p / s, held.largest / s, host))
    return _fsdp_offloaded(plan, moments, p, s)


def _fsdp_offloaded(plan: Plan, moments: dict[str, _Moment], p: float, s: int) -> dict[str, _Moment]:
    """Under CPU offload the shards, their gradients and the optimizer live in host memory."""
    if plan.fsdp is None or not plan.fsdp.cpu_offload:
        return moments
    for m in moments.values():
        m.weights = max(0.0, m.weights - 4 * p / s)
        m.gradients = max(0.0, m.gradients - 4 * p / s)
        m.optimizer = 0.0
    return moments


def _zero_moments(plan: Plan, shape: ModelShape, held: _Held, model: dict[str, tuple[float, float]], host: bool) -> dict[str, _Moment]:
    """DeepSpeed ZeRO 0-3 (0.19.8), as its runtime allocates.

    - Stage 1/2 (stage_1_and_2.py): with contiguous_gradients (DeepSpeed's default) the first
      gradient hook of every backward allocates the reduce bucket, reduce_bucket_size elements in
      the model dtype (`setup_buckets`), whatever the model's size: ZeRO-1 keeps it until the
      boundary's reduction (its gradients accumulate whole in param.grad), ZeRO-2 releases it at
      the end of each backward and keeps the averaged gradients of its partition (`grads_in_partition`).
      Reducing a bucket (`allreduce_bucket`) first flattens its gradients into a new tensor, up to
      reduce_bucket_size elements. At the step: the fp32 gradient partition the optimizer reads.
    - Stage 3 (stage3.py): parameter partitions; the gradient partitions in the model dtype
      (`grad_partitions_flat_buffer`) and the reduce bucket, both allocated once and kept. Tensors
      of at most stage3_param_persistence_threshold (1e5) elements are persistent: gathered after
      every step and kept (`_tensor_layout`). The others are fetched in forward by coalesced
      all-gathers of up to stage3_prefetch_bucket_size elements into one flat buffer, from which
      each module's parameters are copied out when it runs (partition_parameters.py
      `AllGatherCoalescedHandle.wait`, at the first module's fetch, for every parameter of the
      bucket); the buffer lives until the bucket's last module is fetched (the LM head, for a
      model smaller than the bucket). Fetched parameters stay while they
      will be reused (stage3_max_reuse_distance, 1e9 elements) up to stage3_max_live_parameters
      (1e9): through the forward; in backward each module's are released after its backward
      (partitioned_param_coordinator.py `release_sub_module`: no later use in the trace), the
      head's first, then the blocks' one after another; the input embedding's, whose backward
      does not fetch it, stay to the step (seen). The last bucket's reduce-scatter flattens it
      into a new tensor (gloo reduce-scatters a copy of that). At the step, an fp32 copy of the
      partition's gradients.
    - The optimizer: paratune's torch AdamW over DeepSpeed's flat fp32 partition on CPU (two
      partition-sized temporaries per step), DeepSpeed's fused torch AdamW on GPUs (none)."""
    z = plan.zero
    assert z is not None
    stage, dp, ga, pb = z.stage, _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    p = shape.total / plan.tp if stage == 3 and plan.tp > 1 else held.local
    part = dp if stage >= 1 else 1
    bucket = pb * z.reduce_bucket_size * (2 if z.overlap_comm and stage in (1, 2) else 1)
    flat = pb * min(z.reduce_bucket_size, p)
    fused = not host and plan.optimizer in ("auto", "deepspeed")
    temps = 0.0 if fused else (2 if host else 1) * 4 * p / part
    optim = (12 if stage >= 1 else 8) * p / part
    step_grads = 4 * p / part + (pb * p / part if pb != 4 or stage < 3 else 0.0)
    if z.offload_optimizer:  # master weights, moments and the fp32 gradients live in host memory
        optim, temps, step_grads = 0.0, 0.0, (pb * p / part if stage < 3 else 0.0)
    moments: dict[str, _Moment] = {}
    if stage == 3:
        own = 0.0 if z.offload_param else pb * p / dp
        t = plan.tp  # AutoTP's slices (persistence taken on the whole tensors)
        persistent = min(p, shape.persistent / t)
        head, embedding = shape.gathered_head / t, shape.gathered_embedding / t
        blocks, first = shape.gathered_blocks / t, shape.gathered_first / t
        live = ZERO3_MAX_LIVE_PARAMETERS + held.largest

        def resident(fetched: float) -> float:  # persistent, and fetched ones up to the live limit
            return pb * (persistent + min(fetched, live)) if dp > 1 else 0.0

        whole = resident(embedding + blocks + head)
        gathered = {"forward": whole, "logits": whole, "loss": whole, "head": whole, "first_grad": whole,
                    "after_head": resident(embedding + blocks), "blocks": resident(embedding + blocks),
                    "last_block": resident(embedding + first), "embedding": resident(embedding)}
        grads = pb * p / dp
        # The forward's flat buffer, beside the parameters copied out of it, until the LM head.
        fetch = pb * min(embedding + blocks + head, max(z.stage3_prefetch_bucket_size, held.largest)) if dp > 1 else 0.0
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(own + gathered[phase] + (fetch if phase == "forward" else 0.0), grads + forming,
                                     optim, acts, bucket)
        moments["reduce"] = _Moment(own + resident(embedding), grads, optim, 0.0, bucket + flat * (2 if host else 1))
        moments["step"] = _step(own, grads, step_grads, optim, temps, pb, p / dp, bucket)
        return moments
    weights = pb * p
    if stage == 2:
        partition = pb * p / dp  # grads_in_partition: the averaged gradients of the rank's partition
        # It exists from the first bucket's reduction: an earlier micro-batch's, or, in a lone
        # micro-batch, once reduce_bucket_size elements of gradients have arrived.
        filled = p > z.reduce_bucket_size
        earlier = ({phase: partition for phase in (*PHASES, "last_block")} if ga > 1
                   else {"last_block": partition, "embedding": partition} if filled else {})
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(weights, earlier.get(phase, 0.0) + forming, optim, acts,
                                     bucket if phase in _AFTER_FIRST_GRAD else 0.0)
        # The last bucket's flattened copy beside the partition's gradients: kept from the earlier
        # micro-batches; in a lone micro-batch, allocated once the copy is garbage.
        # A full bucket is reduced while the gradient that did not fit in it waits.
        pending = pb * held.largest if filled else 0.0
        moments["reduce"] = _Moment(weights, (partition if ga > 1 else 0.0) + pending, optim, 0.0,
                                    bucket + (flat if ga > 1 else max(flat, partition)))
        moments["step"] = _step(weights, 0.0, step_grads, optim, temps, pb, p / dp)
        return moments
    # Stage 0/1: whole gradients accumulate in param.grad; reduced at the boundary.
    whole = ({phase: pb * p for phase in (*PHASES, "last_block")} if ga > 1
             else {"after_head": pb * held.head, "blocks": pb * held.head,
                   "last_block": pb * (p - held.embedding - held.first), "embedding": pb * (p - held.embedding)})
    keep = bucket if stage == 1 else 0.0
    for phase, (acts, forming) in model.items():
        moments[phase] = _Moment(weights, whole.get(phase, 0.0) + forming, optim, acts,
                                 keep if ga > 1 or phase in _AFTER_FIRST_GRAD else 0.0)
    # Reducing: the gradients not yet in a bucket, the bucket and its flattened copy; then the
    # partition's gradients (`grads_in_partition`), once the copy is garbage.
    partition = pb * p / dp if stage == 1 else 0.0
    moments["reduce"] = _Moment(weights, pb * max(0.0, p - z.reduce_bucket_size), optim, 0.0,
                                keep + max(flat, partition))
    step_temps = temps if stage == 1 else (0.0 if fused else _adamw_temporaries(p, held.largest, host))
    if stage == 1:
        moments["step"] = _step(weights, 0.0, step_grads, optim, step_temps, pb, p / dp, 0.0)
    else:
        moments["step"] = _Moment(weights, pb * p, optim + step_temps)
    return moments


def _step(weights: float, grads: float, step_grads: float, optim: float, temps: float, pb: int, partition: float,
          buffers: float = 0.0) -> _Moment:
    """DeepSpeed's step: the partition's averaged gradients are copied to fp32 (`step_grads`
    bytes: both exist for a moment), then the averaged ones are gone while the optimizer runs
    with its temporaries."""
    fp32 = 4 * partition if step_grads else 0.0
    cast = _Moment(weights, grads + step_grads, optim, 0.0, buffers)
    update = _Moment(weights, grads + fp32, optim + temps, 0.0, buffers)
    return max(cast, update, key=lambda m: m.total)


def memory_moments(plan: Plan, model: ActivationModel = "trace", device: "Device | None" = None,
                   coeff: ActivationCoefficients | None = None) -> dict[str, _Moment]:
    """Bytes per part at every moment of the step the model considers (PHASE_WHEN), per rank."""
    shape = model_shape(plan)
    coeff = coeff or activation_coefficients(plan, model)
    held = _Held.of(plan, shape)
    per_phase = _model_phase_bytes(plan, shape, coeff, keeps_weight_copies=compute_precision(plan) == "bf16",
                                   held=_fully_sharded(plan))
    build = {"ddp": _ddp_moments, "fsdp": _fsdp_moments, "zero": _zero_moments}[plan.strategy]
    return build(plan, shape, held, per_phase, _on_host(plan, device))


@dataclass
class ModelStates:
    """Bytes per rank of the model's state. `step_gradients`: gradient bytes that exist only at
    the optimizer step (DeepSpeed's fp32 copy of the gradient partition)."""

    weights: float
    gradients: float
    optimizer: float
    buffers: float
    step_gradients: float = 0.0


def model_states(plan: Plan, shape: ModelShape | None = None) -> ModelStates:
    """Weights, gradients, optimizer states and communication buffers a rank holds through the
    backward of its last micro-batch, by strategy (the moments themselves: `memory_moments`).

    Gradients are where they accumulate between micro-batches (DDP: its buckets, the gradients'
    home; FSDP: shards; ZeRO-1: whole, in param.grad; ZeRO-2/3: the rank's partition); at the
    optimizer step add `step_gradients`."""
    shape = shape or model_shape(plan)
    held = _Held.of(plan, shape)
    local, layer = held.local, held.layer
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    if plan.strategy == "ddp":
        # Autocast keeps fp32 parameters; gradients live in DDP's buckets (as views by default).
        unbucketed = plan.ddp is not None and not plan.ddp.gradient_as_bucket_view
        return ModelStates(4 * local, 4 * local, 8 * local, 4 * local if unbucketed else 0.0)
    if plan.strategy == "fsdp":
        f = plan.fsdp
        assert f is not None
        shard = _fsdp_shard_degree(plan)
        weights, optim = 4 * local / shard, 8 * local / shard  # fp32 shards and their moments
        if shard > 1:
            if f.reshards_after_forward:  # gathered in backward: the root, a block and the one prefetched
                weights += pb * (held.root + layer * (1 + max(1, f.prefetch)))
            else:
                weights += pb * local  # grad_op: everything stays gathered until backward
            # Reduce-scattered every micro-batch: only shards accumulate (fp32).
            grads, buffers = (4 * local / shard if ga > 1 else 0.0), 4 * layer  # + the block being reduced
            step = 4 * local / shard if ga == 1 else 0.0
        else:
            grads, buffers, step = 4 * local, 0.0, 0.0
        if f.cpu_offload:  # shards, their gradients and the optimizer live in host memory
            weights, optim, grads, step = weights - 4 * local / shard, 0.0, 0.0, 0.0
        return ModelStates(weights, grads, optim, buffers, step)
    z = plan.zero
    assert z is not None
    if z.stage == 3 and plan.tp > 1:  # ZeRO-3 partitions what AutoTP leaves whole over the tp ranks too
        local = shape.total / plan.tp
    stage, part = z.stage, dp if z.stage >= 1 else 1
    weights = pb * local / (dp if stage == 3 else 1)
    if stage == 3 and dp > 1:
        # Gathered parameters stay resident up to stage3_max_live_parameters (DeepSpeed's default
        # 1e9 elements) plus the module in use; DeepSpeed's estimator assumes only its largest layer.
        largest = max(layer, shape.embedding / plan.tp, shape.head / plan.tp)
        weights += pb * min(local, ZERO3_MAX_LIVE_PARAMETERS + largest)
    # An fp32 flat copy of each partition (the master; DeepSpeed makes it in fp32 too) + 2 moments.
    optim = (12 if stage >= 1 else 8) * local / part
    step = 0.0
    if stage == 3:
        grads = pb * local / dp  # grad_partitions_flat_buffer, in the model dtype
        step = 4 * local / dp  # + its fp32 copy for the optimizer step
    elif stage == 2:
        grads = pb * local / dp  # the averaged gradient partition (bucket by bucket in backward)
        step = 4 * local / dp  # + its fp32 copy for the optimizer step
    else:
        grads = pb * local if ga > 1 else 0.0  # whole gradients, reduced at the boundary
        step = 4 * local / part if stage == 1 else 0.0
    # The reduce bucket (ZeRO 1-3: DeepSpeed's contiguous_gradients) is allocated at its configured
    # size whatever the model's: the default 5e8 elements is 2 GB in fp32. Two with overlap_comm
    # (ZeRO-1/2).
    buffers = 0.0
    if stage >= 1:
        buffers = pb * z.reduce_bucket_size * (2 if z.overlap_comm and stage in (1, 2) else 1)
    if z.offload_optimizer:  # master weights, moments and the fp32 gradients live in host memory
        optim, step = 0.0, 0.0
    if z.offload_param and stage == 3:
        weights -= pb * local / dp
    return ModelStates(weights, grads, optim, buffers, step)


def _fsdp_shard_degree(plan: Plan) -> int:
    """Ranks that share one parameter's shards under FSDP (1 for no_shard)."""
    f = plan.fsdp
    assert f is not None
    dp = _replicas(plan)
    node_dp = plan.gpus_per_node // plan.tp if plan.gpus_per_node else dp  # the dp ranks of one node
    shard = {"full": dp, "grad_op": dp, "hybrid": f.shard_group_size or node_dp, "no_shard": 1}[f.sharding]
    return max(1, min(shard, dp))


def construction_bytes(plan: Plan, shape: ModelShape | None = None) -> float:
    """Device bytes per rank while the model is built, before the optimizer exists: the model is
    built on the meta device and each rank materializes in fp32 only what it holds.

    - ddp, fsdp no_shard, ZeRO 0-2: every rank holds the whole model (its tp/pp slice), 4 bytes
      a parameter (DeepSpeed's bf16 cast then happens in place, one tensor at a time);
    - fsdp full/grad_op/hybrid: its shard of that slice (values are made on the host, only the
      shard is kept on the device);
    - plus, without pipeline stages and with more than one rank, one module's full fp32 values
      on the device for a moment (ranks take turns computing modules and broadcast them);
    - ZeRO-3: under `deepspeed.zero.Init` each module's parameters are partitioned as soon as the
      module is built, in the dtype of the DeepSpeed config (bf16 with bf16 enabled), so: the
      partition (params/dp) in that dtype, plus the largest single module built whole on the
      device. Its tensors are created in fp32 and then cast (zero_wrapper_for_fp_tensor_constructor
      in deepspeed/runtime/zero/partition_parameters.py), so for a moment both copies exist:
      4 + 2 bytes a parameter in bf16, 4 in fp32. Under parameter offload the partitions go to
      the host (zero.Init's remote_device) and only that module is on the device.
    - ZeRO with tp (DeepSpeed's AutoTP): AutoTP shards inside `deepspeed.initialize`, after the
      model exists: at ZeRO 0-2 every rank first builds the whole model in fp32 (4 bytes x all
      parameters); at ZeRO-3 zero.Init partitions the whole model over every rank, and AutoTP
      gathers one module whole (fp32) at a time to cut its slice.
    """
    shape = shape or model_shape(plan)
    local, _ = _local_params(plan, shape)
    if plan.strategy == "zero" and plan.zero is not None and plan.zero.stage == 3:
        pb = BYTES[plan.precision]
        if plan.tp > 1:
            partition = 0.0 if plan.zero.offload_param else pb * shape.total / plan.num_workers
            return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf + 4 * shape.largest_leaf
        partition = 0.0 if plan.zero.offload_param else pb * local / plan.dp_degree
        return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf
    if plan.strategy == "zero" and plan.tp > 1:
        return 4 * shape.total + (4 * shape.largest_leaf if plan.num_workers > 1 else 0.0)
    # Without pipeline stages every rank fills every module, one module's fp32 values broadcast
    # at a time through the device (paratune.materialize.ModelInit.shared_values).
    exchange = 4 * shape.largest_leaf if plan.num_workers > 1 and plan.pp == 1 else 0.0
    if plan.strategy == "fsdp":
        return 4 * local / _fsdp_shard_degree(plan) + exchange
    return 4 * local + exchange




def activation_bytes(plan: Plan, model: ActivationModel = "trace", shape: ModelShape | None = None) -> tuple[float, str]:
    """Activation bytes a rank holds at the start of its last micro-batch's backward (the saved
    activations of the micro-batches it holds at once and the loss's buffers; the head's gradient
    being formed is a gradient, not counted here)."""
    shape = shape or model_shape(plan)
    coeff = activation_coefficients(plan, model)
    acts, _ = _model_phase_bytes(plan, shape, coeff, keeps_weight_copies=compute_precision(plan) == "bf16")["loss"]
    return acts, coeff.method


def estimate_memory(plan: Plan, model: ActivationModel = "trace", device: "Device | None" = None) -> MemoryEstimate:
    """Peak memory per rank: the moment of the step that holds the most (`memory_moments`).
    `device`: where the plan runs, when the plan says `auto` (the CPU entry: gloo collectives
    and torch's single-tensor AdamW; a GPU: NCCL and the multi-tensor AdamW)."""
    coeff = activation_coefficients(plan, model)
    moments = memory_moments(plan, model, device, coeff)
    name = max(moments, key=lambda k: moments[k].total)
    peak = moments[name]
    method = f"{coeff.method}; peak at {PHASE_WHEN[name]}"
    return MemoryEstimate(peak.weights, peak.gradients, peak.optimizer, peak.activations, peak.comm_buffers,
                          method=method, phase=name, phases={k: m.total for k, m in moments.items()})


# --------------------------------------------------------------------------- communication
@dataclass
class CommVolume:
    """Bytes one rank sends per optimizer step, by parallel dimension."""

    dp: float
    tp: float
    pp: float
    cp: float = 0.0

    @property
    def total(self) -> float:
        return self.dp + self.tp + self.pp + self.cp


def comm_volume(plan: Plan) -> CommVolume:
    """Ring-collective volume per rank (DESIGN.md "Communication model")."""
    shape = model_shape(plan)
    local, _ = _local_params(plan, shape)
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    ring = 2 * (dp - 1) / dp if dp > 1 else 0.0  # all-reduce; half of it for a reduce-scatter or all-gather
    if plan.strategy == "ddp" or (plan.strategy == "fsdp" and plan.fsdp and plan.fsdp.sharding == "no_shard"):
        dp_bytes = ring * 4 * local  # fp32 gradients, once per step (no_sync between micro-batches)
    elif plan.strategy == "fsdp":
        gathers = 2 if plan.fsdp and plan.fsdp.reshards_after_forward else 1
        dp_bytes = ring / 2 * ga * (gathers * pb * local + 4 * local)  # reduce-scatter every micro-batch
    else:
        stage = plan.zero.stage if plan.zero else 2
        if stage == 3:
            dp_bytes = ring / 2 * ga * (2 * pb * local + pb * local)
        elif stage == 2:
            dp_bytes = ring / 2 * (ga * pb * local + pb * local)  # reduce every micro-batch, one gather
        else:
            dp_bytes = ring * pb * local
    tokens = plan.micro_batch * plan.seq_len // plan.cp
    t = plan.tp
    tp_bytes = (4 * math.ceil(shape.layers / plan.pp) * 2 * (t - 1) / t * tokens * shape.hidden * pb * ga) if t > 1 else 0.0
    # Activations forward and their gradients back at each stage boundary; interleaving doubles them.
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    pp_bytes = 2 * v * tokens * shape.hidden * pb * ga if plan.pp > 1 else 0.0
    # Ring attention (torch's context_parallel): in forward each rank receives the other ranks' K and
    # V of every layer, (cp - 1)/cp of the sequence's; in backward K and V again and their
    # gradients, which torch's ring carries in fp32.
    cp_bytes = 0.0
    if plan.cp > 1:
        kv = 2 * plan.micro_batch * plan.seq_len * shape.kv_heads * shape.head_dim / t  # K and V elements
        cp_bytes = math.ceil(shape.layers / plan.pp) * ga * (plan.cp - 1) / plan.cp * kv * (2 * pb + 4)
    return CommVolume(dp_bytes, tp_bytes, pp_bytes, cp_bytes)


# --------------------------------------------------------------------------- time
@dataclass
class TimeConstants:
    """Achieved fraction of peak compute and of link bandwidth, and a fixed per-step cost."""

    compute_efficiency: float = 0.4
    comm_efficiency: float = 0.7
    overhead_s: float = 0.0
    # Fixed cost of each micro-batch (kernel launches, Python, the loss): why bigger micro-batches
    # run faster at the same compute.
    micro_batch_overhead_s: float = 0.005
    fitted_on: int = 0  # trials the constants were fitted on (0: defaults)
    compute_fitted: bool = False  # compute_efficiency fitted on them (False: the prior, held)


@dataclass
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble: float
    step_s: float
    tokens_per_s_per_gpu: float


def _time_terms(plan: Plan, device: Device) -> tuple[float, float, float, float]:
    """(ideal compute s, ideal DP comm s, ideal TP+PP comm s, pipeline bubble fraction)."""
    from paratune.measure import flops_per_token

    shape = model_shape(plan)
    flops = flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)
    flops *= plan.tokens_per_step / plan.num_workers
    if plan.activation_checkpointing == "full":
        flops *= 4 / 3  # one more forward
    peak = device.tflops.get(plan.precision, device.tflops.get("fp32", 1.0)) * 1e12
    compute = flops / peak
    vol = comm_volume(plan)
    per_node = plan.gpus_per_node or device.gpus_per_node
    dp_span = plan.num_workers > per_node  # the dp ring crosses nodes once dp x tp x pp does
    tp_span = plan.tp > per_node
    bw = lambda crosses: (device.inter_node_gbps if crosses else device.intra_node_gbps) * 1e9  # noqa: E731
    dp_s = vol.dp / bw(dp_span)
    mp_s = vol.tp / bw(tp_span) + vol.pp / bw(plan.num_workers > per_node)
    mp_s += vol.cp / bw(plan.tp * plan.cp > per_node)  # counted as exposed: the ring waits on its peers
    mp_s += _offload_bytes(plan, shape) / (device.host_link_gbps * 1e9)  # not overlapped either
    m = plan.grad_accum
    # Interleaving gives each rank v = 2 stages, which divides the fill/drain time by v (Megatron).
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    bubble = (plan.pp - 1) / (v * m + plan.pp - 1) if plan.pp > 1 else 0.0
    return compute, dp_s, mp_s, bubble


def _offload_bytes(plan: Plan, shape: ModelShape) -> float:
    """Bytes a rank moves between host and device per step because of CPU offload."""
    local, _ = _local_params(plan, shape)
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    moved = 0.0
    if plan.strategy == "zero" and plan.zero is not None:
        if plan.zero.offload_optimizer:  # fp32 gradient partition down, updated parameters up
            moved += (4 + pb) * local / dp
        if plan.zero.offload_param and plan.zero.stage == 3:  # parameters up for forward and backward
            moved += 2 * ga * pb * local / dp
    elif plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.cpu_offload:
        moved += 2 * ga * 4 * local / dp + 4 * local / dp  # shards up per pass, gradients down
    return moved


def estimate_time(plan: Plan, device: Device, constants: TimeConstants | None = None) -> TimeEstimate:
    c = constants or TimeConstants()
    compute, dp_s, mp_s, bubble = _time_terms(plan, device)
    compute /= c.compute_efficiency
    comm = (dp_s + mp_s) / c.comm_efficiency
    # DP collectives overlap with backward (about two thirds of compute); TP/PP ones do not.
    exposed = max(0.0, dp_s / c.comm_efficiency - compute * 2 / 3) + mp_s / c.comm_efficiency
    step = compute / (1 - bubble) + exposed + c.overhead_s + c.micro_batch_overhead_s * plan.grad_accum
    return TimeEstimate(compute, comm, exposed, bubble, step, plan.tokens_per_step / step / plan.num_workers)


# A column of the time fit whose values differ across the fitted trials by less than this share of
# their largest is held at its prior: it is then (nearly) a multiple of the constant column, so the
# least squares would split the step between it and the per-step overhead by the noise of the
# measurements, which on the shared hosts repeat within ~10% at best (bench/results: step-time
# spreads of 5% to 65%). In a sweep the model and the global batch are fixed, so every plan computes
# the same FLOPs: the compute column varies only with full recompute (x4/3) or a pipeline bubble.
IDENTIFIABLE_SPREAD = 0.10


def _spread(column) -> float:  # noqa: ANN001 - a numpy column
    top = float(abs(column).max())
    return float(column.max() - column.min()) / top if top > 0 else 0.0


def fit_time_constants(samples: list[tuple[Plan, float]], device: Device) -> TimeConstants:
    """Least squares of measured step time on the model's terms:
    step ≈ a·compute + b·comm + c + d·micro-batches, all >= 0 (a = 1/compute efficiency,
    b = 1/comm efficiency), fitting only what the trials can tell apart. A term whose column has
    (near) no spread across them (IDENTIFIABLE_SPREAD) is collinear with the constant c and is
    held at its prior (TimeConstants(): DESIGN's reference compute efficiency, 70% of the links,
    the micro-batch cost): in a sweep every plan computes the same FLOPs, and a fitted compute
    coefficient came out anywhere from 11% to 3700% of peak. With few trials, fewer terms (in
    the order compute, overhead, micro-batches, comm). The compute efficiency never exceeds 1
    against the device's peak (a >= 1), and held, a never makes compute alone outlast a measured
    step. `compute_fitted` says whether it was fitted."""
    import numpy as np

    prior = TimeConstants()
    if not samples:
        return prior
    rows, y = [], []
    for plan, measured in samples:
        compute, dp_s, mp_s, bubble = _time_terms(plan, device)
        rows.append([compute / (1 - bubble), dp_s + mp_s, 1.0, float(plan.grad_accum)])
        y.append(measured)
    X, Y = np.array(rows), np.array(y)
    n = len(samples)
    priors = np.array([1 / prior.compute_efficiency, 1 / prior.comm_efficiency, prior.overhead_s,
                       prior.micro_batch_overhead_s])
    identifiable = [j for j in (0, 2, 3, 1) if j == 2 or _spread(X[:, j]) >= IDENTIFIABLE_SPREAD]
    active = identifiable[:n]  # no more terms than trials
    coef = priors.copy()
    coef[active] = 0.0
    if 0 not in active and X[:, 0].min() > 0:  # held: compute alone never longer than a measured step
        coef[0] = max(1.0, min(coef[0], float((Y / X[:, 0]).min())))
    for _ in range(8):  # non-negative least squares by hand: drop terms that come out negative
        rest = Y - X @ np.where(np.isin(np.arange(4), active), 0.0, coef)
        sol, *_ = np.linalg.lstsq(X[:, active], rest, rcond=None) if active else (np.zeros(0),)
        if 0 in active and sol[active.index(0)] < 1.0:  # faster than the device's peak: hold at the peak
            coef[0] = 1.0
            active = [j for j in active if j != 0]
            continue
        if (sol >= 0).all():
            coef[active] = sol
            break
        dropped = [j for j, v in zip(active, sol) if v < 0]
        coef[dropped] = 0.0
        active = [j for j in active if j not in dropped]
    a, b, c, d = coef
    return TimeConstants(compute_efficiency=1 / a, comm_efficiency=1 / b if b > 0 else 1e9,
                         overhead_s=float(c), micro_batch_overhead_s=float(d), fitted_on=n,
                         compute_fitted=0 in active)


# --------------------------------------------------------------------------- together
@dataclass
class Estimate:
    plan: Plan
    memory: MemoryEstimate
    comm: CommVolume
    time: TimeEstimate
    capacity_bytes: float
    overflow: str | None = None
    construction: float = 0.0  # device bytes per rank while the model is built (construction_bytes)

    @property
    def fits(self) -> bool:
        return self.overflow is None

    def summary(self) -> dict[str, float]:
        """Flat numbers for MLflow and JSON."""
        return {"predicted_peak_memory_gib": self.memory.total / GiB,
                **{f"predicted_{k}_gib": v / GiB for k, v in self.memory.parts().items()},
                "predicted_construction_gib": self.construction / GiB,
                "predicted_comm_gb_per_step": self.comm.total / 1e9,
                "predicted_step_time_s": self.time.step_s,
                "predicted_tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu}


def estimate(plan: Plan, device: Device, constants: TimeConstants | None = None, capacity_gib: float | None = None,
             margin: float = 0.0, activation_model: ActivationModel = "trace") -> Estimate:
    """Memory, communication and time for one plan; `overflow` says why it would not fit in
    min(device memory, capacity_gib) x (1 + margin): at construction, in training, or both."""
    memory = estimate_memory(plan, activation_model, device)
    capacity = min(device.memory_bytes, capacity_gib * GiB if capacity_gib else math.inf)
    result = Estimate(plan, memory, comm_volume(plan), estimate_time(plan, device, constants), capacity,
                      construction=construction_bytes(plan))
    limit = capacity * (1 + margin)
    reasons = []
    if result.construction > limit:
        reasons.append(f"construction needs {result.construction / GiB:.1f} GiB per rank (building the model, "
                       f"before the optimizer) > capacity {limit / GiB:.1f} GiB per GPU")
    steady = memory.overflow(limit)
    if steady:
        reasons.append(steady)
    result.overflow = "; ".join(reasons) or None
    return result



def estimate_space(space, device: Device, capacity_gib: float | None = None, margin: float = 0.0,
                   constants: TimeConstants | None = None, activation_model: ActivationModel = "trace") -> list[Estimate]:
    """Every valid plan of a space (env choices aside: they change neither memory nor volume),
    those that fit first, fastest first; then those that do not, smallest first."""
    results = [estimate(c.plan, device, constants, capacity_gib, margin, activation_model) for c in space.candidates]
    return sorted(results, key=lambda e: (not e.fits, -e.time.tokens_per_s_per_gpu if e.fits else e.memory.total))


class Calibration:
    """Predictions for a sweep's plans, with the time model refitted on every measured trial.

    Memory is predicted from first principles (nothing to fit); step time uses constants fitted
    on the trials measured so far, so each trial's predicted time is an honest out-of-sample
    guess made before it ran."""

    def __init__(self, device: Device, capacity_gib: float | None, activation_model: ActivationModel = "trace"):
        self.device, self.capacity_gib, self.activation_model = device, capacity_gib, activation_model
        self.samples: list[tuple[Plan, float]] = []
        self.constants = TimeConstants()
        self.errors: list[dict[str, float]] = []

    def predict(self, plan: Plan, margin: float = 0.0) -> Estimate:
        return estimate(plan, self.device, self.constants, self.capacity_gib, margin, self.activation_model)

    def observe(self, plan: Plan, measured_peak_bytes: float | None, measured_step_s: float | None) -> dict[str, float]:
        """Record a measured trial: predicted beside measured, relative errors; then refit."""
        predicted = self.predict(plan)
        out = predicted.summary()
        out["time_constants_fitted_on"] = float(self.constants.fitted_on)
        if measured_peak_bytes:
            out["memory_prediction_error"] = predicted.memory.total / measured_peak_bytes - 1
        if measured_step_s:
            out["step_time_prediction_error"] = predicted.time.step_s / measured_step_s - 1
            self.samples.append((plan, measured_step_s))
            self.constants = fit_time_constants(self.samples, self.device)
        self.errors.append(out)
        return out

    def summary(self) -> dict[str, float]:
        """Median absolute relative errors so far, and the fitted constants."""
        import statistics

        out: dict[str, float] = {}
        for key in ("memory_prediction_error", "step_time_prediction_error"):
            values = [abs(e[key]) for e in self.errors if key in e]
            if values:
                out[f"{key}_median_abs"] = statistics.median(values)
        # compute_efficiency: fitted only where the trials' compute differs (fit_time_constants);
        # else DESIGN's reference, held (compute_efficiency_fitted 0).
        out.update(compute_efficiency=self.constants.compute_efficiency,
                   compute_efficiency_fitted=float(self.constants.compute_fitted),
                   comm_efficiency=min(self.constants.comm_efficiency, 1e6), overhead_s=self.constants.overhead_s)
        return out


# Ray's accelerator types (ray/_private/accelerators/nvidia_gpu.py: the NVML name's first model
# token, so "NVIDIA A100-SXM4-40GB" and "NVIDIA A100 80GB PCIe" are both "A100", and "NVIDIA H100
# 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL" are all "H100"; "A100-40G"/"A100-80G" are labels
# users add by hand, ray/util/accelerators/accelerators.py) -> the GPU models they can stand for,
# and the memory (GB) when the type says it.
RAY_ACCELERATOR_TYPES: dict[str, tuple[tuple[str, ...], int | None]] = {
    "H100": (("h100-sxm", "h100-pcie", "h100-nvl"), None),
    "H200": (("h200", "h200-nvl"), None),
    "H800": (("h800", "h800-pcie"), None),
    "GH200": (("gh200",), None),
    "B200": (("b200",), None),
    "A100": (("a100",), None),
    "A100-40G": (("a100",), 40),
    "A100-80G": (("a100",), 80),
    "A800": (("a800",), None),
    "L40S": (("l40s",), None),
    "L40": (("l40",), None),
    "L4": (("l4",), None),
    "A10G": (("a10g",), None),
    "A10": (("a10",), None),
    "V100": (("v100-sxm2", "v100-pcie"), None),
    "V100S": (("v100s-pcie",), None),
}


def devices_for_accelerator_type(accelerator_type: str, devices: dict[str, Device]) -> list[Device]:
    """Device-table entries a Ray accelerator type can be, in table order (exact type, never a
    prefix: "L40" is not "L4"). More than one: the type does not say (A100 40 or 80 GB)."""
    models, memory = RAY_ACCELERATOR_TYPES.get(accelerator_type, ((), None))
    return [d for d in devices.values()
            if d.gpu in models and (memory is None or round(d.memory_gib) == memory)]


def device_from_probe(device_name: str, total_memory_bytes: int, devices: dict[str, Device]) -> Device | None:
    """The table entry for a device as torch reports it (get_device_name, total_memory): its exact
    model, then the entry whose memory is nearest to what the device has (within 15%; the device
    reports a little less than its nominal size). The capacity is what the device reports, if less.
    None when the name or the memory matches no entry."""
    from paratune.measure import gpu_model

    model = gpu_model(device_name)
    if model is None:
        return None
    total_gib = total_memory_bytes / GiB
    candidates = [d for d in devices.values() if d.gpu == model.key]
    if model.memory_gb is not None:  # the name says it ("A100-SXM4-40GB"): only that size
        candidates = [d for d in candidates if round(d.memory_gib) == model.memory_gb] or candidates
    if not candidates:
        return None
    best = min(candidates, key=lambda d: abs(d.memory_gib - total_gib))
    if abs(best.memory_gib - total_gib) > 0.15 * best.memory_gib:
        return None
    return replace(best, memory_gib=min(best.memory_gib, total_gib))


def probe_gpu(accelerator_type: str | None = None, timeout_s: float = 60.0) -> tuple[str, int] | None:
    """(torch.cuda.get_device_name(), total_memory in bytes) of one of the cluster's GPUs, asked by
    a one-GPU Ray task (on a node of `accelerator_type` when given); None when Ray is not running
    or no GPU answers within `timeout_s` (all busy)."""
    import ray

    if not ray.is_initialized():
        return None

    @ray.remote(num_gpus=1, num_cpus=0, max_retries=0)
    def ask() -> tuple[str, int]:
        import torch

        return torch.cuda.get_device_name(0), int(torch.cuda.get_device_properties(0).total_memory)

    options = {"accelerator_type": accelerator_type} if accelerator_type else {}
    ref = ask.options(**options).remote()
    try:
        name, total = ray.get(ref, timeout=timeout_s)
        return str(name), int(total)
    except Exception:  # noqa: BLE001 - no answer is an answer: fall back to the table
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001
            pass
        return None


def device_for_cluster(name: str, resources: dict[str, float], num_workers: int,
                       probe: Callable[[str | None], tuple[str, int] | None] | None = probe_gpu) -> Device:
    """`auto`: the cluster's GPU (Ray's accelerator_type resource) in the device table, or the CPU
    with host memory shared by the workers.

    Where Ray's type does not say which entry (plain "A100": 40 or 80 GB; "H100": SXM, PCIe or
    NVL), one GPU is asked (`probe`, a one-GPU Ray task). If it cannot answer, the entry with the
    least memory (then the first listed) is taken with a warning: predicting 80 GB on a 40 GB card
    would let plans through that cannot fit. A GPU the table does not know is an error that names
    it, never a silent CPU or a near match."""
    if name != "auto":
        return get_device(name)
    devices = load_devices()
    types = sorted(key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:"))
    has_gpus = resources.get("GPU", 0) > 0
    if not types and not has_gpus:
        cpu = devices["cpu"]
        host_gib = resources.get("memory", cpu.memory_gib * GiB * num_workers) / GiB
        return Device("cpu", host_gib / max(1, num_workers), cpu.tflops, cpu.intra_node_gbps, cpu.inter_node_gbps,
                      cpu.gpus_per_node)
    candidates: list[Device] = []
    for ray_type in types:
        candidates += [d for d in devices_for_accelerator_type(ray_type, devices) if d not in candidates]
    if len(candidates) == 1:
        return candidates[0]
    if has_gpus and probe is not None:
        answer = probe(types[0] if len(types) == 1 else None)
        if answer is not None:
            probed = device_from_probe(*answer, devices)
            if probed is not None:
                return probed
    if candidates:
        fallback = min(candidates, key=lambda d: d.memory_gib)
        warnings.warn(f"device: Ray reports accelerator_type {', '.join(types)}, which can be "
                      f"{', '.join(d.name for d in candidates)}, and no GPU answered the probe; predicting "
                      f"with {fallback.name} (the least memory). Set estimate.device (or --device) to be exact.",
                      stacklevel=2)
        return fallback
    raise ValueError(f"device: the cluster's GPUs (accelerator_type {', '.join(types) or 'not reported'}) are "
                     f"not in the device table; allowed: {', '.join(sorted(n for n in devices if n != 'cpu'))}, "
                     "or set estimate.device / add the GPU with --devices FILE")
