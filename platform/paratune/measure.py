"""The numbers every plan is judged by: tokens/s/GPU, step-time spread, MFU.

Pure arithmetic on measured step times; the trial (paratune.trial) does the measuring.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# Dense peak FLOP/s per device (never the 2x structured-sparsity figures). Keys are matched as
# substrings of torch.cuda.get_device_name(); first match wins, so specific names come first.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "H800": {"bf16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp32": 31.2},
    "L4": {"bf16": 121.0, "fp32": 30.3},
}


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s for a device name and precision, or None when unknown (e.g. a CPU)."""
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return peaks[precision] * 1e12
    return None


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


def tokens_per_second_per_gpu(tokens_per_step: int, step_times: list[float], world_size: int) -> float:
    """Global tokens in the measured window / (window seconds x every GPU the trial used)."""
    window = sum(step_times)
    return tokens_per_step * len(step_times) / (window * world_size)


def flops_per_token(compute_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a dense decoder: 6N + 12·L·H·Q·T.

    N counts every parameter a token's matmuls touch (GQA's smaller K/V and SwiGLU's three
    matrices come from the real config); the second term is attention scores and values.
    Recomputation from activation checkpointing is not counted (MFU, not HFU).
    """
    return 6.0 * compute_params + 12.0 * num_layers * num_heads * head_dim * seq_len


def model_flops_per_token(config, seq_len: int) -> float:
    from paratune.models import parameter_counts

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return flops_per_token(parameter_counts(config)["compute"], config.num_hidden_layers, heads, head_dim, seq_len)


def mfu(tokens_per_s_per_gpu: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the device's dense peak."""
    if not peak_flops:
        return None
    return tokens_per_s_per_gpu * flops_per_tok / peak_flops
