"""How bench/published.py judges the cost model out of sample (issue 55): a row that set a term
judges nothing; each device and each source is judged by bands the others built; the shipped
bands are widened until rows of another source on another device fall within them as often as
they say; published memory judges only like for like. Synthetic rows with made-up errors: the
rules, not the corpus (its figures are in bench/results/published.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def published():
    spec = importlib.util.spec_from_file_location("published_bench", ROOT / "bench" / "published.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["published_bench"] = module
    spec.loader.exec_module(module)
    return module


def _row(published, rid, source, device, error, categories=("all",), reference=None, plan=None, memory=None):
    """A replayed row whose prediction is (1 + error) x its published 1000 tokens/s/GPU."""
    row = published.Row(source=source, id=rid, model="m", cite={}, gpus=8, device=device, devices_file=None,
                        plan=dict(plan or {}), published={"tokens_per_s_per_gpu": 1000.0}, reference=reference)
    row.results["trace"] = {"tokens_per_s_per_gpu": 1000.0 * (1 + error), "categories": list(categories),
                            "memory_gib": 10.0, "reserved_gib": 10.0, "device_memory_gib": 11.0,
                            "construction_gib": 1.0, "capacity_gib": 80.0, "band_memory": 0.08, "refused": False,
                            "fits": True, "params": 1, "seconds": 0.0, "grad_accum": 1}
    if memory is not None:
        row.published["memory_gib"] = memory
    return row


def test_a_reference_row_judges_nothing(published):
    rows = [_row(published, "ref", "a", "h100-80gb", 0.9, reference="hopper"),
            _row(published, "r1", "a", "h100-80gb", 0.05), _row(published, "r2", "b", "a100-80gb", -0.05)]
    assert [r.id for r in published.judged_rows(rows, "trace")] == ["r1", "r2"]
    bands = published.corpus_bands(rows, "trace")
    assert bands["tokens"]["all"]["rows"] == 2 and bands["tokens"]["all"]["band"] == pytest.approx(0.05)


def test_each_device_is_judged_by_the_bands_the_other_devices_built(published):
    # the H100 rows are close, the A100 rows 30% off: A100 judged by H100's bands falls outside them
    rows = [_row(published, f"h{i}", "s1", "h100-80gb", e) for i, e in enumerate((0.02, -0.03, 0.04, -0.05, 0.01))]
    rows += [_row(published, f"a{i}", "s2", "a100-80gb", e) for i, e in enumerate((-0.3, -0.28, -0.32, -0.31))]
    out = published.held_out(rows, "trace", "device")
    a100 = out["a100 80 GiB"]
    assert a100["built_with"] == ["h100-sxm 80 GiB"] and a100["tokens_within_band"] == 0.0
    assert a100["tokens_median_signed"] == pytest.approx(-0.305)
    # in sample the A100 rows would set a band that covers most of them: the held-out view does not
    assert published.summarize(rows, "trace", published.corpus_bands(rows, "trace"))["tokens_within_band"] > 0.5


def test_the_bands_widen_until_unseen_rows_fall_within_them(published):
    rows = [_row(published, f"h{i}", "s1", "h100-80gb", e) for i, e in enumerate((0.05, -0.1, 0.08, -0.06, 0.1))]
    rows += [_row(published, f"a{i}", "s2", "a100-80gb", e) for i, e in enumerate((0.15, -0.18, 0.12, 0.2, -0.1))]
    widening = published.out_of_sample_factor(rows, "trace")
    assert widening["coverage_unwidened"] < 0.8 <= widening["coverage"]
    assert widening["factor"] > 1.0
    # one step less does not hold
    assert published.held_out_coverage(rows, "trace", widening["factor"] - 0.05) < 0.8


def test_published_memory_judges_only_like_for_like(published):
    same = _row(published, "t1", "torchtitan", "h100-80gb", 0.0, plan={"activation_checkpointing": "full"}, memory=12.5)
    other = _row(published, "t2", "torchtitan", "h100-80gb", 0.0, plan={"activation_checkpointing": "selective"},
                 memory=20.0)
    assert published.memory_other_implementation(same) is None
    assert "op-level SAC" in published.memory_other_implementation(other)
    s = published.summarize([same, other], "trace", {})
    assert s["memory_rows"] == 1 and s["memory_worst"] == pytest.approx(10.0 / 12.5 - 1)
    assert s["memory_other_implementation"] == 1
