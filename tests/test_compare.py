"""Which cluster to train on (issue 45): the arithmetic of paratune.costs.compare (tokens, GPU-hours, cost,
the Pareto front, ties, the measured winner in the sweep report) and `paratune plan --compare` end to
end on a shipped space. No Ray, no GPU."""

from __future__ import annotations

import json

import pytest
import yaml

from paratune.costs.compare import (
    Cluster,
    Outcome,
    Prices,
    from_document,
    gpu_hours,
    hours_to_train,
    load_prices,
    missing_prices,
    parse_clusters,
    pareto_front,
    prediction_band,
    rank,
    smallest_fitting,
    tie,
    to_document,
    tokens_label,
    whole_node_counts,
    with_measured,
)
from paratune.config.devices import load_devices

NODES = {name: d.gpus_per_node for name, d in load_devices().items()}


def outcome(device: str, gpus: int, tps: float | None, band: float = 0.25, **kw) -> Outcome:
    return Outcome(Cluster(device, gpus, min(gpus, 8)), tokens_per_s_per_gpu=tps, band=band if tps else 0.0,
                   best="fsdp:full mb1x8" if tps else None, **kw)


# --------------------------------------------------------------------------- clusters and prices
def test_clusters_are_device_by_count_in_whole_nodes_of_the_table():
    clusters = parse_clusters("h100-80gb:8, a100-80gb:16,h200-141gb:4,h100-80gb:8", NODES)
    assert [c.label for c in clusters] == ["h100-80gb:8", "a100-80gb:16", "h200-141gb:4"]  # the repeat dropped
    assert [c.layout for c in clusters] == ["1 x 8", "2 x 8", "1 x 4"]  # 4 GPUs: part of one node


@pytest.mark.parametrize("text, expected", [
    ("h100:8", "device 'h100' (in 'h100:8') is not in the device table; closest: h100-80gb; allowed: a100-40gb"),
    ("h100-80gb:12", "12 GPUs are not whole nodes of h100-80gb (8 GPUs per node in the device table); allowed: "
                     "up to 8 (one node) or a multiple of 8, e.g. 8 or 16"),
    ("h100-80gb:0", "GPU count '0'; allowed: a whole number >= 1"),
    ("h100-80gb:eight", "GPU count 'eight'"),
    ("h100-80gb", "got 'h100-80gb'; allowed: DEVICE:GPUS, e.g. h100-80gb:8"),
    ("", "allowed: DEVICE:GPUS[,DEVICE:GPUS...]"),
])
def test_a_bad_cluster_names_the_item_and_what_is_allowed(text, expected):
    with pytest.raises(ValueError, match="^--compare: ") as err:
        parse_clusters(text, NODES)
    assert expected in str(err.value)


def test_prices_are_per_gpu_hour_in_one_currency_and_checked_field_by_field(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("currency: USD\nh100-80gb: 2.99\na100-80gb: 2\n")
    prices = load_prices(path, NODES)
    assert prices == Prices("USD", {"h100-80gb": 2.99, "a100-80gb": 2.0}, str(path))
    assert missing_prices(parse_clusters("h100-80gb:8", NODES), prices) is None
    assert "no price for h200-141gb (a device of --compare); allowed: add `h200-141gb: <price per GPU-hour in USD>`" \
        in missing_prices(parse_clusters("h100-80gb:8,h200-141gb:8", NODES), prices)
    for text, expected in [
        ("h100-80gb: 2.99\n", "currency: got None; allowed: a short name such as USD"),
        ("currency: USD\nh100-80gb: -1\n", "h100-80gb: got -1; allowed: a price per GPU-hour > 0, in USD"),
        ("currency: EUR\nh100-80gb: cheap\n", "h100-80gb: got 'cheap'; allowed: a price per GPU-hour > 0, in EUR"),
        ("currency: USD\nh100: 2.5\n", "'h100' is not a device of the table (closest: h100-80gb); allowed: currency, "),
        ("- 1\n- 2\n", "got [1, 2]; allowed: a mapping such as {currency: USD, h100-80gb: 2.49"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match="^--prices: ") as err:
            load_prices(path, NODES)
        assert str(path) in str(err.value) and expected in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_prices(tmp_path / "nowhere.yaml", NODES)


# --------------------------------------------------------------------------- arithmetic
def test_time_gpu_hours_and_cost_to_train():
    # 1e11 tokens at 10,000 tokens/s/GPU on 8 GPUs: 1.25e6 s; GPU-hours do not depend on the count
    assert hours_to_train(1e11, 10_000, 8) == pytest.approx(1.25e6 / 3600)
    assert gpu_hours(1e11, 10_000) == pytest.approx(1e7 / 3600)
    prices = Prices("USD", {"h100-80gb": 3.0})
    (row,) = rank([outcome("h100-80gb", 8, 10_000)], 1e11, prices)
    assert row.gpu_hours == pytest.approx(2777.78, rel=1e-5)
    assert row.cost == pytest.approx(8333.33, rel=1e-5) and row.price == 3.0
    assert row.cost_per_billion == pytest.approx(83.3333, rel=1e-5)  # 100 billion tokens
    # the band on tokens/s/GPU (± 25%) is the time's interval: t / 1.25 .. t / 0.75
    assert (row.hours_low, row.hours_high) == pytest.approx((row.hours / 1.25, row.hours / 0.75))
    assert tokens_label(1e11) == "100B" and tokens_label(2.5e12) == "2.5T" and tokens_label(2e11) == "200B"
    with pytest.raises(ValueError, match="--tokens: got -5.0; allowed: a number of tokens > 0"):
        rank([], -5.0)


def test_pareto_front_of_time_against_cost():
    times = [10.0, 20.0, 15.0, 30.0, 10.0, None]
    costs = [100.0, 50.0, 120.0, 50.0, 100.0, 1.0]
    # 15 h at 120 is beaten by 10 h at 100; 30 h at 50 by 20 h at 50; equal points both stay; None never
    assert pareto_front(times, costs) == [True, True, False, False, True, False]
    assert pareto_front([], []) == []


def test_ties_are_what_the_band_cannot_separate():
    assert tie(100, 70, 0.25, 0.25)  # 75 <= 87.5: the intervals overlap
    assert not tie(100, 50, 0.25, 0.25)  # 75 > 62.5
    assert tie(70, 100, 0.25, 0.25)  # order does not matter
    assert tie(100, 100, 0.0, 0.0) and not tie(100, 99, 0.0, 0.0)  # measured against measured: no band
    assert prediction_band() == 0.25  # the roofline's stated prior (paratune.costs.predict.RooflinePredictor)


def test_a_plans_band_is_its_estimates_from_the_published_corpus():
    """compare reads the band paratune.costs.estimate put on the estimate (paratune.costs.bands: the corpus's
    band for the plan's kind), the prior only where there is none."""
    from types import SimpleNamespace

    from paratune.costs.bands import PredictionBand, prediction_band as corpus_band
    from paratune.config.devices import get_device
    from paratune.config.plan import Plan

    assert prediction_band(SimpleNamespace(band=PredictionBand(0.13, 0.2, "tp", "tp"))) == 0.13
    assert prediction_band(SimpleNamespace(band=None)) == 0.25
    plan = Plan.model_validate({"model": "llama3-8b", "num_workers": 8, "global_batch": 8, "micro_batch": 1,
                                "seq_len": 8192, "strategy": "fsdp", "precision": "bf16", "device": "cuda",
                                "float8": "rowwise", "compile": True})
    band = corpus_band(plan, get_device("h100-80gb"))
    assert prediction_band(SimpleNamespace(band=band)) == band.tokens != 0.25  # rowwise float8's own rows


def test_rank_orders_by_time_marks_the_fastest_its_ties_and_the_front():
    prices = Prices("USD", {"h100-80gb": 3.0, "a100-80gb": 1.5, "h200-141gb": 4.0})
    rows = rank([outcome("a100-80gb", 8, 3_000), outcome("h100-80gb", 8, 10_000), outcome("a100-80gb", 16, 3_000),
                 outcome("h200-141gb", 8, 11_000), outcome("a100-40gb", 2, None, reason="no plan fits")], 1e11, prices)
    assert [r.outcome.cluster.label for r in rows] == ["h200-141gb:8", "h100-80gb:8", "a100-80gb:16", "a100-80gb:8",
                                                       "a100-40gb:2"]
    assert [r.fastest for r in rows] == [True, False, False, False, False]
    assert [r.tie_with_fastest for r in rows] == [False, True, False, False, False]  # 10,000 vs 11,000: within ± 25%
    # cost per GPU-hour / tokens per GPU-hour: h100 3/10000 < a100 1.5/3000 < h200 4/11000 -> h100 is cheapest
    assert [r.pareto for r in rows] == [True, True, False, False, False]
    assert rows[-1].hours is None and rows[-1].cost is None  # nothing fits: no numbers, never on the front
    # without prices the front is over GPU-hours (as if every GPU-hour cost the same): the fastest per GPU wins both
    free = rank([r.outcome for r in rows], 1e11)
    assert [r.outcome.cluster.label for r in free if r.pareto] == ["h200-141gb:8"]
    assert all(r.cost is None for r in free)


def test_a_measured_winner_replaces_its_cluster_and_scales_its_devices_others():
    outcomes = [outcome("h100-80gb", 8, 10_000, runner_up="zero-2", runner_up_tokens_per_s_per_gpu=8_000),
                outcome("h100-80gb", 16, 9_000), outcome("a100-80gb", 8, 3_000), outcome("h100-80gb", 32, None)]
    out, ratio = with_measured(outcomes, "h100-80gb", 8, 8_000.0, "fsdp:grad_op mb2x4")
    assert ratio == pytest.approx(0.8)
    assert (out[0].tokens_per_s_per_gpu, out[0].band, out[0].source) == (8_000.0, 0.0, "measured")
    assert out[0].best == "fsdp:grad_op mb2x4" and out[1].best == "fsdp:full mb1x8"  # the winner's plan
    assert out[0].runner_up_tokens_per_s_per_gpu == pytest.approx(6_400)
    assert (out[1].tokens_per_s_per_gpu, out[1].source) == (pytest.approx(7_200), "scaled")
    assert out[2] is outcomes[2] and out[3] is outcomes[3]  # another device; a cluster where nothing fits
    assert with_measured(outcomes, "h200-141gb", 8, 8_000.0) == (outcomes, None)  # not among the clusters


def test_the_smallest_fitting_count_is_found_in_few_checks():
    counts = whole_node_counts(2, 8)
    assert counts[:5] == [4, 8, 16, 24, 32] and counts[-1] == 512
    asked = []

    def fits_from(n: int):
        def check(c: int) -> bool:
            asked.append(c)
            return c >= n
        return check

    assert smallest_fitting(counts, fits_from(40)) == 40
    assert len(asked) < 12  # galloping, then the gap: not all 65 counts
    asked.clear()
    assert smallest_fitting(counts, fits_from(4)) == 4 and asked == [4]
    assert smallest_fitting(counts, fits_from(10_000)) is None
    assert smallest_fitting([], fits_from(1)) is None


def test_compare_json_reads_back():
    prices = Prices("EUR", {"h100-80gb": 2.0}, "p.yaml")
    outcomes = [outcome("h100-80gb", 8, 10_000), outcome("a100-40gb", 2, None, reason="no", smallest_fit=8)]
    data = json.loads(json.dumps(to_document(outcomes, 1e11, prices, model="llama3-8b")))
    assert data["model"] == "llama3-8b"
    assert from_document(data) == (outcomes, 1e11, prices)


# --------------------------------------------------------------------------- the sweep report
def test_the_sweep_report_draws_the_clusters_with_its_measured_winner(tmp_path):
    from paratune.sweep.page import build_report

    sweep = tmp_path / "s"
    (sweep / "winner").mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"device": "h100-80gb"}))
    (sweep / "winner" / "plan.yaml").write_text(yaml.safe_dump({"num_workers": 8, "strategy": "fsdp"}))
    (sweep / "winner" / "summary.json").write_text(json.dumps({"tokens_per_s_per_gpu_median": 9_000.0}))
    page = build_report(sweep)
    assert not (sweep / "report" / "compare.png").exists() and "per cluster" not in page.html_path.read_text()
    outcomes = [outcome("h100-80gb", 8, 10_000), outcome("h100-80gb", 16, 9_500), outcome("a100-80gb", 8, 3_000)]
    (sweep / "compare.json").write_text(json.dumps(to_document(outcomes, 1e11, Prices("USD", {"h100-80gb": 3.0,
                                                                                             "a100-80gb": 1.5}))))
    page = build_report(sweep)
    figure = page.figures[-1]
    assert (sweep / "report" / "compare.png").exists() and figure.png
    assert figure.data["sources"] == ["scaled", "measured", "predicted"]
    assert figure.data["labels"] == ["h100-80gb:16", "h100-80gb:8", "a100-80gb:8"]  # 16 x 8,550 beats 8 x 9,000
    assert "h100-80gb:8: the sweep's measured winner (9,000 tokens/s/GPU); the other h100-80gb clusters: " \
           "predicted x 0.90" in figure.caption
    assert "Time and cost to train, per cluster" in page.html_path.read_text()


# --------------------------------------------------------------------------- the command
def test_plan_compare_on_the_shipped_8b_space(tmp_path, capsys):
    """The issue's command, on two of its clusters (each costs the space's 1,392 plans)."""
    from paratune.cli import main

    prices = tmp_path / "my_prices.yaml"
    prices.write_text("currency: USD\nh100-80gb: 2.99\na100-80gb: 1.79\n")
    out = tmp_path / "out"
    code = main(["plan", "search_spaces/llama3_8b_1x8.yaml", "--compare", "h100-80gb:8,a100-80gb:16",
                 "--tokens", "1e11", "--prices", str(prices), "--out", str(out), "--formula"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "100B tokens to train, predicted, fastest first" in printed and "USD/1B tokens" in printed
    assert "95% of each device's memory (the space's memory_budget_gb 76, read against h100-80gb's 80 GiB" in printed
    outcomes, tokens, read_prices = from_document(json.loads((out / "compare.json").read_text()))
    assert tokens == 1e11 and read_prices.currency == "USD"
    h100, a100 = outcomes
    assert h100.fits and a100.fits and h100.runner_up and h100.runner_up_tokens_per_s_per_gpu
    assert h100.runner_up.split()[0].split(":")[0].split("-")[0] != h100.best_strategy  # another strategy
    assert "fp8" in h100.best and "fp8" not in a100.best  # A100s have no FP8 tensor cores: float8 refused there
    rows = rank(outcomes, tokens, read_prices)
    assert rows[0].outcome is h100 and rows[0].fastest and rows[0].pareto
    assert rows[1].cost == pytest.approx(rows[1].gpu_hours * 1.79)
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_compare_says_what_fits_nowhere_and_the_smallest_cluster_that_would(tmp_path, capsys):
    """The shipped LoRA space (one 24 GB GPU), a device added with --devices, EUR prices."""
    from paratune.cli import main

    devices = tmp_path / "my_gpus.yaml"
    devices.write_text("t4-16gb: {memory_gib: 16, tflops: {bf16: 65, fp32: 8.1}, intra_node_gbps: 16, "
                       "inter_node_gbps: 3, gpus_per_node: 4}\n")
    prices = tmp_path / "prices.yaml"
    prices.write_text("currency: EUR\nl4-24gb: 0.7\nh100-80gb: 2.5\nt4-16gb: 0.3\n")
    out = tmp_path / "out"
    code = main(["plan", "search_spaces/qwen2.5_7b_lora_1x24gb.yaml", "--compare",
                 "l4-24gb:1,h100-80gb:2,t4-16gb:1,h100-80gb:32", "--devices", str(devices), "--tokens", "1e9",
                 "--prices", str(prices), "--out", str(out), "--formula"])
    printed = capsys.readouterr().out
    assert code == 0
    # the budget (22 GB) was written for a 24 GB card: 92% of every device's memory
    assert "92% of each device's memory (the space's memory_budget_gb 22, read against a10g-24gb's 24 GiB" in printed
    by = {o.cluster.label: o for o in from_document(json.loads((out / "compare.json").read_text()))[0]}
    assert by["l4-24gb:1"].fits and by["h100-80gb:2"].fits
    t4 = by["t4-16gb:1"]  # 7B in bf16 is 15.2 GB: one 16 GB card cannot even build it; FSDP over 4 shards it
    assert not t4.fits and "construction needs" in t4.reason and t4.smallest_fit == 4
    assert "the smallest t4-16gb cluster that fits: 4 GPUs" in printed
    lost = by["h100-80gb:32"]  # global batch 16 over 32 data-parallel ranks: the training would change
    assert not lost.fits and lost.reason.startswith("no plan keeps global_batch 16 at 32 GPUs: global_batch: 16 is "
                                                    "not divisible by micro_batch x dp_degree")
    assert "h100-80gb:32: no plan keeps global_batch 16" in printed


@pytest.mark.parametrize("extra, expected", [
    (["--compare", "h100:8", "--tokens", "1e11"], "closest: h100-80gb"),
    (["--compare", "h100-80gb:8"], "--tokens: required with --compare"),
    (["--compare", "h100-80gb:8", "--tokens", "1e11", "--device", "a100-80gb"], "--device: got 'a100-80gb'; not with "
                                                                                 "--compare"),
    (["--compare", "h100-80gb:8", "--tokens", "0"], "--tokens: got 0.0; allowed: a number of tokens > 0"),
])
def test_plan_compare_refuses_bad_input_before_estimating(extra, expected, capsys):
    from paratune.cli import main

    assert main(["plan", "search_spaces/llama3_8b_1x8.yaml", *extra]) == 2
    printed = capsys.readouterr().out
    assert "cannot compare" in printed and expected in printed
