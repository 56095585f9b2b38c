"""Predict before you spend: a plan's memory, communication and roofline step time, together.

Memory is paratune.costs.memory's (the moments of a step; the activations: paratune.costs.activations); the
model's shares per rank: paratune.model.shapes; the device table: paratune.config.devices. Here:
communication volume per rank (DESIGN.md "Communication model"; the data-parallel collectives of
each strategy are described once, `data_parallel_comm`, and paratune.costs.timemodel times the same
description on measured curves), the roofline's time terms and their fit, and `estimate` /
`estimate_space` / `Roofline` (a sweep's predictions, refitted on its trials).

Time is a roofline: compute = a rank's model FLOPs x (1 + the recomputed share: `recompute_share`)
at the rates a training step reaches (`achieved_compute_seconds`: on a GPU with kernel figures,
paratune.costs.efficiency's matmul, causal-attention and HBM rates over their end-to-end share; else
DEFAULT_COMPUTE_EFFICIENCY of the dense peak, `compute_seconds`); communication = ring-collective
bytes over the group's bus bandwidth (`collective_gbps`: NVLink inside a node, the group's NICs
together across nodes); FSDP2's gathers and reduce-scatters hide under the whole micro-batch,
DDP's and ZeRO's reductions under its backward (`dp_overlap_share`), TP's collectives are exposed
but the share the levers hide (paratune.levers.tp_comm_hidden: async TP's forward); PP adds its bubble; expert parallelism
(paratune.costs.moe) adds its all-to-all, exposed, on the node's links while an ep group fits in a
node, else one NIC, and scales the routed experts' compute by the routing's imbalance (a measured
`routing_balance`, else DEFAULT_IMBALANCE). Four constants (the compute rate's multiplier, the
links' achieved share, fixed costs per step and per micro-batch) are fitted from measured trials
(`fit_time_constants`); until then 1 (as modelled), the link share NCCL measures on the device's
architecture (paratune.costs.efficiency.LINK_SHARE; 70% where none is known), 0 and 5 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from paratune.model.adapters import adapted_params
from paratune.costs.activations import ActivationModel
from paratune.costs.bands import PredictionBand, memory_verdict, prediction_band
from paratune.config.devices import Device
from paratune.costs.efficiency import (
    DEFAULT_COMPUTE_EFFICIENCY,
    compute_parts,
    float8_flops_share,
    fsdp_copy_seconds,
    has_kernel_rates,
    link_share,
    step_flops,
)
from paratune.costs.construction import construction_bytes
from paratune.costs.cuda_memory import CudaOverheads, cuda_overheads
from paratune.costs.risk import order_by_expected_gain
from paratune.levers import compute_time_factor, tp_comm_hidden
from paratune.costs.memory import MemoryEstimate, estimate_memory
from paratune.costs.moe import (
    DEFAULT_IMBALANCE,
    all_to_all_bytes,
    all_to_all_crosses_nodes,
    expert_layout,
    held_with_experts,
)
from paratune.config.plan import Plan
from paratune.model.shapes import BYTES, GiB, ModelShape, model_shape, offload_bytes, replicas


def checked_imbalance(routing_balance: float | None) -> float:
    """The routing's max / mean tokens per expert to predict with: a measured one, else
    DEFAULT_IMBALANCE; it cannot be below 1 (the busiest expert gets at least the mean)."""
    if routing_balance is None:
        return DEFAULT_IMBALANCE
    if not isinstance(routing_balance, (int, float)) or not math.isfinite(routing_balance) or routing_balance < 1.0:
        raise ValueError(f"routing_balance: got {routing_balance!r}; allowed: a number >= 1 (max / mean tokens per "
                         "expert: 1 is perfect balance)")
    return float(routing_balance)


# --------------------------------------------------------------------------- communication
@dataclass
class CommVolume:
    """Bytes one rank sends per optimizer step, by parallel dimension."""

    dp: float
    tp: float
    pp: float
    cp: float = 0.0
    ep: float = 0.0  # expert parallelism's all-to-all (dispatch and combine; paratune.costs.moe)

    @property
    def total(self) -> float:
        return self.dp + self.tp + self.pp + self.cp + self.ep


@dataclass(frozen=True)
class DataParallelComm:
    """What a plan's data-parallel ranks exchange in a step: the one place that says it per
    strategy. The roofline counts its bytes (`comm_volume`), paratune.costs.timemodel times the same
    collectives on the profile's measured curves (`compose`).

    `scheme`: "all_reduce" (DDP; FSDP2's replicate, for no_shard), "fsdp" (FSDP2's fully_shard),
    "zero" (DeepSpeed, `stage`). Gradients: `gradients` ("all_reduce" or "reduce_scatter"), every
    micro-batch or once per step (no_sync / the accumulation boundary), `grad_bytes` per element
    (fp32 under DDP and FSDP2, the model dtype under DeepSpeed). Parameters: all-gathers per
    micro-batch (FSDP2: 2 where blocks reshard after forward, else 1; ZeRO-3: forward and
    backward) or per step (ZeRO-1/2: the updated partition), `param_bytes` per element.
    `ddp_buckets`: DDP's reducer buckets (bucket_cap_mb; not under pipeline stages, which run
    FSDP2's replicate: one all-reduce per unit)."""

    scheme: Literal["all_reduce", "fsdp", "zero"]
    gradients: Literal["all_reduce", "reduce_scatter"]
    grads_every_micro_batch: bool
    grad_bytes: int
    param_bytes: int
    gathers_per_micro_batch: int = 0
    gathers_per_step: int = 0
    ddp_buckets: bool = False
    stage: int | None = None


def data_parallel_comm(plan: Plan) -> DataParallelComm:
    """The plan's data-parallel collectives (DataParallelComm)."""
    pb = BYTES[plan.precision]
    if plan.strategy == "ddp" or (plan.strategy == "fsdp" and plan.fsdp and plan.fsdp.sharding == "no_shard"):
        # fp32 gradients, once per step (no_sync between micro-batches)
        return DataParallelComm("all_reduce", "all_reduce", False, 4, pb, ddp_buckets=plan.strategy == "ddp" and plan.pp == 1)
    if plan.strategy == "fsdp":  # reduce-scatter every micro-batch; FSDP2 gathers in its param dtype
        gathers = 2 if plan.fsdp and plan.fsdp.reshards_after_forward else 1
        return DataParallelComm("fsdp", "reduce_scatter", True, 4, pb, gathers_per_micro_batch=gathers)
    stage = plan.zero.stage if plan.zero else 2
    # ZeRO-0 all-reduces at the boundary, ZeRO-1 reduce-scatters there, ZeRO-2/3 every micro-batch;
    # ZeRO-1/2 all-gather the updated partition once, ZeRO-3 gathers parameters in forward and backward.
    return DataParallelComm("zero", "all_reduce" if stage == 0 else "reduce_scatter", stage >= 2, pb, pb,
                            gathers_per_micro_batch=2 if stage == 3 else 0,
                            gathers_per_step=1 if stage in (1, 2) else 0, stage=stage)


def comm_volume(plan: Plan, imbalance: float = DEFAULT_IMBALANCE) -> CommVolume:
    """Ring-collective volume per rank (DESIGN.md "Communication model"). Under ep the routed
    experts (E / ep on a rank) are reduced (and, under FSDP2, gathered) over their expert_dp ranks,
    the dense rest over dp, and each MoE layer's tokens travel by all-to-all (`imbalance`: the
    routing's max / mean tokens per expert, paratune.costs.moe)."""
    shape = model_shape(plan)
    held, share = held_with_experts(plan, shape)
    local = held.local
    experts = share.local if share else 0.0
    ga, pb = plan.grad_accum, BYTES[plan.precision]
    d = data_parallel_comm(plan)

    def ring_bytes(params: float, ranks: int, root: float, grads: float | None = None) -> float:
        """`grads`: the parameters with gradients (LoRA: the adapters), else all of `params`."""
        grads = params if grads is None else grads
        ring = 2 * (ranks - 1) / ranks if ranks > 1 else 0.0  # all-reduce; half of it for a reduce-scatter or all-gather
        if d.gradients == "all_reduce":
            return ring * d.grad_bytes * grads
        if d.gathers_per_micro_batch:  # gathers and reduce-scatters every micro-batch
            gathered = d.param_bytes * params
            if plan.float8_all_gather:  # the blocks' linears gathered as float8 (1 byte), the root in bf16
                gathered = (params - root) + d.param_bytes * root
            return ring / 2 * ga * (d.gathers_per_micro_batch * gathered + d.grad_bytes * grads)
        # reduce-scatters (every micro-batch or at the boundary), the updated partition gathered once
        reduces = ga if d.grads_every_micro_batch else 1
        return ring / 2 * (reduces * d.grad_bytes * grads + d.gathers_per_step * d.param_bytes * grads)

    # LoRA: the frozen base is gathered (FSDP2) but has no gradient to reduce
    trained = adapted_params(plan, held, math.ceil(shape.layers / plan.pp))[1].local if plan.peft else None
    dp_bytes = ring_bytes(local - experts, replicas(plan), held.root, trained)
    if share is not None:  # the experts' copies: expert_dp ranks, ep apart
        dp_bytes += ring_bytes(experts, share.expert_dp, 0.0)
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
    ep_bytes = 0.0
    if share is not None:
        layout = expert_layout(plan)
        moe_here = min(math.ceil(shape.layers / plan.pp), layout.moe_layers)
        # with tp, the tp ranks share their tokens and each dispatches 1 / tp of them (paratune.parallel.ep)
        ep_bytes = ga * all_to_all_bytes(tokens / plan.tp, layout.top_k, shape.hidden, pb, plan.ep, moe_here, imbalance)
    return CommVolume(dp_bytes, tp_bytes, pp_bytes, cp_bytes, ep_bytes)


# --------------------------------------------------------------------------- time
@dataclass
class TimeConstants:
    """Achieved share of the modelled compute rate (`achieved_compute_seconds`: 1 = as modelled;
    a sweep fits it on its trials) and of link bandwidth, and fixed costs per step and micro-batch."""

    compute_efficiency: float = 1.0
    comm_efficiency: float = 0.7
    overhead_s: float = 0.0
    # Fixed cost of each micro-batch (kernel launches, Python, the loss): why bigger micro-batches
    # run faster at the same compute.
    micro_batch_overhead_s: float = 0.005
    fitted_on: int = 0  # trials the constants were fitted on (0: defaults)
    compute_fitted: bool = False  # compute_efficiency fitted on them (False: the prior, held)


def prior_constants(device: Device) -> TimeConstants:
    """The constants before any trial: the modelled compute rate, the device's measured link share
    (paratune.costs.efficiency.link_share), no fixed cost a step, 5 ms a micro-batch."""
    return TimeConstants(comm_efficiency=link_share(device))


@dataclass
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble: float
    step_s: float
    tokens_per_s_per_gpu: float


def compute_seconds(plan: Plan, device: Device, shape: ModelShape | None = None,
                    imbalance: float = DEFAULT_IMBALANCE) -> float:
    """Ideal compute time per step of one rank at the device's dense peak: `step_flops` (model
    FLOPs x (1 + recomputed share), LoRA's and ep's counted), the float8 matmuls at the device's
    FP8 peak (where it has one), the rest at the plan's precision's; compile an assumed
    paratune.levers.compile's COMPILE_COMPUTE_SAVING off. What a device without kernel figures is predicted from
    (`achieved_compute_seconds`), and the floor no measured step beats."""
    shape = shape or model_shape(plan)
    flops, _ = step_flops(plan, shape, imbalance)
    peak = device.tflops.get(plan.precision, device.tflops.get("fp32", 1.0)) * 1e12
    f8 = float8_flops_share(plan, shape) if "fp8" in device.tflops else 0.0
    seconds = flops * ((1 - f8) / peak + f8 / (device.tflops.get("fp8", 1.0) * 1e12))
    return seconds * compute_time_factor(plan)  # the levers' (compile: COMPILE_COMPUTE_SAVING off)


def achieved_compute_seconds(plan: Plan, device: Device, shape: ModelShape | None = None,
                             imbalance: float = DEFAULT_IMBALANCE) -> float:
    """Compute time per step of one rank as a training step reaches it: on a GPU with kernel
    figures (paratune.costs.efficiency: matmuls at its measured matmul rate, causal attention at
    FlashAttention's by sequence length, memory-bound ops at its HBM bandwidth, over the share a
    training step reaches); elsewhere (the CPU entry, a device without them) the ideal time over
    DEFAULT_COMPUTE_EFFICIENCY of the peak (DESIGN's reference MFU)."""
    shape = shape or model_shape(plan)
    if plan.precision == "bf16" and has_kernel_rates(device):
        return compute_parts(plan, device, shape, imbalance=imbalance).seconds
    return compute_seconds(plan, device, shape, imbalance) / DEFAULT_COMPUTE_EFFICIENCY


def collective_gbps(device: Device, group: int, per_node: int, stride: int = 1) -> float:
    """Bus bandwidth (GB/s per rank) of a ring collective over `group` ranks `stride` apart, laid
    out node by node (`per_node` GPUs a node). Inside a node: NVLink's (intra_node_gbps). Across
    nodes NCCL builds one ring per NIC and runs them at once, each node crossing into the next
    through every NIC its ranks have (one a GPU, inter_node_gbps each): a ring over whole nodes
    gets the node's NICs together, up to NVLink's figure (NVIDIA/nccl#412, a maintainer: with
    more NICs "you should get more bandwidth, up to ... the NVLink intra-node bandwidth";
    NVIDIA/nccl-tests#290: 46-48 GB/s per 400 Gb/s NIC). A group with one rank a node (tp x cp
    filling the node) has one NIC."""
    span = group * stride
    if span <= per_node:
        return device.intra_node_gbps
    on_a_node = max(1, min(group, per_node // max(1, stride)))
    return min(device.intra_node_gbps, device.inter_node_gbps * on_a_node)


def dp_overlap_share(plan: Plan) -> float:
    """The share of the compute the data-parallel collectives can hide under: FSDP2's gathers are
    prefetched in forward and in backward and its reduce-scatters follow each block's backward
    (the whole micro-batch); DDP's and ZeRO's reductions run under the backward only (2/3)."""
    return 1.0 if data_parallel_comm(plan).scheme == "fsdp" else 2 / 3


def _time_terms(plan: Plan, device: Device, imbalance: float = DEFAULT_IMBALANCE) -> tuple[float, float, float, float]:
    """(compute s as a step reaches it, ideal DP comm s, ideal exposed TP+PP+CP+EP comm s, pipeline
    bubble fraction). Collectives over links at `collective_gbps`: the dp group (ranks tp x cp
    apart) across nodes gets its ranks' NICs together."""
    shape = model_shape(plan)
    compute = achieved_compute_seconds(plan, device, shape, imbalance)
    vol = comm_volume(plan, imbalance)
    per_node = plan.gpus_per_node or device.gpus_per_node
    bw = lambda group, stride=1: collective_gbps(device, group, per_node, stride) * 1e9  # noqa: E731
    dp_s = vol.dp / bw(replicas(plan), plan.tp) if vol.dp else 0.0
    mp_s = vol.tp / bw(plan.tp) * (1 - tp_comm_hidden(plan)) if vol.tp else 0.0  # the levers' (async TP)
    # a stage boundary crosses nodes once the stages do: one NIC a pair
    mp_s += vol.pp / ((device.inter_node_gbps if plan.num_workers > per_node else device.intra_node_gbps) * 1e9)
    mp_s += vol.cp / bw(plan.cp, plan.tp) if vol.cp else 0.0  # counted as exposed: the ring waits on its peers
    # The all-to-all, exposed: the experts wait on their tokens, the next layer on their results;
    # an all-to-all cannot aggregate a node's NICs (NVIDIA/nccl-tests#267): one NIC a rank.
    crosses = all_to_all_crosses_nodes(plan, per_node)
    mp_s += vol.ep / ((device.inter_node_gbps if crosses else device.intra_node_gbps) * 1e9) if vol.ep else 0.0
    mp_s += offload_bytes(plan, shape) / (device.host_link_gbps * 1e9)  # not overlapped either
    m = plan.grad_accum
    # Interleaving gives each rank v = 2 stages, which divides the fill/drain time by v (Megatron).
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    bubble = (plan.pp - 1) / (v * m + plan.pp - 1) if plan.pp > 1 else 0.0
    return compute, dp_s, mp_s, bubble


def estimate_time(plan: Plan, device: Device, constants: TimeConstants | None = None,
                  imbalance: float = DEFAULT_IMBALANCE) -> TimeEstimate:
    """Step time: compute (as a step reaches it, x 1 / `compute_efficiency`, 1 until a sweep
    fits it), the DP collectives beyond what `dp_overlap_share` of the compute hides, the exposed
    TP/PP/CP/EP collectives, FSDP2's copies around its collectives (`fsdp_copy_seconds`), the
    pipeline bubble, a fixed cost per step and per micro-batch."""
    c = constants or prior_constants(device)
    compute, dp_s, mp_s, bubble = _time_terms(plan, device, imbalance)
    compute /= c.compute_efficiency
    comm = (dp_s + mp_s) / c.comm_efficiency
    exposed = max(0.0, dp_s / c.comm_efficiency - compute * dp_overlap_share(plan)) + mp_s / c.comm_efficiency
    copies = fsdp_copy_seconds(plan, device)  # FSDP2's copies around its collectives, on the compute stream
    compute += copies
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
    step ≈ a·compute + b·comm + c + d·micro-batches, all >= 0 (compute as a step reaches it,
    `achieved_compute_seconds`: a = 1/compute_efficiency, the share of that rate reached; b =
    1/comm efficiency), fitting only what the trials can tell apart. A term whose column has
    (near) no spread across them (IDENTIFIABLE_SPREAD) is collinear with the constant c and is
    held at its prior (`prior_constants`: the modelled compute rate, the device's measured link
    share, the micro-batch cost): in a sweep every plan computes the same FLOPs, and a fitted compute
    coefficient came out anywhere from 11% to 3700% of peak. With few trials, fewer terms (in
    the order compute, overhead, micro-batches, comm). Compute is never faster than the device's
    dense peak (a >= the ideal-at-peak over the modelled time, the largest of the trials'), and
    held, a never makes compute alone outlast a measured step. `compute_fitted` says whether it
    was fitted."""
    import numpy as np

    prior = prior_constants(device)
    if not samples:
        return prior
    rows, y, floor = [], [], 0.0
    for plan, measured in samples:
        compute, dp_s, mp_s, bubble = _time_terms(plan, device)
        rows.append([compute / (1 - bubble), dp_s + mp_s, 1.0, float(plan.grad_accum)])
        y.append(measured - fsdp_copy_seconds(plan, device) / (1 - bubble))  # a known cost, not fitted
        floor = max(floor, compute_seconds(plan, device) / compute if compute > 0 else 0.0)
    X, Y = np.array(rows), np.array(y)
    n = len(samples)
    priors = np.array([1 / prior.compute_efficiency, 1 / prior.comm_efficiency, prior.overhead_s,
                       prior.micro_batch_overhead_s])
    identifiable = [j for j in (0, 2, 3, 1) if j == 2 or _spread(X[:, j]) >= IDENTIFIABLE_SPREAD]
    active = identifiable[:n]  # no more terms than trials
    coef = priors.copy()
    coef[active] = 0.0
    if 0 not in active and X[:, 0].min() > 0:  # held: compute alone never longer than a measured step
        coef[0] = max(floor, min(coef[0], float((Y / X[:, 0]).min())))
    for _ in range(8):  # non-negative least squares by hand: drop terms that come out negative
        rest = Y - X @ np.where(np.isin(np.arange(4), active), 0.0, coef)
        sol, *_ = np.linalg.lstsq(X[:, active], rest, rcond=None) if active else (np.zeros(0),)
        if 0 in active and sol[active.index(0)] < floor:  # faster than the device's peak: hold at the peak
            coef[0] = floor
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
    # The step's parts (s) when `time` came from a paratune.costs.predict.TimePredictor (`paratune plan
    # --profile`: the profile-composed model's compute, communication, optimizer, overheads).
    time_parts: dict[str, float] = field(default_factory=dict)
    # Why the device cannot run the plan's levers (paratune.levers.device_refusal), else None;
    # such a plan does not fit (`overflow` says so too).
    refusal: str | None = None
    # Model FLOPs per token x predicted tokens/s/GPU over the device's bf16 peak (float8 plans
    # too: their FP8 matmuls are not a separate peak), None without a bf16 peak.
    mfu_vs_bf16_peak: float | None = None
    # The prediction's expected error (paratune.costs.bands.prediction_band) and the memory's verdict
    # against the capacity within it (paratune.costs.bands.memory_verdict: fits, tight, over).
    band: PredictionBand | None = None
    verdict: str = "fits"
    # A GPU rank's bytes beyond its tensors (paratune.costs.cuda_memory: cuBLAS workspace inside the
    # caching allocator, the CUDA context and NCCL's buffers outside it); none on the CPU entry.
    cuda: CudaOverheads = field(default_factory=CudaOverheads)
    # What the plan's tensors get: the capacity less the CUDA terms (what P(fits) judges the peak
    # against, paratune.costs.risk; the verdict allows the margin on top).
    tensor_limit_bytes: float = 0.0

    @property
    def reserved_bytes(self) -> float:
        """What `torch.cuda.max_memory_reserved` would show: the tensors' peak and the allocator's
        workspaces (fragmentation not counted: no public figure for it)."""
        return self.memory.total + self.cuda.in_allocator

    @property
    def device_bytes(self) -> float:
        """What the GPU holds for the rank at its peak: reserved, the CUDA context, NCCL's buffers."""
        return self.memory.total + self.cuda.total

    @property
    def fits(self) -> bool:
        """Predicted within the capacity (the prediction itself, its band aside)."""
        return self.overflow is None

    @property
    def tight(self) -> bool:
        """The predicted peak is within its band of the capacity (either side): a trial settles it."""
        return self.verdict == "tight"

    @property
    def measurable(self) -> bool:
        """Worth a trial: it fits, or is tight (not refused by the device, not over by more than
        its band). What a sweep measures and `paratune plan` lists."""
        return self.refusal is None and (self.fits or self.tight)

    def summary(self) -> dict[str, float]:
        """Flat numbers for MLflow and JSON."""
        return {"predicted_peak_memory_gib": self.memory.total / GiB,
                **{f"predicted_{k}_gib": v / GiB for k, v in self.memory.parts().items()},
                **({"predicted_device_memory_gib": self.device_bytes / GiB,
                    **{f"predicted_{k}_gib": v / GiB for k, v in self.cuda.parts().items()}}
                   if self.cuda.total else {}),
                "predicted_construction_gib": self.construction / GiB,
                "predicted_comm_gb_per_step": self.comm.total / 1e9,
                "predicted_step_time_s": self.time.step_s,
                "predicted_tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu,
                **({"predicted_mfu_vs_bf16_peak": self.mfu_vs_bf16_peak} if self.mfu_vs_bf16_peak else {}),
                **({"predicted_tokens_band": self.band.tokens, "predicted_memory_band": self.band.memory,
                    "predicted_memory_tight": float(self.tight)} if self.band else {})}


def estimate(plan: Plan, device: Device, constants: TimeConstants | None = None, capacity_gib: float | None = None,
             margin: float = 0.0, activation_model: ActivationModel = "trace",
             routing_balance: float | None = None) -> Estimate:
    """Memory, communication and time for one plan; `overflow` says why it would not fit in
    min(device memory, capacity_gib) x (1 + margin): at construction, in training, or both.
    `routing_balance`: the routing's max / mean tokens per expert a trial measured (its
    TrialResult's `routing_balance` max); None: paratune.costs.moe.DEFAULT_IMBALANCE."""
    imbalance = checked_imbalance(routing_balance)
    memory = estimate_memory(plan, activation_model, device, imbalance)
    capacity = min(device.memory_bytes, capacity_gib * GiB if capacity_gib else math.inf)
    from paratune.costs.measure import flops_per_token
    from paratune.checks.refusals import device_entry_refusal

    result = Estimate(plan, memory, comm_volume(plan, imbalance), estimate_time(plan, device, constants, imbalance),
                      capacity, construction=construction_bytes(plan), refusal=device_entry_refusal(plan, device))
    shape = model_shape(plan)
    if device.tflops.get("bf16"):
        flops = flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)
        result.mfu_vs_bf16_peak = flops * result.time.tokens_per_s_per_gpu / (device.tflops["bf16"] * 1e12)
    result.cuda = cuda_overheads(plan, device)
    # the tensors get what the CUDA context, NCCL's buffers and cuBLAS's workspace leave
    result.tensor_limit_bytes = capacity - result.cuda.total
    limit = result.tensor_limit_bytes + capacity * margin
    besides = (f" (after {result.cuda.total / GiB:.1f} GiB of CUDA context, NCCL buffers and cuBLAS workspace)"
               if result.cuda.total else "")
    reasons = [f"refused on {device.name}: {result.refusal}"] if result.refusal else []
    if result.construction > limit:
        reasons.append(f"construction needs {result.construction / GiB:.1f} GiB per rank (building the model, "
                       f"before the optimizer) > capacity {limit / GiB:.1f} GiB per GPU{besides}")
    steady = memory.overflow(limit)
    if steady:
        reasons.append(steady + besides)
    result.overflow = "; ".join(reasons) or None
    result.band = prediction_band(plan, device)
    verdicts = {memory_verdict(b, limit, result.band.memory) for b in (memory.total, result.construction)}
    result.verdict = ("over" if result.refusal or "over" in verdicts else "tight" if "tight" in verdicts else "fits")
    return result


def estimate_space(space, device: Device, capacity_gib: float | None = None, margin: float = 0.0,
                   constants: TimeConstants | None = None, activation_model: ActivationModel = "trace",
                   routing_balance: float | None = None) -> list[Estimate]:
    """Every valid plan of a space (env choices aside: they change neither memory nor volume),
    those worth a trial first (they fit, or are tight: `Estimate.measurable`) by expected gain
    (predicted tokens/s/GPU x the chance it fits, a doomed launch's cost counted:
    paratune.costs.risk.order_by_expected_gain); then those that do not, smallest first."""
    results = [estimate(c.plan, device, constants, capacity_gib, margin, activation_model, routing_balance)
               for c in space.candidates]
    return order_by_expected_gain(results)


class Roofline:
    """The roofline's predictions for a sweep's plans, its time constants refitted on every
    measured trial (was `Calibration`: it is the roofline, not the calibrated model,
    paratune.costs.timemodel.StepTimeModel).

    Memory is predicted from first principles (nothing to fit); step time uses constants fitted
    on the trials measured so far, so each trial's predicted time is an honest out-of-sample
    guess made before it ran."""

    def __init__(self, device: Device, capacity_gib: float | None, activation_model: ActivationModel = "trace"):
        self.device, self.capacity_gib, self.activation_model = device, capacity_gib, activation_model
        # The routing's max / mean tokens per expert, once a trial has measured it (`observe`).
        self.routing_balance: float | None = None
        self.samples: list[tuple[Plan, float]] = []
        self.constants = prior_constants(device)
        self.errors: list[dict[str, float]] = []

    def predict(self, plan: Plan, margin: float = 0.0) -> Estimate:
        return estimate(plan, self.device, self.constants, self.capacity_gib, margin, self.activation_model,
                        self.routing_balance)

    def observe(self, plan: Plan, measured_peak_bytes: float | None, measured_step_s: float | None,
                routing_balance: float | None = None) -> dict[str, float]:
        """Record a measured trial: predicted beside measured, relative errors; then refit.
        `routing_balance` (the trial's measured max / mean tokens per expert): used from the
        next prediction on (the largest seen: the busiest rank sets the step)."""
        predicted = self.predict(plan)
        if routing_balance is not None:
            checked_imbalance(routing_balance)
            self.routing_balance = max(routing_balance, self.routing_balance or 0.0)
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


