"""The numbers every plan is judged by: tokens/s/GPU, step-time spread, MFU, communication share.

Pure arithmetic on measured step times and profiler events; the trial (paratune.cluster.trial) does the
measuring, and a device's peak comes from paratune.config.devices.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, NamedTuple


# --------------------------------------------------------------------------- communication share
class ProfileEvent(NamedTuple):
    """One profiler event: times in microseconds on the profile's clock. `on_device`: it ran on
    the accelerator (a kernel or copy), not a host-side span (an op, a launch, an annotation).
    `device_annotation`: a host label's copy on the device's timeline (c10d's "nccl:all_to_all"
    as a gpu_user_annotation): it spans the kernels launched inside that label."""

    name: str
    start_us: float
    end_us: float
    on_device: bool
    device_annotation: bool = False


# Host-side spans of collectives under gloo (c10d's record_function labels and op names).
_CPU_COLLECTIVE_NAMES = ("nccl:", "gloo:", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather",
                         "reduce_scatter", "_reduce_scatter", "broadcast", "record_param_comms", "all_to_all",
                         "alltoall")
# The all-to-all's names, lowered, as torch 2.13 records them (read from a gloo profile of
# dist.all_to_all_single and _functional_collectives.all_to_all_single_autograd, the calls
# transformers' AllToAllEP makes): "c10d::alltoall_base_" (the op), "gloo:all_to_all" (the work),
# "_c10d_functional::all_to_all_single" and its autograd backward
# ("GeneratedBackwardFor__c10d_functional_all_to_all_single_default..."). Under NCCL c10d labels
# the work "nccl:all_to_all" (its profilingTitle), on the host and as a GPU user annotation, and
# NCCL runs it as grouped send/recv kernels (ncclDevKernel_SendRecv, the kernels a pipeline's p2p
# runs too): a device kernel is the all-to-all's when its name says so or when it lies inside a
# GPU-side all-to-all annotation.
_ALL_TO_ALL_NAMES = ("all_to_all", "alltoall")


def _is_all_to_all(name: str) -> bool:
    lowered = name.lower()
    return any(n in lowered for n in _ALL_TO_ALL_NAMES)


def _is_nccl_kernel(name: str) -> bool:
    """An NCCL kernel as CUPTI names it: ncclDevKernel_AllGather_RING_LL(...) (NCCL >= 2.19),
    ncclKernel_AllReduce_RING_LL_Sum_float(...) (older), ncclAllReduceRingLLKernel_sum_f32 (2.4).
    c10d's labels ("nccl:all_reduce") are annotations that span launches, not kernels."""
    lowered = name.lower()
    return "nccl" in lowered and not lowered.startswith("nccl:")


def _is_symmetric_memory_transfer(name: str) -> bool:
    """Async TP's communication on the device (torch's symmetric memory, not NCCL): its kernels,
    in torch's `c10d::symmetric_memory` namespace (barrier, put/wait signal, one-/two-shot and
    multimem all-reduce), and the copy engine's peer-to-peer copies the micro-pipelined
    all-gather / reduce-scatter make ("Memcpy PtoP (Device -> Device)", as CUPTI names a peer
    copy). Names read from torch's sources; no async-TP profile has been seen here (no GPU)."""
    lowered = name.lower()
    return "symmetric_memory" in lowered or lowered.startswith("memcpy ptop")


def _union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of intervals (overlapping kernels on several streams count once)."""
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def comm_share_from_events(events: Iterable[tuple[str, float, float, bool]], step_seconds: float,
                           device_type: str) -> float:
    """Fraction of a step with a collective in flight: the union of collective intervals / step.

    On "cuda" only communication on the device counts: NCCL kernels, and async TP's symmetric-memory
    kernels and peer copies (`_is_symmetric_memory_transfer`); the host-side spans (c10d's `nccl:*`
    ranges, `record_param_comms`, FSDP's `all_gather_copy_in`) are launches and copies, and a launch
    returns long before its kernel ends. On "cpu" (gloo) the collective runs in the host spans."""
    events = [ProfileEvent(*e) for e in events]
    if device_type == "cuda":
        spans = [(e.start_us, e.end_us) for e in events
                 if e.on_device and (_is_nccl_kernel(e.name) or _is_symmetric_memory_transfer(e.name))]
    elif device_type == "cpu":
        spans = [(e.start_us, e.end_us) for e in events
                 if not e.on_device and any(n in e.name.lower() for n in _CPU_COLLECTIVE_NAMES)]
    else:
        raise ValueError(f"device_type: got '{device_type}'; allowed: 'cpu', 'cuda'")
    if step_seconds <= 0:
        return 0.0
    return min(1.0, _union_us(spans) / 1e6 / step_seconds)


def all_to_all_share_from_events(events: Iterable[tuple], step_seconds: float, device_type: str) -> float:
    """Fraction of a step with an all-to-all in flight (expert parallelism's dispatch and combine):
    a part of the communication share (`comm_share_from_events`), by the all-to-all's own names.

    On "cuda": NCCL kernels named as all-to-alls, or inside a GPU-side all-to-all annotation
    (NCCL's all-to-all is grouped send/recv, whose kernels are named as a pipeline's p2p). On
    "cpu" (gloo): the host spans named as all-to-alls."""
    events = [ProfileEvent(*e) for e in events]
    if device_type == "cuda":
        windows = [(e.start_us, e.end_us) for e in events if e.device_annotation and _is_all_to_all(e.name)]
        spans = [(e.start_us, e.end_us) for e in events if e.on_device and _is_nccl_kernel(e.name)
                 and (_is_all_to_all(e.name) or any(ws <= e.start_us and e.end_us <= we for ws, we in windows))]
    elif device_type == "cpu":
        spans = [(e.start_us, e.end_us) for e in events if not e.on_device and _is_all_to_all(e.name)]
    else:
        raise ValueError(f"device_type: got '{device_type}'; allowed: 'cpu', 'cuda'")
    if step_seconds <= 0:
        return 0.0
    return min(1.0, _union_us(spans) / 1e6 / step_seconds)


def profile_events(prof) -> list[ProfileEvent]:
    """The events of a torch.profiler profile. Kineto lists device activity as events of their own
    (device_type CUDA, device clock aligned to the host's); GPU-side copies of host annotations
    (`is_user_annotation`, e.g. "nccl:all_reduce" on the GPU row) span launches, not kernels."""
    from torch.autograd import DeviceType

    events = []
    for evt in prof.events():
        on_accelerator = evt.device_type != DeviceType.CPU
        annotation = bool(getattr(evt, "is_user_annotation", False))
        events.append(ProfileEvent(evt.name, evt.time_range.start, evt.time_range.end,
                                   on_accelerator and not annotation, on_accelerator and annotation))
    return events


def comm_share_from_profile(prof, step_seconds: float, device_type: str) -> float:
    """Communication share of one profiled step (see `comm_share_from_events`)."""
    return comm_share_from_events(profile_events(prof), step_seconds, device_type)


# --------------------------------------------------------------------------- routing balance
def routing_balance(tokens_per_expert: list[int]) -> float | None:
    """One MoE layer's balance: its busiest expert's routed tokens over the mean (1.0: perfectly
    balanced; E: every token to one expert). None when the layer routed nothing."""
    total = sum(tokens_per_expert)
    if not tokens_per_expert or total == 0:
        return None
    return max(tokens_per_expert) / (total / len(tokens_per_expert))


def routing_summary(per_layer_tokens: list[list[int]]) -> tuple[float | None, list[float | None]]:
    """(the worst layer's balance, every layer's), layers in the model's order."""
    per_layer = [routing_balance(counts) for counts in per_layer_tokens]
    measured = [b for b in per_layer if b is not None]
    return (max(measured) if measured else None), per_layer


@dataclass(frozen=True)
class StepStats:
    """Distribution of whole-optimizer-step times (seconds) over the measured window."""

    median: float
    p10: float
    p90: float
    minimum: float
    maximum: float
    total: float
    count: int

    @property
    def spread(self) -> float:
        """Relative spread (p90 - p10) / median: how much one step's time can be trusted."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else 0.0


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile (same as numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def step_stats(step_times: list[float]) -> StepStats:
    if not step_times:
        raise ValueError("step_times: empty; at least one measured step is needed")
    ordered = sorted(step_times)
    return StepStats(
        median=statistics.median(ordered),
        p10=_quantile(ordered, 0.10),
        p90=_quantile(ordered, 0.90),
        minimum=ordered[0],
        maximum=ordered[-1],
        total=sum(ordered),
        count=len(ordered),
    )


def median(values: list[float]) -> float:
    return _quantile(sorted(values), 0.5)


def share_of_steps(part_s: list[float] | None, step_times: list[float]) -> float | None:
    """What part of the measured steps' time went to `part_s` (per step, e.g. the wait for data)."""
    if not part_s or not step_times or sum(step_times) <= 0:
        return None
    n = min(len(part_s), len(step_times))
    return min(1.0, sum(part_s[:n]) / sum(step_times[:n]))


def compile_seconds(first_step_s: float, measured_step_times: list[float]) -> float | None:
    """What the first warm-up step of a compiled plan paid beyond a measured step: its time minus
    the median measured step (slowest rank both), floored at 0 (a cache-served compile can leave
    the first step as fast as the others). None without a measured step (stopped before any)."""
    if not measured_step_times:
        return None
    return max(0.0, first_step_s - statistics.median(measured_step_times))


def tokens_per_second_per_gpu(tokens_per_step: int, step_times: list[float], world_size: int) -> float:
    """Global tokens in the measured window / (window seconds x every GPU the trial used)."""
    window = sum(step_times)
    return tokens_per_step * len(step_times) / (window * world_size)


def flops_per_token(compute_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6N + 12·L·H·Q·T.

    N counts every parameter a token's matmuls touch (GQA's smaller K/V and SwiGLU's three
    matrices come from the real config; of a mixture-of-experts layer only the router, the shared
    experts and the top-k routed ones); the second term is attention scores and values.
    Recomputation from activation checkpointing is not counted (MFU, not HFU).
    """
    return 6.0 * compute_params + 12.0 * num_layers * num_heads * head_dim * seq_len


def model_flops_per_token(config, seq_len: int) -> float:
    """flops_per_token of a config, N from the architecture built on the meta device: its active
    parameters (models.parameter_counts' `compute`), so an MoE's MFU is not inflated by the
    experts a token never reaches (Mixtral-8x7B: 12.7B of 46.6B non-embedding parameters)."""
    from paratune.model.build import parameter_counts

    from paratune.config.sizes import config_sizes

    shape = config_sizes(config)
    return flops_per_token(parameter_counts(config)["compute"], shape.layers, shape.heads, shape.head_dim, seq_len)


def mfu(tokens_per_s_per_gpu: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the device's dense peak."""
    if not peak_flops:
        return None
    return tokens_per_s_per_gpu * flops_per_tok / peak_flops


# --------------------------------------------------------------------------- early stopping
# A noise band never narrower than this: a handful of steps understates the spread a re-run sees.
NOISE_FLOOR = 0.05


def noise_band(relative_spread: float) -> float:
    """A plan's noise band, as the verdict defines it: half its relative step spread, never less
    than NOISE_FLOOR."""
    return max(NOISE_FLOOR, relative_spread / 2)


class TrialStopRule(NamedTuple):
    """When a running trial is stopped early (a trial, not a sweep: the sweep's stopping rule ends
    that): after `min_steps` measured steps, if even its fastest step, raised by its own noise
    band, stays below the incumbent lowered by the incumbent's band (outside both noise bands),
    it cannot reach the incumbent."""

    incumbent_tokens_per_s_per_gpu: float
    incumbent_spread: float = 0.0  # the incumbent's (p90 - p10) / median
    min_steps: int = 2
    noise_floor: float = NOISE_FLOOR

    def upper_bound(self, tokens_per_step: int, step_times: list[float], world_size: int) -> float:
        """The most tokens/s/GPU the trial can still reach: its fastest step, plus its noise band."""
        fastest = min(step_times)
        stats = step_stats(step_times)
        own_band = max(self.noise_floor, (stats.maximum - stats.minimum) / stats.median / 2)
        return tokens_per_step / (fastest * world_size) * (1 + own_band)

    def incumbent_floor(self) -> float:
        return self.incumbent_tokens_per_s_per_gpu * (1 - max(self.noise_floor, self.incumbent_spread / 2))

    def cannot_reach(self, tokens_per_step: int, step_times: list[float], world_size: int) -> bool:
        if len(step_times) < self.min_steps:
            return False
        return self.upper_bound(tokens_per_step, step_times, world_size) < self.incumbent_floor()

    def explain(self, tokens_per_step: int, step_times: list[float], world_size: int, planned: int) -> str:
        return (f"stopped early after {len(step_times)} of {planned} measured steps: at best "
                f"{self.upper_bound(tokens_per_step, step_times, world_size):,.0f} tokens/s/GPU (fastest step + its "
                f"noise band) < the incumbent's {self.incumbent_floor():,.0f} ({self.incumbent_tokens_per_s_per_gpu:,.0f} "
                f"less its noise band)")


