"""The sweep's cost-model line (issue 26: the demo printed "compute at 9465% of peak" on CPU).

That figure was 1 / the roofline refit's coefficient of ideal compute time, which a sweep cannot
identify (every plan computes the same FLOPs, so the column is collinear with the fitted per-step
cost). The line now reports measured compute: model FLOPs x tokens/s of the fastest trial over
the device table's peak, which a real step cannot push past 100% when the peak is the device's.
"""

import pytest

from paratune.config.devices import get_device
from paratune.costs.measure import model_flops_per_token
from paratune.model.build import build_config
from paratune.config.plan import load_plan_dict
from paratune.out.tables import cost_model_line, measured_compute
from paratune.cluster.trial import TrialResult

# The calibration summary the demo's sweep ended with (estimate.Calibration.summary()), its
# compute_efficiency as issue 26 saw it.
DEMO_CALIBRATION = {"device": "cpu", "memory_prediction_error_median_abs": 0.12,
                    "step_time_prediction_error_median_abs": 0.31, "compute_efficiency": 94.65,
                    "comm_efficiency": 1e6, "overhead_s": 1.119}


def _result(tokens_per_s: float, flops_per_token: float, precision: str = "fp32", status: str = "ok") -> TrialResult:
    plan = load_plan_dict({"model": "small-llama", "seq_len": 128, "global_batch": 16, "micro_batch": 4,
                           "precision": precision}).to_dict()
    return TrialResult(status=status, plan=plan, world_size=2, tokens_per_s_per_gpu=tokens_per_s,
                       flops_per_token=flops_per_token)


def _small_llama_flops() -> float:
    return model_flops_per_token(build_config("small-llama"), 128)


def test_the_line_reports_measured_compute_not_the_refit_coefficient():
    flops = _small_llama_flops()  # the demo ledger's flops_per_token: 31,569,408
    assert flops == pytest.approx(31_569_408)
    # The demo's trials (tokens/s per worker); the fastest one sets the figure.
    results = [_result(923.0, flops), _result(1391.0, flops), _result(5000.0, flops, status="failed")]
    line = cost_model_line(DEMO_CALIBRATION, results)
    peak = get_device("cpu").tflops["fp32"]
    fraction = 1391.0 * flops / (peak * 1e12)
    assert 0 < fraction <= 1
    assert (f"the fastest trial computed at {fraction:.0%} of the cpu entry's fp32 peak "
            f"({1391.0 * flops / 1e12:.3g} of {peak:g} TFLOP/s per worker, model FLOPs)") in line
    assert "median |error| of predicted peak memory 12%, of predicted step time 31%" in line
    assert "9465%" not in line and "above it" not in line


def test_a_trial_faster_than_the_table_peak_says_the_table_is_wrong():
    flops = _small_llama_flops()
    peak = get_device("cpu").tflops["bf16"]
    fast = 2 * peak * 1e12 / flops  # twice what the entry allows
    line = cost_model_line(DEMO_CALIBRATION, [_result(fast, flops, precision="bf16")])
    assert "computed at 200% of the cpu entry's bf16 peak" in line
    assert "above it, so the table's cpu figure (presets/devices.json) is below this machine's peak" in line


def test_without_a_finished_trial_or_a_known_device_the_line_has_no_compute_figure():
    flops = _small_llama_flops()
    assert "computed at" not in cost_model_line(DEMO_CALIBRATION, [_result(900.0, flops, status="failed")])
    assert measured_compute([_result(900.0, flops)], "my-own-gpu") is None
    assert measured_compute([_result(900.0, None)], "cpu") is None
