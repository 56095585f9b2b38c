"""A sweep that weighs the risk of a launch (issue 55 item 5): P(fits), expected gain, the launch order,
the not-worth-a-launch rule and the memory recalibration (paratune.costs.risk), pure: no Ray."""

import dataclasses
import math

import pytest

from paratune.config.devices import get_device
from paratune.config.plan import load_plan_dict
from paratune.costs.bands import fit_probability
from paratune.costs.estimate import Roofline, estimate
from paratune.costs.risk import (
    DEFAULT_LAUNCH_S,
    NOT_WORTH_A_LAUNCH,
    LaunchOption,
    LaunchRisk,
    MemoryCalibration,
    expected_gain,
    judged_peak,
    oom_cost_share,
    order_by_expected_gain,
    plan_fit_probability,
    plan_kind,
    premature_risky_launches,
    rank_launches,
    tensor_limit,
)
from paratune.model.shapes import GiB

H100 = get_device("h100-80gb")
CPU = get_device("cpu")


def _gpu_plan(**changes):
    base = {"model": "llama3-8b", "num_workers": 8, "global_batch": 16, "micro_batch": 2, "seq_len": 8192,
            "strategy": "fsdp", "fsdp": {"sharding": "full"}, "precision": "bf16", "device": "cuda", "gpus_per_node": 8}
    return load_plan_dict({**base, **changes}, source="test")


def _cpu_plan(**changes):
    base = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2, "micro_batch": 2,
            "strategy": "ddp", "warmup_steps": 1, "measure_steps": 2}
    return load_plan_dict({**base, **changes}, source="test")


def test_the_threshold_is_the_plan_over_by_its_whole_band():
    # P(fits) = 0.1 exactly where the prediction is over the capacity by its band: the 10% tail.
    for band in (0.08, 0.2, 0.5):
        assert fit_probability(100 * (1 + band), 100, band) == pytest.approx(NOT_WORTH_A_LAUNCH, abs=1e-6)
        assert fit_probability(100, 100, band) == pytest.approx(0.5)
    plan = _gpu_plan(micro_batch=1, seq_len=2048)
    e = estimate(plan, H100)
    beside = H100.memory_bytes - tensor_limit(e)  # the CUDA context and NCCL's buffers, where modelled
    assert judged_peak(e) * (1 + e.band.memory) + beside < H100.memory_bytes
    clear = estimate(plan, H100, capacity_gib=(judged_peak(e) * (1 + e.band.memory) + beside) / GiB)  # under by its band
    assert plan_fit_probability(clear) == pytest.approx(1 - NOT_WORTH_A_LAUNCH, abs=1e-3)
    over = estimate(plan, H100, capacity_gib=(judged_peak(e) / (1 + e.band.memory) + beside) / GiB)  # over by its band
    assert plan_fit_probability(over) == pytest.approx(NOT_WORTH_A_LAUNCH, abs=1e-3) and over.tight
    assert plan_fit_probability(over, scale=1.05) < NOT_WORTH_A_LAUNCH  # a calibrated scale moves it
    assert plan_fit_probability(dataclasses.replace(clear, refusal="the device cannot run it")) == 0.0


def test_expected_gain_and_the_cost_of_a_doomed_launch():
    assert expected_gain(200, 1.0, 1.0, 100) == 200  # a sure fit keeps its speed
    assert expected_gain(200, 0.5, 1.0, 100) == 50  # half its speed less half the best's
    assert expected_gain(200, 0.0, 0.5, 100) == -50
    plan = _cpu_plan()  # 1 warm-up + 2 measured steps
    assert oom_cost_share(plan, 1.0, 120.0) == pytest.approx(121 / 123)
    assert oom_cost_share(plan, 1.0, 0.0) == pytest.approx(1 / 3)  # no launch: one step of three
    assert oom_cost_share(plan, math.nan) == 1.0


def test_a_sure_plan_goes_before_a_faster_doubtful_one_and_a_likely_one_before_a_sure_slow_one():
    sure, doubtful = LaunchOption("sure", 100, 0.2, 1.0), LaunchOption("doubtful", 130, 0.2, 0.4)
    assert [v.item for v in rank_launches([doubtful, sure])] == ["sure", "doubtful"]
    likely = LaunchOption("likely", 200, 0.2, 0.95)
    assert [v.item for v in rank_launches([sure, likely])] == ["likely", "sure"]
    # a cheaper doomed launch (the launch short beside the steps) weighs less
    cheap = LaunchOption("doubtful", 180, 0.2, 0.6, cost=0.1)
    assert rank_launches([sure, cheap])[0].item == "doubtful"
    assert rank_launches([sure, LaunchOption("doubtful", 180, 0.2, 0.6, cost=1.0)])[0].item == "sure"


def test_a_plan_not_worth_a_launch_waits_while_a_fitting_plan_may_be_as_fast():
    doomed = LaunchOption("doomed", 300, 0.25, 0.05, cost=0.0)  # free to launch, still waits
    rival = LaunchOption("rival", 260, 0.25, 0.9)  # 260 x 1.25 >= 300: may be as fast
    slow = LaunchOption("slow", 50, 0.25, 1.0)
    order = rank_launches([doomed, slow, rival])
    assert [v.item for v in order] == ["rival", "slow", "doomed"]
    assert order[-1].deferred and "P(fits) 5% < 10%" in order[-1].why
    # no fitting plan within its band of the best: the doomed one is judged by its expected gain
    far = LaunchOption("far", 100, 0.25, 1.0)
    order = rank_launches([doomed, far])
    assert not any(v.deferred for v in order)
    assert premature_risky_launches(rank_launches([doomed, slow, rival])) == []
    # fastest first (what the sweep did) launches the doomed plan before the rival
    fastest_first = sorted(rank_launches([doomed, slow, rival]), key=lambda v: -v.option.tokens)
    assert premature_risky_launches(fastest_first) == [(0, 1)]


def test_order_by_expected_gain_of_a_space_with_tight_plans():
    plans = [_gpu_plan(micro_batch=mb, activation_checkpointing=ac, global_batch=32)
             for mb in (1, 2, 4) for ac in ("none", "full")]
    free = [estimate(p, H100) for p in plans]
    # a capacity that leaves the biggest plans tight or over, the smallest clear
    peaks = sorted(judged_peak(e) for e in free)
    capacity = peaks[len(peaks) // 2] / GiB
    estimates = [estimate(p, H100, capacity_gib=capacity) for p in plans]
    assert {e.verdict for e in estimates} >= {"fits", "tight"}
    order = order_by_expected_gain(estimates)
    assert sorted(map(id, order)) == sorted(map(id, estimates))
    worth = [e for e in order if e.measurable]
    assert order[: len(worth)] == worth  # worth a trial first ...
    rest = order[len(worth):]
    assert [e.memory.total for e in rest] == sorted(e.memory.total for e in rest)  # ... then smallest first
    gains = [v.expected_gain for v in rank_launches([LaunchOption(e, e.time.tokens_per_s_per_gpu, e.band.tokens,
                                                                   plan_fit_probability(e),
                                                                   oom_cost_share(e.plan, e.time.step_s))
                                                      for e in worth])]
    assert gains == sorted(gains, reverse=True)
    # the plan launched first is the one of highest expected gain, not necessarily the fastest
    assert plan_fit_probability(order[0]) > 0.5


def test_memory_calibration_per_kind_from_peaks_and_out_of_memory_trials():
    plain, checkpointed = _cpu_plan(), _cpu_plan(activation_checkpointing="full")
    assert plan_kind(plain) == "all" and plan_kind(checkpointed) == "all+ac:full"
    cal = MemoryCalibration()
    assert cal.scale(plain) == 1.0 and cal.launch_s() == DEFAULT_LAUNCH_S
    # a measured peak 10% over its prediction: the kind's scale, and the prior of kinds not seen yet
    record = cal.observe(plain, 100.0, 200.0, measured_peak_bytes=110.0, launch_s=3.0)
    assert record == {"memory_scale_before": 1.0, "memory_scale_after": pytest.approx(1.1)}
    assert cal.scale(checkpointed) == pytest.approx(1.1) and cal.launch_s() == 3.0
    # an out-of-memory trial with no peak: predicted 90, capacity 100 -> the kind's scale >= 100/90
    cal.observe(checkpointed, 90.0, 100.0, out_of_memory=True)
    assert cal.scale(checkpointed) == pytest.approx(max(1.1, 100 / 90))
    cal.observe(checkpointed, 50.0, 100.0, measured_peak_bytes=40.0)  # a lower bound still binds
    assert cal.scale(checkpointed) == pytest.approx(100 / 90)
    assert cal.scale(plain) == pytest.approx(1.1)  # the bound binds its own kind only
    assert set(cal.summary()) == {"memory_scale_all", "memory_scale_all_ac_full"}


def test_launch_risk_rejudges_a_plan_of_the_kind_that_ran_out_of_memory():
    plans = {"a": _cpu_plan(micro_batch=4), "b": _cpu_plan(micro_batch=2),
             "b2": _cpu_plan(micro_batch=2, env={"NCCL_BUFFSIZE": "4194304"}),
             "c": _cpu_plan(micro_batch=2, activation_checkpointing="full")}
    roofline = Roofline(CPU, None)
    peaks = {k: judged_peak(roofline.predict(p)) for k, p in plans.items()}
    capacity_gib = peaks["b"] * 1.02 / GiB  # b fits its prediction by 2%, within the 8% band
    risk = LaunchRisk(Roofline(CPU, capacity_gib), plans)
    assert risk.estimates["b"] is risk.estimates["b2"]  # env changes no memory: one estimate
    before = {k: risk.p_fits(k) for k in plans}
    assert 0.5 < before["b"] < 0.9 and risk.verdict("b") == "tight"
    launched = risk.launched("a")
    assert launched["predicted_fit_probability"] == pytest.approx(before["a"])
    # a (micro-batch 4) measured 5% over its prediction and over the capacity: out of memory
    record = risk.observe("a", peaks["a"] * 1.05, True, launch_s=2.0)
    assert record["memory_scale_after"] == pytest.approx(1.05) and record["memory_scale_before"] == 1.0
    assert risk.observe("a", peaks["a"] * 2, True) == {}  # once per trial
    assert risk.p_fits("b") < before["b"] and risk.verdict("b") == "tight"
    # the checkpointed kind has no trial: the pooled ratio, and no out-of-memory bound of its own
    assert risk.calibration.scale(plans["c"].with_changes()) == pytest.approx(1.05)
    # over by its band once recalibrated: skipped, and said why
    risk.observe("b", peaks["b"] * 1.25, True)  # the kind's median 1.15: over by its band
    skipped = risk.skipped(["b2", "c"])
    assert list(skipped) == ["b2"] and "memory scale of its kind all" in skipped["b2"]
    assert risk.passed_over == skipped
    order = risk.order({"b2": 100.0, "c": 80.0}, ["b2", "c"], 0.25)
    assert [v.item for v in order] == ["c", "b2"]
