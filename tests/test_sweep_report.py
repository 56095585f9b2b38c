"""The sweep report: its leaderboard and figures checked against the ledger they were drawn from.

Ledgers are built from real TrialResult/LedgerEntry objects (written with paratune.sweep.Ledger),
plus one real sweep's folder (tests/data/sweep_report: `paratune tune search_spaces/local_cpu.yaml`).
No Ray, no MLflow.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import statistics
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from PIL import Image

from paratune.config.plan import load_plan_dict
from paratune.sweep.figures import (FIGURE_PIXELS, knob_importance, pareto_front, plot_importance, plot_losses,
                                    plot_predicted, plot_throughput_memory)
from paratune.sweep.folder import leaderboard, read_sweep
from paratune.sweep.ledger import Ledger, LedgerEntry, point_key
from paratune.sweep.page import SweepReportPage, build_report, report_files, write_sweep_report
from paratune.cluster.trial import TrialResult
from paratune.sweep.verdict import Standing, decide

REAL_SWEEP = Path(__file__).parent / "data" / "sweep_report"
MiB = 2**20


# --------------------------------------------------------------------------- building ledgers
def plan_for(choices: dict, env: dict | None = None) -> dict:
    """A real, validated plan dict for a point's choices (as the sweep's space.plan_for makes)."""
    fields = {"model": "small-llama", "num_workers": 2, "global_batch": 16, "seq_len": 128, "micro_batch": 2,
              "env": env or {}}
    for name, value in choices.items():
        if "." in name:
            section, option = name.split(".", 1)
            fields.setdefault(section, {})[option] = value
        else:
            fields[name] = value
    return load_plan_dict(fields).to_dict()


def ok(plan: dict, tps: float, peak_mib: float = 500, spread: float = 0.02, steps: int = 4,
       launch: float = 3.0, wall: float = 10.0) -> TrialResult:
    step = 2048 / tps / 2
    return TrialResult(status="ok", plan=plan, world_size=2, device="cpu", tokens_per_step=2048,
                       tokens_per_s_per_gpu=tps, step_time_median_s=step, step_time_p10_s=step,
                       step_time_p90_s=step * (1 + spread), step_time_spread=spread,
                       peak_memory_bytes=[int(peak_mib * MiB * 0.9), int(peak_mib * MiB)],
                       losses=[6.0 - 0.1 * i for i in range(steps + 2)], step_times_s=[step] * steps,
                       launch_s=launch, wall_s=wall)


def write_ledger(sweep_dir: Path, entries: list[tuple[str, TrialResult, str]],
                 memory_budget_gb: float | None = None) -> list[LedgerEntry]:
    """(key, result, phase) in order, through the sweep's own Ledger; sweep.json as run_sweep writes it."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"algorithm": "tpe", "seed": 0, "parent_run_id": "r0",
                                                      "memory_budget_gb": memory_budget_gb}))
    ledger = Ledger(sweep_dir / "ledger.jsonl")
    for i, (key, result, phase) in enumerate(entries, 1):
        ledger.append(LedgerEntry(i, key, result, phase))
    return ledger.entries


def export_winner(sweep_dir: Path, plan: dict, label: str, parity_failed: list[dict] | None = None) -> None:
    """What export.export_winner leaves that the report reads: plan.yaml and summary.json."""
    (sweep_dir / "winner").mkdir(parents=True, exist_ok=True)
    (sweep_dir / "winner" / "plan.yaml").write_text("# paratune winner: x\n" + yaml.safe_dump(plan, sort_keys=False))
    (sweep_dir / "winner" / "summary.json").write_text(json.dumps(
        {"sweep": "t", "label": label, "parity_max_abs_loss_diff": 1e-6, "parity_failed_above": parity_failed or []}))


def key_of(choices: dict, env: dict | None = None) -> str:
    return point_key(choices, env or {})


class Page(HTMLParser):
    """The leaderboard rows (their data- attributes) and every <img> of a report."""

    def __init__(self, text: str):
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.images: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-key" in a:
            self.rows.append(a)
        if tag == "img":
            self.images.append(a["src"])


def png_sizes(page: Page) -> list[tuple[int, int]]:
    sizes = []
    for src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:40]
        image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert image.format == "PNG"
        sizes.append(image.size)
    return sizes


# --------------------------------------------------------------------------- a synthetic sweep
A = {"strategy": "ddp", "micro_batch": 2}
B = {"strategy": "ddp", "micro_batch": 4}
C = {"strategy": "fsdp", "micro_batch": 2, "fsdp.sharding": "full"}
D = {"strategy": "fsdp", "micro_batch": 4, "fsdp.sharding": "full"}
E = {"strategy": "ddp", "micro_batch": 8}
F = {"strategy": "fsdp", "micro_batch": 8, "fsdp.sharding": "full"}


def make_sweep(d: Path) -> Path:
    """A resumed sweep: A fastest but fails parity, B (tied with A) wins, C slower, D oom, E
    stopped early, F lost to the cluster first and measured again after the resume."""
    pa, pb, pc, pd, pe, pf = (plan_for(c) for c in (A, B, C, D, E, F))
    write_ledger(d, [
        (key_of(A), ok(pa, 1000, peak_mib=600), "search"),
        (key_of(B), ok(pb, 995, peak_mib=700), "search"),
        (key_of(C), ok(pc, 700, peak_mib=400), "search"),
        (key_of(D), TrialResult.failed(pd, "oom", "over budget: peak 5 GiB > memory_budget_gb 4"), "search"),
        (key_of(E), TrialResult(status="stopped_early", message="cannot reach the incumbent", plan=pe, world_size=2,
                                tokens_per_s_per_gpu=300, peak_memory_bytes=[900 * MiB], step_times_s=[3.0, 3.1],
                                launch_s=2.0, wall_s=8.0), "search"),
        (key_of(F), TrialResult.failed(pf, "node_lost", "node died"), "search"),
        (key_of(F), ok(pf, 650, peak_mib=300), "search"),  # after --resume
        (key_of(A), ok(pa, 1040, peak_mib=600), "remeasure"),
        (key_of(B), ok(pb, 985, peak_mib=700), "remeasure"),
        (key_of(A), ok(pa, 1010, peak_mib=600), "remeasure"),
    ], memory_budget_gb=4)
    with (d / "ledger.jsonl").open("a") as f:
        f.write('{"number": 11, "key": "cut by a cra')  # the crash mid-write Ledger skips
    export_winner(d, pb, "ddp mb4x2", [{"label": "ddp mb2x4", "key": key_of(A), "reason": "loss off by 0.3"}])
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SweepReportPage]:
    """The synthetic sweep's report, built once, for the tests that only read it."""
    d = make_sweep(tmp_path_factory.mktemp("built") / "sweep")
    return d, build_report(d)


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A fresh copy of the synthetic sweep, for tests that change its folder."""
    return make_sweep(tmp_path / "sweep")


def test_leaderboard_rows_are_the_ledgers_plans_with_their_medians_and_verdicts(built) -> None:
    sweep, page = built
    html_path = page.html_path
    assert html_path == sweep / "report" / "report.html"
    rows = {r["data-key"]: r for r in Page(html_path.read_text()).rows}
    entries = Ledger(sweep / "ledger.jsonl").entries
    assert set(rows) == {e.key for e in entries}  # every plan, once
    for key in (key_of(A), key_of(B), key_of(C), key_of(F)):
        values = [e.result.tokens_per_s_per_gpu for e in entries if e.key == key and e.result.ok]
        assert float(rows[key]["data-median"]) == pytest.approx(statistics.median(values))
        assert int(rows[key]["data-runs"]) == len(values)
    verdicts = {key: rows[key]["data-verdict"] for key in rows}
    # A and B are within each other's noise; A, faster, failed parity, so B is the exported winner.
    assert verdicts == {key_of(A): "parity_failed", key_of(B): "winner", key_of(C): "slower",
                        key_of(F): "slower", key_of(D): "failed", key_of(E): "stopped_early"}
    assert rows[key_of(A)]["data-label"] == "ddp mb2x4"
    order = [r["data-key"] for r in Page(html_path.read_text()).rows]
    assert order[:4] == [key_of(A), key_of(B), key_of(C), key_of(F)]  # fastest first, then the rest
    assert "oom: over budget" in html_path.read_text()


def test_the_verdict_is_the_one_sweep_finish_reaches(sweep: Path) -> None:
    """Without winner/ the ranking and ties are verdict.decide's over the ok results."""
    shutil.rmtree(sweep / "winner")
    page = build_report(sweep)
    entries = Ledger(sweep / "ledger.jsonl").entries
    standings: dict[str, Standing] = {}
    for e in entries:
        if e.result.ok:
            standings.setdefault(e.key, Standing(e.key, "", e.result.plan)).results.append(e.result)
    verdict = decide(list(standings.values()))
    tied = {s.key for s in verdict.tied_with_best}
    assert [r.key for r in page.rows[:len(verdict.ranked)]] == [s.key for s in verdict.ranked]
    assert page.rows[0].verdict == "best"  # fastest, but nothing was exported
    assert tied - {page.rows[0].key}, "the fixture should hold a plan tied with the best"
    for row in page.rows[1:len(verdict.ranked)]:
        assert row.verdict == ("tied" if row.key in tied else "slower")
    assert "No winner" in page.html_path.read_text()


def test_every_image_is_a_png_of_the_fixed_size_and_written_beside_the_html(built) -> None:
    sweep, page = built
    images = Page(page.html_path.read_text()).images
    assert png_sizes(Page(page.html_path.read_text())) == [FIGURE_PIXELS] * len(images)
    assert len(images) == len(page.png_paths) >= 3
    assert report_files(sweep) == page.png_paths
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in images]
    assert embedded == [p.read_bytes() for p in page.png_paths]  # the same pictures, page order


def test_throughput_memory_scatter_has_one_point_per_trial_with_figures(built) -> None:
    sweep, page = built
    scatter = page.figures[0]
    with_figures = [e for e in Ledger(sweep / "ledger.jsonl").entries
                    if e.result.tokens_per_s_per_gpu and max(e.result.peak_memory_bytes, default=0) > 0]
    points = scatter.figure.axes[0].collections[0].get_offsets()
    assert len(points) == len(with_figures) == len(scatter.data["trial_numbers"])
    assert sorted(map(tuple, points.tolist())) == sorted(
        (max(e.result.peak_memory_bytes) / 2**30, e.result.tokens_per_s_per_gpu) for e in with_figures)
    budget_lines = [line for line in scatter.figure.axes[0].lines if list(line.get_xdata()) == [4, 4]]
    assert len(budget_lines) == 1 and "Memory budget 4 GiB (sweep.json)" in scatter.caption


def test_pareto_front_by_hand() -> None:
    memory = [1.0, 2.0, 3.0, 0.5, 2.0, 0.5]
    tps = [100, 150, 140, 50, 120, 40]
    # (3, 140) and (2, 120) lose to (2, 150); (0.5, 40) to (0.5, 50).
    assert pareto_front(memory, tps).tolist() == [True, True, False, True, False, False]
    # A point that is not eligible (not fully measured) neither joins nor beats the front.
    assert pareto_front(memory, tps, [True, False, True, True, True, True]).tolist() == \
        [True, False, True, True, True, False]


def test_pareto_front_as_plotted(tmp_path: Path) -> None:
    points = {(1, 100): True, (2, 150): True, (3, 140): False, (0.5, 50): True, (2.5, 120): False}
    entries = [(key_of({"strategy": "ddp", "micro_batch": 2}, {"NCCL_X": str(i)}),
                ok(plan_for({"strategy": "ddp"}, {"NCCL_X": str(i)}), tps, peak_mib=mem * 1024), "search")
               for i, (mem, tps) in enumerate(points)]
    write_ledger(tmp_path / "s", entries)
    scatter = plot_throughput_memory(read_sweep(tmp_path / "s"))
    on_front = {(round(m * 1024), t): f for m, t, f in zip(scatter.data["memory_gib"],
                                                             scatter.data["tokens_per_s_per_gpu"], scatter.data["pareto"])}
    assert on_front == {(round(m * 1024), t): f for (m, t), f in points.items()}
    assert "No budget line" in scatter.caption  # sweep.json records none, and none was given
    assert not [line for line in scatter.figure.axes[0].lines if line.get_linestyle() == "--"]
    given = plot_throughput_memory(read_sweep(tmp_path / "s", memory_budget_gb=2))
    assert [list(line.get_xdata()) for line in given.figure.axes[0].lines if line.get_linestyle() == "--"] == [[2, 2]]


def test_importance_ranks_the_knob_that_drives_throughput_first(tmp_path: Path) -> None:
    entries = []
    for i, (mb, bucket, ckpt) in enumerate((mb, bucket, ckpt) for mb in (2, 4, 8) for bucket in (1, 25)
                                           for ckpt in ("none", "full")):
        choices = {"strategy": "ddp", "micro_batch": mb, "ddp.bucket_cap_mb": bucket, "activation_checkpointing": ckpt}
        # micro_batch 8 sets the best trials apart; a small bucket costs a little everywhere (so
        # the slowest trials share a bucket, not a micro-batch: a study minimising would rank it first).
        tps = {2: 300, 4: 320, 8: 1200}[mb] - 40 * (bucket == 1) + (7 * i) % 4
        entries.append((key_of(choices), ok(plan_for(choices), tps), "search"))
    write_ledger(tmp_path / "s", entries)
    folder = read_sweep(tmp_path / "s")
    importances, why = knob_importance(folder)
    assert not why
    assert next(iter(importances)) == "micro_batch"
    assert set(importances) == {"micro_batch", "ddp.bucket_cap_mb", "activation_checkpointing"}
    figure = plot_importance(folder)
    assert figure.png is not None and figure.data["importances"] == importances
    bars = figure.figure.axes[0].patches  # drawn bottom-up: the most important on top
    assert [t.get_text() for t in figure.figure.axes[0].get_yticklabels()][-1] == "micro_batch"
    assert bars[-1].get_width() == pytest.approx(importances["micro_batch"])


def test_importance_says_why_not_with_one_varying_knob(tmp_path: Path) -> None:
    entries = [(key_of({"strategy": "ddp", "micro_batch": mb}), ok(plan_for({"strategy": "ddp", "micro_batch": mb}), tps),
                "search") for mb, tps in ((2, 300), (4, 600), (8, 900), (2, 310), (4, 620))]
    write_ledger(tmp_path / "s", entries)
    page = build_report(tmp_path / "s")
    assert page.figures[1].png is None
    assert "at least 2 knobs that vary" in page.figures[1].note and "micro_batch" in page.figures[1].note
    assert not (tmp_path / "s" / "report" / "importance.png").exists()
    assert "at least 2 knobs that vary" in page.html_path.read_text()


def test_predicted_against_measured_with_the_median_error_band(built) -> None:
    sweep, page = built
    assert "No predictions recorded" in page.figures[2].note  # this ledger has none
    folder = read_sweep(sweep)
    for e in folder.entries:  # what the sweep records per trial (LedgerEntry.predicted)
        if e.result.ok:
            e.predicted = {"predicted_peak_memory_gib": max(e.result.peak_memory_bytes) / 2**30 * 1.2,
                           "predicted_step_time_s": e.result.step_time_median_s * (0.5 if e.key == key_of(C) else 0.9)}
    figure = plot_predicted(folder)
    ok_entries = [e for e in folder.entries if e.result.ok]
    assert len(figure.data["memory"]["measured"]) == len(ok_entries)
    assert figure.data["memory"]["median_abs_error"] == pytest.approx(0.2)
    assert figure.data["step_time"]["median_abs_error"] == pytest.approx(0.1)
    assert Image.open(io.BytesIO(figure.png)).size == FIGURE_PIXELS


def test_time_split_bars_per_trial(built) -> None:
    sweep, page = built
    split = page.figures[3]
    entries = Ledger(sweep / "ledger.jsonl").entries
    assert len(split.data["labels"]) == len(entries)
    for e, launch, measured, other in zip(entries, split.data["launch_s"], split.data["measured_s"], split.data["other_s"]):
        assert launch == (e.result.launch_s or 0)
        assert measured == pytest.approx(sum(e.result.step_times_s))
        assert other == pytest.approx(max(0.0, (e.result.wall_s or 0) - launch - measured))


def test_loss_curves_with_and_without_a_reference(built, sweep: Path) -> None:
    losses = built[1].figures[4]
    assert "No reference recorded" in losses.caption
    assert [name for name, _, ref in losses.data["curves"]] == ["ddp mb2x4", "ddp mb4x2", "fsdp:full mb2x4"]
    (sweep / "parity.json").write_text(json.dumps([
        {"label": "ddp mb2x4", "key": key_of(A), "passed": False, "max_abs_loss_diff": 0.3,
         "losses": [6.0, 5.9, None], "reference_losses": [6.0, 5.6, 5.5], "proxy": None,
         "reason": "max |loss - reference| 0.3 over tolerance 0.0001"},
        {"label": "ddp mb4x2", "key": key_of(B), "passed": True, "max_abs_loss_diff": 1e-6,
         "losses": [6.0, 5.9, 5.8], "reference_losses": [6.0, 5.9, 5.8], "proxy": {"num_hidden_layers": 2}}]))
    folder = read_sweep(sweep)
    losses = plot_losses(folder, leaderboard(folder))
    assert [(ref is not None) for _, _, ref in losses.data["curves"]] == [True, True]
    assert len(losses.figure.axes[0].lines) == 2 * 2 + 1  # each plan, its reference, the legend's key
    assert "on a proxy model" in losses.data["curves"][1][0]
    assert losses.data["curves"][0][1][:2] == [6.0, 5.9]  # a non-finite loss (JSON null) is a gap
    # Without winner/, a failed check in parity.json still marks its plan on the leaderboard.
    shutil.rmtree(sweep / "winner")
    verdicts = {r.key: (r.verdict, r.detail) for r in leaderboard(read_sweep(sweep))}
    assert verdicts[key_of(A)] == ("parity_failed", "max |loss - reference| 0.3 over tolerance 0.0001")


def test_a_sweep_with_only_failed_trials(tmp_path: Path) -> None:
    write_ledger(tmp_path / "s", [(key_of(A), TrialResult.failed(plan_for(A), "error", "boom"), "search")])
    html_path = write_sweep_report(tmp_path / "s")
    text = html_path.read_text()
    assert [(r["data-verdict"], r["data-median"]) for r in Page(text).rows] == [("failed", "")]
    assert "No winner" in text and "error: boom" in text
    assert "No trial measured both throughput and peak memory" in text and "No trial recorded losses" in text
    assert report_files(tmp_path / "s") == [tmp_path / "s" / "report" / "time_split.png"]


# --------------------------------------------------------------------------- a real sweep's folder
def test_real_sweep(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "real"
    shutil.copytree(REAL_SWEEP, sweep_dir)
    page = build_report(sweep_dir)
    text = page.html_path.read_text()
    parsed = Page(text)
    entries = Ledger(sweep_dir / "ledger.jsonl").entries
    assert entries and {r["data-key"] for r in parsed.rows} == {e.key for e in entries}
    for row in parsed.rows:
        values = [e.result.tokens_per_s_per_gpu for e in entries if e.key == row["data-key"] and e.result.ok]
        if values:
            assert float(row["data-median"]) == pytest.approx(statistics.median(values))
    winners = [r["data-key"] for r in parsed.rows if r["data-verdict"] == "winner"]
    if (sweep_dir / "winner" / "plan.yaml").exists():  # the exported plan is the one row marked winner
        exported = yaml.safe_load((sweep_dir / "winner" / "plan.yaml").read_text())
        assert winners == sorted({e.key for e in entries if e.result.plan == exported})
        summary = json.loads((sweep_dir / "winner" / "summary.json").read_text())
        winner_row = next(r for r in parsed.rows if r["data-verdict"] == "winner")
        assert float(winner_row["data-median"]) == pytest.approx(summary["tokens_per_s_per_gpu_median"])
    else:
        assert not winners
    assert png_sizes(parsed) == [FIGURE_PIXELS] * len(parsed.images) and len(parsed.images) >= 3
    with_figures = [e for e in entries if e.result.tokens_per_s_per_gpu and max(e.result.peak_memory_bytes, default=0) > 0]
    assert len(page.figures[0].figure.axes[0].collections[0].get_offsets()) == len(with_figures)
    assert re.search(r"search trial\(s\)", text)
