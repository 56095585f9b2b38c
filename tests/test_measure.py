"""The arithmetic of tokens/s/GPU, step-time spread, FLOPs per token and MFU."""

import pytest

from paratune import measure
from paratune.models import build_config, parameter_counts
from paratune.plan import load_plan_dict
from paratune.trial import summarize


def test_tokens_per_second_per_gpu_from_a_known_window():
    # 4 steps of 8 x 128 tokens in 2.0 s total on 2 workers: 4096 tokens / 2 s / 2 GPUs.
    assert measure.tokens_per_second_per_gpu(8 * 128, [0.4, 0.6, 0.5, 0.5], 2) == pytest.approx(1024.0)


def test_step_stats_median_and_spread():
    stats = measure.step_stats([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats.median == 3.0 and stats.p10 == pytest.approx(1.4) and stats.p90 == pytest.approx(4.6)
    assert stats.spread == pytest.approx((4.6 - 1.4) / 3.0)
    with pytest.raises(ValueError, match="step_times: empty"):
        measure.step_stats([])


def test_summarize_uses_only_measured_steps_and_every_worker():
    plan = load_plan_dict({"global_batch": 8, "micro_batch": 2, "seq_len": 64, "num_workers": 2})
    raw = {"losses": [5.0, 4.9, 4.8], "step_times_s": [0.25, 0.25, 0.5], "device": "NVIDIA H100 80GB HBM3",
           "peak_memory_bytes": [10, 12]}
    result = summarize(plan, raw, flops_tok=1e9)
    assert result.tokens_per_s_per_gpu == pytest.approx(3 * 8 * 64 / (1.0 * 2))
    assert result.step_time_median_s == 0.25
    assert result.mfu == pytest.approx(result.tokens_per_s_per_gpu * 1e9 / 67e12)  # fp32 peak of an H100


def test_parameter_counts_match_published_sizes():
    assert parameter_counts(build_config("llama3-8b"))["total"] == 8_030_261_248
    assert parameter_counts(build_config("llama3-70b"))["total"] == 70_553_706_496
    qwen = parameter_counts(build_config("qwen2.5-7b"))
    assert qwen["total"] == 7_615_616_512
    tied = parameter_counts(build_config("llama3.2-1b"))  # tied head: stored once, computed anyway
    assert tied["compute"] == tied["total"]


def test_flops_per_token_by_hand_for_llama3_8b():
    # Hand count, GQA and SwiGLU included: per layer q,o = 2*4096*4096, k,v = 2*4096*1024,
    # MLP = 3*4096*14336, norms 2*4096; plus final norm 4096 and the untied head 4096*128256.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    n = 32 * per_layer + 4096 + 4096 * 128256
    expected = 6 * n + 12 * 32 * 32 * 128 * 8192
    assert measure.model_flops_per_token(build_config("llama3-8b"), 8192) == expected


def test_mfu_against_the_dense_peak():
    peak = measure.device_peak_flops("NVIDIA H200", "bf16")
    assert peak == 989e12  # dense, never the sparsity figure
    assert measure.mfu(5000.0, 6e10, peak) == pytest.approx(5000 * 6e10 / 989e12)
    assert measure.device_peak_flops("cpu", "bf16") is None
    assert measure.mfu(5000.0, 6e10, None) is None
    assert measure.device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
