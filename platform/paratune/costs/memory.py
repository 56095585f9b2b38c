"""Peak memory per GPU of a plan: the moments of its step, the model's states, and its construction.

Memory follows docs/DESIGN.md ("Memory model"), per rank, as the largest of the moments of a
step (`memory_moments`, `PHASE_WHEN`): the last micro-batch's forward end, loss backward, LM
head backward, first weight gradient, the backward before the blocks, of its first and of its
last block, the embedding's gradient, the gradient reduction after it, and the optimizer step;
under FSDP2 also its last block's all-gather and forward and its first block's reduce-scatter.
At each moment, in five parts:
- weights, gradients, optimizer states: bytes per parameter by strategy and precision, divided by
  the ranks that shard them (ZeRO/FSDP over dp; TP and PP split the model first), where each
  framework holds them at that moment;
- activations: what the model itself holds then (paratune.costs.activations: traced on fake tensors
  at the plan's own micro-batch shape, or DESIGN.md's formula), with the gradients being formed;
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
Expert parallelism (paratune.costs.moe): a rank holds E / ep of each layer's routed experts
(`held_with_experts`: the parameter counts above with the experts cut), which FSDP2 shards over
their expert_dp = dp / ep copies and the dense rest over dp (`shard_params`; under fsdp full the
expert shard is p_e / dp whatever ep: ep saves the gathered block, E / ep experts unsharded at a
time), and DDP keeps whole; the activations are the trace's of a rank's own blocks (its tokens'
top_k rows through E / ep experts: paratune.costs.activations `_rank_experts`) plus the busiest rank's
extra received rows (routing imbalance) and one layer's all-to-all buffers (`add_dispatch`).
Construction is checked apart (paratune.costs.construction `construction_bytes`): the model is built in fp32 before any
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratune.costs.activations import (
    _BLOCK_END,
    PHASES,
    ActivationCoefficients,
    ActivationModel,
    activation_coefficients,
)
from paratune.model.adapters import adapted_params, frozen_base_saving
from paratune.config.devices import Device
from paratune.levers import extra_memory_bytes
from paratune.costs.moe import DEFAULT_IMBALANCE, ExpertShare, add_dispatch, held_with_experts, shard_params
from paratune.config.plan import Plan
from paratune.model.shapes import (
    BYTES,
    GiB,
    HeldParams,
    ModelShape,
    compute_precision,
    float8_cast_bytes,
    fsdp_shard_degree,
    fully_sharded,
    model_shape,
    pipeline_in_flight,
    replicas,
)

ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default


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
    tp_share = 1.0 / plan.tp if plan.sequence_parallel or plan.tp == 1 else 0.5 + 0.5 / plan.tp
    # Other micro-batches in flight (the first stage's): blocks and embedding output; not the head's and loss's
    embedded = (2 if compute_precision(plan) == "bf16-params" else 4) * shape.hidden  # the last stage has 1 in flight
    others = (pipeline_in_flight(plan) - 1) * tokens * (coeff.per_layer * layers_here + embedded) * tp_share
    copies = (coeff.per_layer_fixed * layers_here + coeff.rest_fixed) / plan.tp  # saved for backward
    others += float8_cast_bytes(plan, shape) + extra_memory_bytes(plan, shape)  # the levers' own (paratune.levers)
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


def _ddp_moments(plan: Plan, shape: ModelShape, held: HeldParams, trained: HeldParams,
                 model: dict[str, tuple[float, float]], host: bool) -> dict[str, _Moment]:
    """DDP (torch.nn.parallel.DistributedDataParallel, fp32 parameters; bf16 is autocast).

    The reducer allocates its buckets when DDP is built: 4 bytes a parameter (fp32 gradients),
    for as long as DDP lives. With gradient_as_bucket_view (the default) the gradients are views
    of them, but zero_grad(set_to_none=True) drops the views: the micro-batches under no_sync()
    accumulate into fresh tensors (another 4 bytes a parameter), which the synchronised backward
    copies into the buckets (`mul_out`, divided by the world size) and replaces by views, one
    parameter at a time, last layers first. Without bucket views, param.grad and the buckets are
    separate all the time. Frozen parameters (LoRA's base: `trained` is what has gradients) get
    no bucket, gradient or optimizer state."""
    ga, p = plan.grad_accum, trained.local
    view = plan.ddp is None or plan.ddp.gradient_as_bucket_view
    # LoRA under autocast keeps its frozen linears in bf16 (paratune.model.adapters.store_frozen_base)
    weights, optim, buckets = 4 * held.local - frozen_base_saving(plan, math.ceil(shape.layers / plan.pp)), 8 * p, 4 * p
    after_head = ("after_head", "blocks")
    if view:  # the accumulated tensors, until the synchronised backward replaces them by views
        outside = ({**{ph: p for ph in PHASES}, **{ph: p - trained.head for ph in after_head},
                    "last_block": trained.embedding + trained.first, "embedding": trained.embedding} if ga > 1 else {})
    else:  # param.grad, beside the buckets
        outside = ({ph: p for ph in (*PHASES, "last_block")} if ga > 1
                   else {"after_head": trained.head, "blocks": trained.head,
                         "last_block": p - trained.embedding - trained.first, "embedding": p - trained.embedding})
    moments = {}
    for phase, (acts, forming) in model.items():
        moments[phase] = _Moment(weights, buckets + 4 * outside.get(phase, 0.0) + forming, optim, acts)
    moments["step"] = _Moment(weights, buckets + (0.0 if view else 4 * p), optim + _adamw_temporaries(p, trained.largest, host))
    return moments


def _fsdp_moments(plan: Plan, shape: ModelShape, held: HeldParams, trained: HeldParams,
                  model: dict[str, tuple[float, float]], host: bool, share: ExpertShare | None = None) -> dict[str, _Moment]:
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
    "reduce-scatter" copies its fp32 input into an output of the same size, the gradient shard.

    Frozen parameters (LoRA's base; `trained`: what has gradients) are sharded and gathered like
    the rest, but have no gradient, reduce-scatter input or optimizer state."""
    f = plan.fsdp
    assert f is not None
    s, ga, pb = fsdp_shard_degree(plan), plan.grad_accum, BYTES[plan.precision]
    p, blk, root = held.local, held.layer, held.root
    # Under ep the routed experts (E / ep of them, in `held` already) shard over expert_dp, the rest
    # over dp (`shard_params`; with ep 1 everything over s).
    e_local, e_layer, e_first = (share.local, share.layer, share.first) if share else (0.0, 0.0, 0.0)
    g, g_blk, g_root = trained.local, trained.layer, trained.root  # what has gradients
    ge_local, ge_layer, ge_first = (e_local, e_layer, e_first) if trained is held else (0.0, 0.0, 0.0)

    def per_rank(params: float, experts: float) -> float:
        return shard_params(params, experts, s, share)

    layers_here = math.ceil(shape.layers / plan.pp)
    compute, reduce = pb, 4  # unsharded parameters and gradients in the compute dtype; reduce-scatter in fp32
    # The float8 all-gather (torchao's WeightWithDynamicFloat8CastTensor: fsdp_pre_all_gather casts
    # the shard, the blocks' linears arrive as float8): a gathered block is 1 byte a parameter (its
    # norms, bf16, are ~1e-4 of it). The root (embedding, head: not converted) stays in bf16.
    gathered_bytes = 1 if plan.float8_all_gather else compute
    moments: dict[str, _Moment] = {}
    if not fully_sharded(plan):
        # no_shard: FSDP2's replicate, DDP semantics (no-sync accumulation between micro-batches),
        # with bf16 unsharded parameters beside the fp32 ones under mixed precision; or a
        # model-parallel plan with one replica, which applies no FSDP2 (autocast: its weight
        # copies are the trace's).
        copy = compute * p if compute != 4 and compute_precision(plan) == "bf16-params" else 0.0
        weights = 4 * p + copy
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(weights, (4 * g if ga > 1 else 0.0) + forming, 8 * g, acts, reduce * g_blk)
        moments["step"] = _Moment(4 * p, 4 * g, 8 * g + _adamw_temporaries(g, trained.largest, host))
        return _fsdp_offloaded(plan, moments, p / s, g / s)
    alone = s == 1  # a one-rank mesh: no all-gather, no reduce-scatter
    ps, gs = per_rank(p, e_local), per_rank(g, ge_local)
    shards, optim = 4 * ps, 8 * gs
    if ga > 1:  # gradient shards accumulated from the earlier micro-batches
        reduced = {phase: 4 * gs for phase in (*PHASES, *_BLOCK_END, "next_block", "last_block", "reduce")}
    else:  # the blocks' shards appear as their reduce-scatters finish
        reduced = {"next_block": 4 * per_rank(g_blk, ge_layer),
                   "last_block": 4 * per_rank(g - g_root - trained.first, ge_local - ge_first),
                   "embedding": 4 * per_rank(g - g_root, ge_local), "reduce": 4 * per_rank(g - g_root, ge_local)}
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
    rs_input = {"next_block": reduce * g_blk, "last_block": reduce * g_blk, "embedding": reduce * g_blk}
    ends = {phase: model.pop(phase) for phase in _BLOCK_END if phase in model}
    # In forward a block's all-gather output stays beside its unsharded parameters until the next
    # block's copy-out (`wait_for_unshard`: the implicit prefetch's all_gather_state); the last
    # block's until the root's post-forward (_fsdp_state.py `_post_forward`), after the loss.
    output = 0.0 if alone else gathered_bytes * blk
    kept = {"forward": output, "logits": output}
    for phase, (acts, grads) in model.items():  # grads: those FSDP2 holds and those being formed
        moments[phase] = _Moment(shards + compute * root + gathered_bytes * gathered[phase], reduced.get(phase, 0.0) + grads, optim,
                                 acts, rs_input.get(phase, 0.0) + kept.get(phase, 0.0))
    if "gather" in ends and "block_forward" in ends:
        # The last block's all-gather: the previous block's output (the root's, with one block) not
        # yet freed, its own output and its unsharded parameters being copied out of it.
        before = layers_here * blk - blk if not f.reshards_after_forward else 0.0
        previous = 0.0 if alone else (gathered_bytes * blk if layers_here > 1 else compute * root)
        acts, grads = ends["gather"]
        moments["gather"] = _Moment(shards + compute * root + gathered_bytes * (before + blk), reduced.get("forward", 0.0) + grads,
                                    optim, acts, previous + output)
        acts, grads = ends["block_forward"]
        moments["block_forward"] = _Moment(shards + compute * root + gathered_bytes * (before + blk),
                                           reduced.get("forward", 0.0) + grads, optim, acts, output)
    if "block_end" in ends and "block_reduced" in ends:
        # The first block's post-backward: resharded, then its reduce-scatter.
        after = shards + compute * root + gathered_bytes * (in_backward - blk)  # what it prefetched (or all but it) stays whole
        (acts, grads), (acts_after, grads_after) = ends["block_end"], ends["block_reduced"]
        # foreach_reduce: the fp32 input beside the unsharded gradients it copies; once they are
        # freed, the output (a shard; the whole block on one rank) and gloo's copy of the input.
        copy_in = _Moment(after, reduced.get("blocks", 0.0) + grads, optim, acts, reduce * g_blk)
        scatter = _Moment(after, reduced.get("blocks", 0.0) + grads_after, optim, acts_after,
                          reduce * g_blk + reduce * per_rank(g_blk, ge_layer) + (reduce * g_blk if host and not alone else 0.0))
        moments["block_reduce"] = max(copy_in, scatter, key=lambda m: m.total)
    gloo_copy = reduce * g_root if host and not alone else 0.0
    copy_in = _Moment(shards, reduced["reduce"] + compute * g_root, optim, 0.0, reduce * g_root)
    scatter = _Moment(shards, reduced["reduce"] + compute * trained.head + reduce * g_root / s, optim, 0.0,
                      reduce * g_root + gloo_copy)
    moments["reduce"] = max(copy_in, scatter, key=lambda m: m.total)
    moments["step"] = _Moment(shards, 4 * gs, optim + _adamw_temporaries(gs, trained.largest / s, host))
    return _fsdp_offloaded(plan, moments, ps, gs)


def _fsdp_offloaded(plan: Plan, moments: dict[str, _Moment], per_shard: float, trained_per_shard: float) -> dict[str, _Moment]:
    """Under CPU offload the shards (`per_shard` parameters), their gradients (`trained_per_shard`:
    those that have one) and the optimizer live in host memory."""
    if plan.fsdp is None or not plan.fsdp.cpu_offload:
        return moments
    for m in moments.values():
        m.weights = max(0.0, m.weights - 4 * per_shard)
        m.gradients = max(0.0, m.gradients - 4 * trained_per_shard)
        m.optimizer = 0.0
    return moments


def _zero_moments(plan: Plan, shape: ModelShape, held: HeldParams, trained: HeldParams,
                  model: dict[str, tuple[float, float]], host: bool) -> dict[str, _Moment]:
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
    - LoRA (`trained`: the adapters): the frozen base is held as any weight; gradients, buckets'
      contents, the fp32 master and moments are the adapters'. ZeRO-1/2's bucket comes with the
      first gradient: without a head adapter, in the first block's backward.
    - The optimizer: paratune's torch AdamW over DeepSpeed's flat fp32 partition on CPU (two
      partition-sized temporaries per step), DeepSpeed's fused torch AdamW on GPUs (none)."""
    z = plan.zero
    assert z is not None
    stage, dp, ga, pb = z.stage, replicas(plan), plan.grad_accum, BYTES[plan.precision]
    p = shape.total / plan.tp if stage == 3 and plan.tp > 1 else held.local
    g, t = (p, held) if trained is held else (trained.local, trained)  # what has gradients (LoRA: adapters)
    bucketed = _AFTER_FIRST_GRAD if trained is held or t.head else ("last_block", "embedding")
    part = dp if stage >= 1 else 1
    bucket = pb * z.reduce_bucket_size * (2 if z.overlap_comm and stage in (1, 2) else 1)
    flat = pb * min(z.reduce_bucket_size, g)
    fused = not host and plan.optimizer in ("auto", "deepspeed")
    temps = 0.0 if fused else (2 if host else 1) * 4 * g / part
    optim = (12 if stage >= 1 else 8) * g / part
    step_grads = 4 * g / part + (pb * g / part if pb != 4 or stage < 3 else 0.0)
    if z.offload_optimizer:  # master weights, moments and the fp32 gradients live in host memory
        optim, temps, step_grads = 0.0, 0.0, (pb * g / part if stage < 3 else 0.0)
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
        grads = pb * g / dp
        # The forward's flat buffer, beside the parameters copied out of it, until the LM head.
        fetch = pb * min(embedding + blocks + head, max(z.stage3_prefetch_bucket_size, held.largest)) if dp > 1 else 0.0
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(own + gathered[phase] + (fetch if phase == "forward" else 0.0), grads + forming,
                                     optim, acts, bucket)
        moments["reduce"] = _Moment(own + resident(embedding), grads, optim, 0.0, bucket + flat * (2 if host else 1))
        moments["step"] = _step(own, grads, step_grads, optim, temps, pb, g / dp, bucket)
        return moments
    weights = pb * p
    if stage == 2:
        partition = pb * g / dp  # grads_in_partition: the averaged gradients of the rank's partition
        # It exists from the first bucket's reduction: an earlier micro-batch's, or, in a lone
        # micro-batch, once reduce_bucket_size elements of gradients have arrived.
        filled = g > z.reduce_bucket_size
        earlier = ({phase: partition for phase in (*PHASES, "last_block")} if ga > 1
                   else {"last_block": partition, "embedding": partition} if filled else {})
        for phase, (acts, forming) in model.items():
            moments[phase] = _Moment(weights, earlier.get(phase, 0.0) + forming, optim, acts,
                                     bucket if phase in bucketed else 0.0)
        # The last bucket's flattened copy beside the partition's gradients: kept from the earlier
        # micro-batches; in a lone micro-batch, allocated once the copy is garbage.
        # A full bucket is reduced while the gradient that did not fit in it waits.
        pending = pb * t.largest if filled else 0.0
        moments["reduce"] = _Moment(weights, (partition if ga > 1 else 0.0) + pending, optim, 0.0,
                                    bucket + (flat if ga > 1 else max(flat, partition)))
        moments["step"] = _step(weights, 0.0, step_grads, optim, temps, pb, g / dp)
        return moments
    # Stage 0/1: whole gradients accumulate in param.grad; reduced at the boundary.
    whole = ({phase: pb * g for phase in (*PHASES, "last_block")} if ga > 1
             else {"after_head": pb * t.head, "blocks": pb * t.head,
                   "last_block": pb * (g - t.embedding - t.first), "embedding": pb * (g - t.embedding)})
    keep = bucket if stage == 1 else 0.0
    for phase, (acts, forming) in model.items():
        moments[phase] = _Moment(weights, whole.get(phase, 0.0) + forming, optim, acts,
                                 keep if ga > 1 or phase in bucketed else 0.0)
    # Reducing: the gradients not yet in a bucket, the bucket and its flattened copy; then the
    # partition's gradients (`grads_in_partition`), once the copy is garbage.
    partition = pb * g / dp if stage == 1 else 0.0
    moments["reduce"] = _Moment(weights, pb * max(0.0, g - z.reduce_bucket_size), optim, 0.0,
                                keep + max(flat, partition))
    step_temps = temps if stage == 1 else (0.0 if fused else _adamw_temporaries(g, t.largest, host))
    moments["step"] = (_step(weights, 0.0, step_grads, optim, step_temps, pb, g / dp, 0.0) if stage == 1
                       else _Moment(weights, pb * g, optim + step_temps))
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
                   coeff: ActivationCoefficients | None = None, imbalance: float = DEFAULT_IMBALANCE) -> dict[str, _Moment]:
    """Bytes per part at every moment of the step the model considers (PHASE_WHEN), per rank.
    `imbalance`: max / mean tokens per expert (expert-parallel plans; paratune.costs.moe)."""
    shape = model_shape(plan)
    coeff = coeff or activation_coefficients(plan, model)
    held, share = held_with_experts(plan, shape)
    held, trained = adapted_params(plan, held, math.ceil(shape.layers / plan.pp))
    per_phase = _model_phase_bytes(plan, shape, coeff, keeps_weight_copies=compute_precision(plan) == "bf16",
                                   held=fully_sharded(plan))
    host = _on_host(plan, device)
    if plan.strategy == "fsdp":
        moments = _fsdp_moments(plan, shape, held, trained, per_phase, host, share)
    elif plan.strategy == "ddp":
        moments = _ddp_moments(plan, shape, held, trained, per_phase, host)
    else:
        moments = _zero_moments(plan, shape, held, trained, per_phase, host)
    if share is not None:
        add_dispatch(plan, moments, imbalance)
    return moments


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
    held, share = held_with_experts(plan, shape)
    held, trained = adapted_params(plan, held, math.ceil(shape.layers / plan.pp))  # LoRA: only adapters train
    local, layer, g = held.local, held.layer, trained.local
    dp, ga, pb = replicas(plan), plan.grad_accum, BYTES[plan.precision]
    if plan.strategy == "ddp":
        # Autocast keeps fp32 parameters; gradients live in DDP's buckets (as views by default).
        unbucketed = plan.ddp is not None and not plan.ddp.gradient_as_bucket_view
        weights = 4 * local - frozen_base_saving(plan, math.ceil(shape.layers / plan.pp))
        return ModelStates(weights, 4 * g, 8 * g, 4 * g if unbucketed else 0.0)
    if plan.strategy == "fsdp":
        f = plan.fsdp
        assert f is not None
        shard = fsdp_shard_degree(plan)
        per_shard = shard_params(local, share.local if share else 0.0, shard, share)  # experts over expert_dp
        trained_shard = per_shard if trained is held else g / shard
        weights, optim = 4 * per_shard, 8 * trained_shard  # fp32 shards and their moments
        if shard > 1:
            if f.reshards_after_forward:  # gathered in backward: the root, a block and the one prefetched
                weights += pb * (held.root + layer * (1 + max(1, f.prefetch)))
            else:
                weights += pb * local  # grad_op: everything stays gathered until backward
            # Reduce-scattered every micro-batch: only shards accumulate (fp32).
            grads, buffers = (4 * trained_shard if ga > 1 else 0.0), 4 * trained.layer  # + the block being reduced
            step = 4 * trained_shard if ga == 1 else 0.0
        else:
            grads, buffers, step = 4 * g, 0.0, 0.0
        if f.cpu_offload:  # shards, their gradients and the optimizer live in host memory
            weights, optim, grads, step = weights - 4 * per_shard, 0.0, 0.0, 0.0
        return ModelStates(weights, grads, optim, buffers, step)
    z = plan.zero
    assert z is not None
    if z.stage == 3 and plan.tp > 1:  # ZeRO-3 partitions what AutoTP leaves whole over the tp ranks too
        local = g = shape.total / plan.tp  # (LoRA: tp 1)
    stage, part = z.stage, dp if z.stage >= 1 else 1
    weights = pb * local / (dp if stage == 3 else 1)
    if stage == 3 and dp > 1:
        # Gathered parameters stay resident up to stage3_max_live_parameters (DeepSpeed's default
        # 1e9 elements) plus the module in use; DeepSpeed's estimator assumes only its largest layer.
        largest = max(layer, shape.embedding / plan.tp, shape.head / plan.tp)
        weights += pb * min(local, ZERO3_MAX_LIVE_PARAMETERS + largest)
    # An fp32 flat copy of each trained partition (the master; in fp32 too) + 2 moments.
    optim = (12 if stage >= 1 else 8) * g / part
    step = 0.0
    if stage in (2, 3):  # ZeRO-3's grad_partitions_flat_buffer / ZeRO-2's averaged partition
        grads = pb * g / dp  # in the model dtype
        step = 4 * g / dp  # + its fp32 copy for the optimizer step
    else:
        grads = pb * g if ga > 1 else 0.0  # whole gradients, reduced at the boundary
        step = 4 * g / part if stage == 1 else 0.0
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


def activation_bytes(plan: Plan, model: ActivationModel = "trace", shape: ModelShape | None = None) -> tuple[float, str]:
    """Activation bytes a rank holds at the start of its last micro-batch's backward (the saved
    activations of the micro-batches it holds at once and the loss's buffers; the head's gradient
    being formed is a gradient, not counted here)."""
    shape = shape or model_shape(plan)
    coeff = activation_coefficients(plan, model)
    acts, _ = _model_phase_bytes(plan, shape, coeff, keeps_weight_copies=compute_precision(plan) == "bf16")["loss"]
    return acts, coeff.method


def estimate_memory(plan: Plan, model: ActivationModel = "trace", device: "Device | None" = None,
                    imbalance: float = DEFAULT_IMBALANCE) -> MemoryEstimate:
    """Peak memory per rank: the moment of the step that holds the most (`memory_moments`).
    `device`: where the plan runs, when the plan says `auto` (the CPU entry: gloo collectives
    and torch's single-tensor AdamW; a GPU: NCCL and the multi-tensor AdamW). `imbalance`: the
    routing's max / mean tokens per expert (expert-parallel plans: paratune.costs.moe)."""
    coeff = activation_coefficients(plan, model)
    moments = memory_moments(plan, model, device, coeff, imbalance)
    name = max(moments, key=lambda k: moments[k].total)
    peak = moments[name]
    method = f"{coeff.method}; peak at {PHASE_WHEN[name]}"
    return MemoryEstimate(peak.weights, peak.gradients, peak.optimizer, peak.activations, peak.comm_buffers,
                          method=method, phase=name, phases={k: m.total for k, m in moments.items()})
