"""A prediction with its band (issue 43): paratune.costs.bands.prediction_band reads the published
corpus's error bands by plan kind; a plan within the memory band of the capacity is `tight` and
measured, not rejected."""

import io

import pytest
from rich.console import Console

from paratune.costs.bands import (
    CPU_BANDS,
    MIN_ROWS,
    band_categories,
    bands_from_errors,
    memory_verdict,
    percentile_band,
    pick_band,
    prediction_band,
)
from paratune.config.devices import get_device
from paratune.costs.estimate import estimate
from paratune.config.plan import load_plan_dict
from paratune.model.shapes import GiB

H100 = get_device("h100-80gb")


def _plan(**changes):
    base = {"model": "llama3-8b", "num_workers": 8, "global_batch": 16, "micro_batch": 2, "seq_len": 8192,
            "strategy": "fsdp", "fsdp": {"sharding": "full"}, "precision": "bf16", "device": "cuda", "gpus_per_node": 8}
    return load_plan_dict({**base, **changes}, source="test")


def test_a_plans_kinds_and_the_percentile():
    assert band_categories(_plan()) == ["all"]
    kinds = band_categories(_plan(tp=8, sequence_parallel=True, compile=True, float8="rowwise",
                                  activation_checkpointing="full", global_batch=2))
    assert kinds == ["all", "float8:rowwise", "tp", "ac:full", "compile"]
    assert percentile_band([0.1, -0.2, 0.3, -0.4, 0.5]) == 0.4  # 80% of 5 rows: the 4th
    table = bands_from_errors([(["all"], 0.1), (["all", "tp"], -0.3)])
    assert table == {"all": {"band": 0.3, "rows": 2}, "tp": {"band": 0.3, "rows": 1}}


def test_the_widest_kind_with_enough_rows_and_never_below_the_whole_corpus():
    table = {"all": {"band": 0.2, "rows": 99}, "tp": {"band": 0.3, "rows": MIN_ROWS},
             "float8:rowwise": {"band": 0.5, "rows": MIN_ROWS - 1}, "compile": {"band": 0.1, "rows": 40}}
    assert pick_band(table, ["all", "tp", "float8:rowwise"], 0.9)[0] == 0.3  # rowwise: too few rows
    assert pick_band(table, ["all", "compile"], 0.9)[0] == 0.2
    assert pick_band({}, ["all"], 0.9)[0] == 0.9


def test_the_shipped_bands_on_a_gpu_and_the_cpus_own():
    gpu = prediction_band(_plan(), H100)
    assert 0 < gpu.tokens < 1 and 0 < gpu.memory < 1 and "published rows" in gpu.tokens_basis
    assert gpu.tokens_text(1030.4) == f"1,030 +-{gpu.tokens:.0%}"
    cpu = prediction_band(_plan(device="cpu", precision="fp32", model="tiny-llama", seq_len=64), get_device("cpu"))
    assert (cpu.tokens, cpu.memory) == (CPU_BANDS["tokens"], CPU_BANDS["memory"])


def test_memory_verdicts():
    assert memory_verdict(70, 100, 0.2) == "fits"
    assert memory_verdict(90, 100, 0.2) == "tight"  # under, but not by its band
    assert memory_verdict(110, 100, 0.2) == "tight"  # over, within its band: a trial settles it
    assert memory_verdict(130, 100, 0.2) == "over"


def test_a_plan_within_its_band_of_the_capacity_is_tight_and_measured():
    plan = _plan(activation_checkpointing="full")  # well within the device's 80 GiB
    e = estimate(plan, H100)
    band = e.band.memory
    just_over = e.memory.total / GiB / (1 + band / 2)  # a capacity the prediction exceeds by half its band
    over = estimate(plan, H100, capacity_gib=just_over)
    assert not over.fits and over.tight and over.measurable and over.verdict == "tight"
    far = estimate(plan, H100, capacity_gib=e.memory.total / GiB / (1 + 2 * band))
    assert not far.fits and not far.tight and not far.measurable and far.verdict == "over"
    summary = over.summary()
    assert summary["predicted_memory_tight"] == 1.0 and summary["predicted_tokens_band"] == over.band.tokens


def test_paratune_plan_prints_the_band_and_tight(tmp_path):
    from paratune.out.tables import print_estimates

    plan = _plan(activation_checkpointing="full")
    e = estimate(plan, H100)
    tight = estimate(plan, H100, capacity_gib=e.memory.total / GiB / (1 + e.band.memory / 2))
    out = io.StringIO()
    print_estimates([tight], H100, Console(file=out, width=250))
    text = out.getvalue()
    assert "tight +-" in text and f"+-{tight.band.tokens:.0%}" in text and "prediction_band" in text
    assert "predicted not to fit" not in text


@pytest.mark.parametrize("field", ["tokens", "memory"])
def test_bands_are_read_through_estimate_too(field):
    from paratune.costs.estimate import prediction_band as via_estimate

    assert getattr(via_estimate(_plan(), H100), field) == getattr(prediction_band(_plan(), H100), field)


def test_a_kind_seen_in_one_source_says_its_band_was_not_judged_out_of_sample():
    table = {"all": {"band": 0.15, "rows": 110, "sources": ["a", "b"]},
             "tp": {"band": 0.18, "rows": 17, "sources": ["torchtitan"]}}
    band, basis = pick_band(table, ["all", "tp"], 0.9)
    assert band == 0.18 and "one source (torchtitan): not judged out of sample" in basis
    assert "one source" not in pick_band(table, ["all"], 0.9)[1]
