"""A finished sweep as one HTML page: the leaderboard and the figures that explain it.

The page is built from the sweep folder alone (ledger.jsonl, sweep.json, winner/, parity.json),
so `paratune report SWEEP_DIR` can rebuild it any time, a resumed sweep included. Every image is
embedded as a base64 data URI so report.html still works when moved or mailed; the same PNGs
are written beside it so they can be logged to MLflow as artifacts one by one.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paratune.report import env_label, strategy_label
from paratune.sweep import Ledger, LedgerEntry, objective_value, unscored
from paratune.trial import TrialResult
from paratune.verdict import Standing, decide

REPORT_DIR = "report"
HTML_NAME = "report.html"
# Every figure has this size so the page lays out the same for any sweep (and a test can check it).
FIGSIZE_IN = (9.0, 4.8)
DPI = 100
FIGURE_PIXELS = (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
# The PNG names, in page order; a figure not drawn this time (no data) leaves no file behind.
FIGURE_NAMES = ("throughput_memory.png", "importance.png", "predicted.png", "time_split.png", "losses.png")
MIN_IMPORTANCE_TRIALS = 5  # fewer scored trials say nothing about which knob matters
TOP_LOSS_PLANS = 3
GiB = 2**30


# --------------------------------------------------------------------------- the sweep folder
@dataclass
class SweepFolder:
    """What a sweep leaves on disk, read tolerantly (a sweep may be unfinished or resumed)."""

    path: Path
    entries: list[LedgerEntry]
    state: dict[str, Any]
    winner_summary: dict[str, Any] | None
    winner_plan: dict[str, Any] | None
    parity: list[dict[str, Any]]  # parity.json: one check per plan; [] when none was recorded
    parity_recorded: bool
    memory_budget_gb: float | None
    budget_source: str  # where the budget came from, or why there is none
    stop_reason: str = ""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _parity_checks(raw: Any) -> list[dict[str, Any]]:
    """parity.json as a list of checks; a dict holding the list, or junk entries, are tolerated."""
    if isinstance(raw, dict):
        raw = next((v for v in raw.values() if isinstance(v, list)), [])
    if not isinstance(raw, list):
        return []
    return [c for c in raw if isinstance(c, dict)]


def _budget(state: dict[str, Any], given: float | None) -> tuple[float | None, str]:
    """The space's objective.memory_budget_gb: given by the caller, or recorded in sweep.json."""
    if given:
        return float(given), "given"
    for holder in (state, state.get("objective") or {}, state.get("space") or {}):
        if isinstance(holder, dict) and holder.get("memory_budget_gb"):
            return float(holder["memory_budget_gb"]), "sweep.json"
    return None, "the sweep did not record a memory budget (sweep.json has no memory_budget_gb)"


def read_sweep(sweep_dir: Path, memory_budget_gb: float | None = None) -> SweepFolder:
    """The sweep folder's records. The ledger is read with paratune.sweep.Ledger (a line cut by a
    crash is skipped there), never parsed here."""
    import yaml

    sweep_dir = Path(sweep_dir)
    state = _read_json(sweep_dir / "sweep.json") or {}
    summary = _read_json(sweep_dir / "winner" / "summary.json")
    winner_plan = None
    if (sweep_dir / "winner" / "plan.yaml").exists():
        try:
            winner_plan = yaml.safe_load((sweep_dir / "winner" / "plan.yaml").read_text())
        except yaml.YAMLError:
            winner_plan = None
    parity_path = sweep_dir / "parity.json"
    stopped = _read_json(sweep_dir / "stopped.json") or {}
    budget, source = _budget(state, memory_budget_gb)
    return SweepFolder(sweep_dir, Ledger(sweep_dir / "ledger.jsonl").entries, state,
                       summary if isinstance(summary, dict) else None,
                       winner_plan if isinstance(winner_plan, dict) else None,
                       _parity_checks(_read_json(parity_path)), parity_path.exists(), budget, source,
                       str(stopped.get("reason", "")) if isinstance(stopped, dict) else "")


def peak_bytes(result: TrialResult) -> int | None:
    """Peak memory of the busiest rank, or None when not measured (a trial stopped before its
    memory step records zeros)."""
    peak = max(result.peak_memory_bytes, default=0)
    return peak if peak > 0 else None


def entry_label(result: TrialResult) -> str:
    """strategy_label + env_label, as the sweep prints a trial."""
    try:
        label = strategy_label(result.plan)
    except (KeyError, TypeError, AttributeError):
        label = str(result.plan.get("strategy", "?"))
    env = env_label(result.plan.get("env"))
    return f"{label} {env}" if env else label


# --------------------------------------------------------------------------- leaderboard
@dataclass
class Row:
    """One plan on the leaderboard: every measurement of it, and what the sweep made of it."""

    key: str
    label: str
    median: float | None  # tokens/s/GPU over its full measurements (search + re-measure)
    band_low: float | None  # median -/+ the noise half-width verdict.decide judges ties with
    band_high: float | None
    lowest: float | None
    highest: float | None
    runs: int
    step_time_spread: float | None  # median (p90 - p10) / median step time over its runs
    peak_memory_bytes: int | None  # max over ranks and runs
    verdict: str  # winner | tied | slower | best | parity_failed | stopped_early | failed | not_scored
    detail: str = ""


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def leaderboard(folder: SweepFolder) -> list[Row]:
    """Every plan the sweep measured, best first. Standings and ties come from verdict.decide over
    the ok results, exactly as sweep._finish builds them; the winner is the one exported to
    winner/ (a faster plan may have lost it on loss parity)."""
    standings: dict[str, Standing] = {}
    for e in folder.entries:
        if e.result.ok:
            s = standings.setdefault(e.key, Standing(e.key, strategy_label(e.result.plan), e.result.plan))
            s.results.append(e.result)
    verdict = decide(list(standings.values()))
    parity_failed = {f.get("key"): str(f.get("reason", "")) for f in (folder.winner_summary or {}).get(
        "parity_failed_above", []) if isinstance(f, dict)}
    for check in folder.parity:
        if check.get("passed") is False and check.get("key"):
            diff = check.get("max_abs_loss_diff")
            parity_failed.setdefault(check["key"], str(check.get("reason") or "") or (
                f"max |loss - reference| {diff:.3g}" if isinstance(diff, (int, float)) else "failed"))
    winner_key = None
    if folder.winner_plan is not None:
        winner_key = next((s.key for s in verdict.ranked if _same_plan(s.plan, folder.winner_plan)), None)
    if winner_key is None and folder.winner_summary:  # plan.yaml unreadable: the label still says it
        named = [s.key for s in verdict.ranked if s.label == folder.winner_summary.get("label")]
        winner_key = named[0] if len(named) == 1 else None
    tied = {s.key for s in verdict.tied_with_best}
    best = verdict.ranked[0].median if verdict.ranked else None
    rows: list[Row] = []
    for s in verdict.ranked:
        peaks = [p for p in map(peak_bytes, s.results) if p]
        spreads = [r.step_time_spread for r in s.results if r.step_time_spread is not None]
        if s.key == winner_key:
            code, detail = "winner", "exported to winner/"
        elif s.key in parity_failed:
            code, detail = "parity_failed", parity_failed[s.key]
        elif winner_key is None and s is verdict.ranked[0]:
            code, detail = "best", "fastest, but the sweep exported no winner"
        elif s.key in tied:
            code, detail = "tied", ("the fastest median, but a simpler plan is within its noise" if s is verdict.ranked[0]
                                    else "within the noise of the best")
        else:
            code, detail = "slower", f"{s.median / best - 1:+.0%} vs best" if best else ""
        rows.append(Row(s.key, entry_label(s.results[0]), s.median, s.median - s.band, s.median + s.band,
                        min(s.values), max(s.values), len(s.values),
                        statistics.median(spreads) if spreads else None, max(peaks) if peaks else None,
                        code, detail))
    # Plans with no full measurement: the last word on each (stopped early or failed, with why).
    last: dict[str, LedgerEntry] = {}
    for e in folder.entries:
        if e.key not in standings:
            if e.key not in last or unscored(last[e.key].result):  # a resumed re-run replaces a cluster failure
                last[e.key] = e
    for key, e in last.items():
        r = e.result
        if r.stopped_early:
            code, detail = "stopped_early", r.message or "its first measured steps could not reach the incumbent"
            if r.tokens_per_s_per_gpu:
                detail = f"{r.tokens_per_s_per_gpu:,.0f} tokens/s/GPU over its first steps; {detail}"
        elif unscored(r):
            code, detail = "not_scored", f"{r.reason} (the cluster failed it, not the plan): {r.message or ''}"
        else:
            code, detail = "failed", f"{r.reason}: {r.message or ''}"
        rows.append(Row(key, entry_label(r), None, None, None, None, None, 0, r.step_time_spread,
                        peak_bytes(r), code, detail[:300]))
    order = {"stopped_early": 0, "failed": 1, "not_scored": 2}
    head, tail = rows[:len(verdict.ranked)], rows[len(verdict.ranked):]
    return head + sorted(tail, key=lambda r: order.get(r.verdict, 3))


# --------------------------------------------------------------------------- figures
@dataclass
class Figure:
    """One figure of the page: its PNG, or the note that says why there is none. `data` holds the
    arrays that were plotted (what a reader or a test can check the picture against)."""

    name: str
    title: str
    caption: str = ""
    png: bytes | None = None
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    figure: Any = None  # the matplotlib Figure, kept for inspection


def _new_figure(ncols: int = 1):
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, axes


def _png(fig) -> bytes:
    """The figure at exactly FIGURE_PIXELS (no tight bbox: it would change the size)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _log_axis(axis, ax) -> None:
    """A log axis that reads as plain numbers at 1-2-5 steps (not 2x10^-1)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())


def pareto_front(memory: np.ndarray, throughput: np.ndarray, eligible: np.ndarray | None = None) -> np.ndarray:
    """Mask of the points no other eligible point beats: at most the memory and at least the
    throughput, and better in one of them."""
    memory, throughput = np.asarray(memory, float), np.asarray(throughput, float)
    eligible = np.ones(len(memory), bool) if eligible is None else np.asarray(eligible, bool)
    front = np.zeros(len(memory), bool)
    for i in np.flatnonzero(eligible):
        others = eligible.copy()
        others[i] = False
        dominated = others & (memory <= memory[i]) & (throughput >= throughput[i]) & \
            ((memory < memory[i]) | (throughput > throughput[i]))
        front[i] = not dominated.any()
    return front


def plot_throughput_memory(folder: SweepFolder) -> Figure:
    """tokens/s/GPU against peak memory per rank: one point per trial that measured both."""
    out = Figure(FIGURE_NAMES[0], "Throughput against peak memory per rank")
    with_figures = [e for e in folder.entries if e.result.tokens_per_s_per_gpu and peak_bytes(e.result)]
    if not with_figures:
        out.note = "No trial measured both throughput and peak memory."
        return out
    memory = np.array([peak_bytes(e.result) / GiB for e in with_figures])
    throughput = np.array([float(e.result.tokens_per_s_per_gpu) for e in with_figures])
    status = [e.result.status if not (e.result.reason == "oom") else "over_budget" for e in with_figures]
    ok = np.array([e.result.ok for e in with_figures])
    front = pareto_front(memory, throughput, ok)
    colors = {"ok": "tab:blue", "stopped_early": "tab:orange", "failed": "tab:gray", "over_budget": "tab:red"}
    fig, ax = _new_figure()
    ax.scatter(memory, throughput, c=[colors.get(s, "tab:gray") for s in status], s=36, zorder=3)
    order = np.argsort(memory[front])
    ax.plot(memory[front][order], throughput[front][order], drawstyle="steps-post", color="tab:green", lw=1.5,
            marker="o", markersize=11, markerfacecolor="none", label="Pareto front (fully measured trials)", zorder=4)
    for m, t, e in zip(memory, throughput, with_figures):
        ax.annotate(f"#{e.number}", (m, t), textcoords="offset points", xytext=(5, 4), fontsize=7, color="0.3")
    budget = folder.memory_budget_gb
    if budget:
        ax.axvline(budget, color="tab:red", ls="--", lw=1.2, label=f"memory budget {budget:g} GiB")
        if budget > 3 * memory.max():  # keep the points readable when the budget is far off
            _log_axis(ax.xaxis, ax)
    for name, color in colors.items():  # legend entries for the point colours present
        if name in status:
            ax.scatter([], [], c=color, s=36, label=name.replace("_", " "))
    ax.set_xlabel("peak memory per rank, GiB (max over ranks)")
    ax.set_ylabel("tokens/s/GPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    out.figure, out.png = fig, _png(fig)
    out.data = {"memory_gib": memory, "tokens_per_s_per_gpu": throughput, "pareto": front,
                "trial_numbers": [e.number for e in with_figures]}
    out.caption = (f"{len(with_figures)} trial(s); {int(front.sum())} on the Pareto front. " +
                   (f"Memory budget {budget:g} GiB ({folder.budget_source})." if budget else
                    f"No budget line: {folder.budget_source}."))
    return out


def _knob_values(key: str) -> dict[str, str]:
    """A ledger key's swept choices and env, as Optuna parameter names and JSON values."""
    try:
        point = json.loads(key)
    except (json.JSONDecodeError, TypeError):
        return {}
    if not isinstance(point, dict):
        return {}
    knobs = {name: json.dumps(v, sort_keys=True) for name, v in (point.get("choices") or {}).items()}
    knobs.update({f"env:{k}": json.dumps(str(v)) for k, v in (point.get("env") or {}).items()})
    return knobs


def knob_importance(folder: SweepFolder) -> tuple[dict[str, float], str]:
    """(importance per knob, best first) from the search's trials as an in-memory Optuna study,
    or ({}, why not). Same trials and objective as the searcher's study: unscored trials left
    out, failed and over-budget trials worth 0 (sweep.objective_value).

    Optuna's default evaluator (PED-ANOVA; fANOVA would need scikit-learn) compares where the
    top-quantile trials sit with where all trials sit. Its default top 10% is one trial in a
    short sweep, so the quantile is raised to hold at least three trials."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    trials = [(e, _knob_values(e.key)) for e in folder.entries
              if e.phase == "search" and not unscored(e.result)]
    trials = [(e, knobs) for e, knobs in trials if knobs]
    if len(trials) < MIN_IMPORTANCE_TRIALS:
        return {}, (f"Knob importance needs at least {MIN_IMPORTANCE_TRIALS} scored search trials; "
                    f"this sweep has {len(trials)}.")
    seen: dict[str, set[str]] = {}
    for _, knobs in trials:
        for name, value in knobs.items():
            seen.setdefault(name, set()).add(value)
    varying = sorted(name for name, values in seen.items() if len(values) > 1)
    if len(varying) < 2:
        return {}, (f"Knob importance needs at least 2 knobs that vary across trials; "
                    f"{'only ' + varying[0] if varying else 'none'} did.")
    values = [objective_value(e.result, folder.memory_budget_gb) for e, _ in trials]
    if max(values) == min(values):
        return {}, "Every scored trial has the same objective value: no knob can be told apart."
    dists = {name: CategoricalDistribution(sorted(seen[name])) for name in varying}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study = optuna.create_study(direction="maximize")
            for (_, knobs), value in zip(trials, values):
                params = {n: knobs[n] for n in varying if n in knobs}
                study.add_trial(optuna.trial.create_trial(params=params, distributions={n: dists[n] for n in params},
                                                          value=value))
            quantile = min(0.5, max(0.1, 3 / len(trials)))
            importances = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(target_quantile=quantile))
    finally:
        optuna.logging.set_verbosity(verbosity)
    if not any(v > 0 for v in importances.values()):
        return {}, "Optuna found no knob that sets the best trials apart (all importances 0)."
    return dict(sorted(importances.items(), key=lambda kv: -kv[1])), ""


def plot_importance(folder: SweepFolder) -> Figure:
    out = Figure(FIGURE_NAMES[1], "Knob importance (Optuna PED-ANOVA over the search trials)")
    importances, why = knob_importance(folder)
    if not importances:
        out.note = why
        return out
    names = list(importances)[::-1]  # matplotlib draws bottom-up: the most important on top
    fig, ax = _new_figure()
    ax.barh(names, [importances[n] for n in names], color="tab:purple")
    ax.set_xlabel("importance (normalised to sum 1)")
    ax.grid(axis="x", alpha=0.3)
    out.figure, out.png = fig, _png(fig)
    out.data = {"importances": importances}
    out.caption = ("How much each swept knob sets the best trials (objective: tokens/s/GPU, 0 for failed or "
                   "over-budget trials) apart from the rest. Most important: " + next(iter(importances)) + ".")
    return out


def _predicted_memory_gib(predicted: dict[str, Any]) -> float | None:
    for key, scale in (("predicted_peak_memory_gib", 1.0), ("predicted_peak_memory_gb", 1.0),
                       ("predicted_peak_memory_bytes", 1 / GiB)):
        value = predicted.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            return float(value) * scale
    return None


def prediction_pairs(folder: SweepFolder) -> dict[str, tuple[list[float], list[float], list[int]]]:
    """(predicted, measured, trial numbers) for peak memory (GiB) and step time (s), from each
    ledger entry's `predicted` (absent on ledgers written before the sweep recorded it)."""
    pairs: dict[str, tuple[list[float], list[float], list[int]]] = {"memory": ([], [], []), "step_time": ([], [], [])}
    for e in folder.entries:
        predicted = getattr(e, "predicted", None)
        if not isinstance(predicted, dict) or not predicted:
            continue
        r = e.result
        memory = _predicted_memory_gib(predicted)
        if memory and r.ok and peak_bytes(r):
            for target, value in zip(pairs["memory"], (memory, peak_bytes(r) / GiB, e.number)):
                target.append(value)
        step = predicted.get("predicted_step_time_s")
        if isinstance(step, (int, float)) and step > 0 and r.step_time_median_s and (r.ok or r.stopped_early):
            for target, value in zip(pairs["step_time"], (float(step), r.step_time_median_s, e.number)):
                target.append(value)
    return pairs


def plot_predicted(folder: SweepFolder) -> Figure:
    out = Figure(FIGURE_NAMES[2], "Predicted against measured")
    pairs = prediction_pairs(folder)
    if not any(p[0] for p in pairs.values()):
        out.note = "No predictions recorded: the ledger entries carry no `predicted` figures."
        return out
    fig, axes = _new_figure(2)
    captions = []
    for ax, (what, unit) in zip(axes, (("memory", "peak memory per rank, GiB"), ("step_time", "step time, s"))):
        predicted, measured, numbers = (np.array(v, float) for v in pairs[what])
        ax.set_title(unit, fontsize=10)
        if not len(predicted):
            ax.text(0.5, 0.5, "no predictions recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        error = float(np.median(np.abs(predicted / measured - 1)))
        low = min(predicted.min(), measured.min()) * 0.8
        high = max(predicted.max(), measured.max()) * 1.25
        line = np.geomspace(low, high, 50)
        ax.fill_between(line, line * max(1 - error, 0.0), line * (1 + error), color="tab:blue", alpha=0.15,
                        label=f"± median |error| {error:.0%}")
        ax.plot(line, line, color="0.3", lw=1, label="y = x")
        ax.scatter(measured, predicted, s=30, color="tab:blue", zorder=3)
        for m, p, n in zip(measured, predicted, numbers):
            ax.annotate(f"#{int(n)}", (m, p), textcoords="offset points", xytext=(4, 3), fontsize=7, color="0.3")
        if high / low > 20:  # plans far apart: log axes
            _log_axis(ax.xaxis, ax)
            _log_axis(ax.yaxis, ax)
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
        out.data[what] = {"predicted": predicted, "measured": measured, "median_abs_error": error}
        captions.append(f"{what.replace('_', ' ')}: median |predicted/measured - 1| {error:.1%} over {len(predicted)} trial(s)")
    out.figure, out.png = fig, _png(fig)
    out.caption = "; ".join(captions) + "."
    return out


def plot_time_split(folder: SweepFolder) -> Figure:
    out = Figure(FIGURE_NAMES[3], "Where each trial's time went")
    if not folder.entries:
        out.note = "The ledger holds no trials."
        return out
    launch = np.array([e.result.launch_s or 0.0 for e in folder.entries])
    measured = np.array([sum(e.result.step_times_s) for e in folder.entries])
    wall = np.array([e.result.wall_s or 0.0 for e in folder.entries])
    other = np.maximum(0.0, wall - launch - measured)
    labels = [f"#{e.number}" + ("r" if e.phase == "remeasure" else "") for e in folder.entries]
    fig, ax = _new_figure()
    x = np.arange(len(labels))
    ax.bar(x, launch, color="tab:orange", label="launch (start to first step)")
    ax.bar(x, measured, bottom=launch, color="tab:blue", label="measured steps")
    ax.bar(x, other, bottom=launch + measured, color="tab:gray", label="other (warm-up, memory/profiled steps, teardown)")
    for i, e in enumerate(folder.entries):
        if not (e.result.ok or e.result.stopped_early):
            ax.annotate("failed" if e.result.reason is None else str(e.result.reason), (i, launch[i] + measured[i] + other[i]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7, rotation=90, color="tab:red")
    ax.set_xticks(x, labels, rotation=90 if len(labels) > 16 else 0, fontsize=8)
    ax.set_xlabel("trial (r: re-measure)")
    ax.set_ylabel("seconds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncols=3, frameon=False)  # above the bars
    out.figure, out.png = fig, _png(fig)
    out.data = {"launch_s": launch, "measured_s": measured, "other_s": other, "labels": labels}
    total = wall.sum()
    out.caption = (f"{total:.0f} s in trials: {launch.sum():.0f} s launching, {measured.sum():.0f} s measured steps, "
                   f"{other.sum():.0f} s other." if total else "No trial recorded its wall time.")
    return out


def _floats(values: Any) -> list[float]:
    """A loss list from JSON: null (inf/NaN when written) becomes NaN, a gap in the line."""
    if not isinstance(values, list):
        return []
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]


def plot_losses(folder: SweepFolder, rows: list[Row]) -> Figure:
    out = Figure(FIGURE_NAMES[4], "Loss curves against the single-process reference")
    curves: list[tuple[str, list[float], list[float] | None]] = []
    for check in folder.parity:
        losses = _floats(check.get("losses"))
        if any(math.isfinite(v) for v in losses):
            mark = "passed" if check.get("passed") else "failed"
            diff = check.get("max_abs_loss_diff")
            name = f"{check.get('label', '?')} ({mark}" + (f", max |Δ| {diff:.1e}" if isinstance(diff, (int, float)) else "") + \
                ("; on a proxy model" if check.get("proxy") else "") + ")"
            curves.append((name, losses, _floats(check.get("reference_losses")) or None))
    if curves:
        out.caption = f"{len(curves)} plan(s) checked for loss parity; dashed: the single-process reference on the same batches."
    else:
        by_key = {e.key: e.result for e in folder.entries if e.result.ok and e.result.losses}
        for row in [r for r in rows if r.key in by_key][:TOP_LOSS_PLANS]:
            curves.append((row.label, by_key[row.key].losses, None))
        out.caption = ("No reference recorded (no parity.json): the top plans' own curves, warm-up steps included."
                       if not folder.parity_recorded else "parity.json holds no loss curves: the top plans' own curves.")
    if not curves:
        out.note = "No trial recorded losses."
        return out
    fig, ax = _new_figure()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for i, (name, losses, reference) in enumerate(curves):
        color = colors[i % len(colors)]
        # Thinner on top: curves that coincide (plans that train alike) all stay visible.
        ax.plot(np.arange(1, len(losses) + 1), losses, color=color, marker=".", lw=max(3.5 - 1.2 * i, 0.8),
                markersize=max(9 - 3 * i, 3), label=name)
        if reference:
            ax.plot(np.arange(1, len(reference) + 1), reference, color=color, ls="--", lw=1)
    if any(ref for _, _, ref in curves):
        ax.plot([], [], color="0.3", ls="--", lw=1, label="single-process reference")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    out.figure, out.png = fig, _png(fig)
    out.data = {"curves": curves}
    return out


# --------------------------------------------------------------------------- the page
@dataclass
class SweepReportPage:
    """The report as built: what report.html shows, and where its files went."""

    html_path: Path
    rows: list[Row]
    figures: list[Figure]
    png_paths: list[Path]


VERDICT_TEXT = {"winner": "winner", "tied": "tied with best", "slower": "slower", "best": "best (no winner)",
                "parity_failed": "failed loss parity", "stopped_early": "stopped early", "failed": "failed",
                "not_scored": "not scored"}

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr.winner{background:#e6f4e6}
tr.failed,tr.parity_failed{color:#a00}tr.stopped_early{color:#a60}p.note{color:#666;font-style:italic}
img{max-width:100%;height:auto}"""


def _num(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _rows_html(rows: list[Row]) -> str:
    head = ("<tr><th>#</th><th>plan</th><th>tokens/s/GPU (median)</th><th>noise band</th><th>measured range</th>"
            "<th>runs</th><th>step spread</th><th>peak MiB/rank</th><th>verdict</th></tr>")
    body = []
    for i, r in enumerate(rows, 1):
        data = (f' data-key="{html.escape(r.key)}" data-label="{html.escape(r.label)}" data-verdict="{r.verdict}"'
                f' data-median="{"" if r.median is None else repr(float(r.median))}" data-runs="{r.runs}"')
        band = f"{_num(r.band_low)} – {_num(r.band_high)}" if r.band_low is not None else "-"
        spread = f"{_num(r.lowest)} – {_num(r.highest)}" if r.runs > 1 else _num(r.lowest)
        verdict = VERDICT_TEXT.get(r.verdict, r.verdict) + (f": {r.detail}" if r.detail else "")
        body.append(f'<tr class="{r.verdict}"{data}><td class="num">{i}</td><td>{html.escape(r.label)}</td>'
                    f'<td class="num">{_num(r.median)}</td><td class="num">{band}</td><td class="num">{spread}</td>'
                    f'<td class="num">{r.runs}</td><td class="num">{_num(r.step_time_spread, ".0%")}</td>'
                    f'<td class="num">{_num(r.peak_memory_bytes / 2**20 if r.peak_memory_bytes else None, ",.1f")}</td>'
                    f"<td>{html.escape(verdict)}</td></tr>")
    return f'<table id="leaderboard">{head}{"".join(body)}</table>'


def _figure_html(fig: Figure) -> str:
    parts = [f'<section id="{fig.name.removesuffix(".png")}"><h2>{html.escape(fig.title)}</h2>']
    if fig.png:
        data = base64.b64encode(fig.png).decode("ascii")
        parts.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(fig.title)}" '
                     f'width="{FIGURE_PIXELS[0]}" height="{FIGURE_PIXELS[1]}">')
    if fig.caption and fig.png:
        parts.append(f"<p>{html.escape(fig.caption)}</p>")
    if fig.note:
        parts.append(f'<p class="note">{html.escape(fig.note)}</p>')
    return "".join(parts) + "</section>"


def _header_html(folder: SweepFolder, rows: list[Row]) -> str:
    search = sum(1 for e in folder.entries if e.phase == "search")
    remeasure = len(folder.entries) - search
    name = (folder.winner_summary or {}).get("sweep") or folder.path.name
    facts = [f"{search} search trial(s), {remeasure} re-measurement(s), {len(rows)} plan(s)"]
    if folder.state.get("algorithm"):
        facts.append(f"search: {folder.state['algorithm']} (seed {folder.state.get('seed')})")
    if folder.state.get("parent_run_id"):
        facts.append(f"MLflow parent run {folder.state['parent_run_id']}")
    if folder.stop_reason:
        facts.append(f"search stopped: {folder.stop_reason}")
    winner = next((r for r in rows if r.verdict == "winner"), None)
    if winner is not None:
        parity = (folder.winner_summary or {}).get("parity_max_abs_loss_diff")
        verdict = (f"<p><b>Winner: {html.escape(winner.label)}</b> — {_num(winner.median)} tokens/s/GPU"
                   + (f", loss parity max |Δ| {parity:.1e}" if isinstance(parity, (int, float)) else "") + "</p>")
    else:
        verdict = "<p><b>No winner</b>: no plan was exported to winner/ (none finished and passed loss parity, or the sweep did not finish).</p>"
    return (f"<h1>paratune sweep: {html.escape(str(name))}</h1>"
            + "".join(f"<p>{html.escape(f)}</p>" for f in facts) + verdict)


def build_report(sweep_dir: Path, memory_budget_gb: float | None = None) -> SweepReportPage:
    """Read the sweep, draw every figure, write report/report.html and its PNGs; returns all of it."""
    # Figures are drawn on matplotlib.figure.Figure with the Agg canvas (_png), never through
    # pyplot: no display needed on a cluster head, and no global backend switched under a caller.
    folder = read_sweep(Path(sweep_dir), memory_budget_gb)
    rows = leaderboard(folder)
    figures = [plot_throughput_memory(folder), plot_importance(folder), plot_predicted(folder),
               plot_time_split(folder), plot_losses(folder, rows)]
    out_dir = Path(sweep_dir) / REPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    for fig in figures:
        path = out_dir / fig.name
        if fig.png:
            path.write_bytes(fig.png)
            pngs.append(path)
        else:
            path.unlink(missing_ok=True)  # a figure of an earlier report that has no data now
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>paratune sweep report</title>"
            f"<style>{_CSS}</style></head><body>{_header_html(folder, rows)}"
            "<h2>Leaderboard</h2><p>Median tokens/s/GPU over every full measurement of a plan (search and "
            "re-measure); the noise band is median ± the half-width the verdict judges ties with (the larger of "
            "the step-time spread and the across-run range).</p>"
            + (_rows_html(rows) if rows else '<p class="note">The ledger holds no trials.</p>')
            + "".join(_figure_html(f) for f in figures) + "</body></html>")
    html_path = out_dir / HTML_NAME
    html_path.write_text(page)
    return SweepReportPage(html_path, rows, figures, pngs)


def write_sweep_report(sweep_dir: Path, memory_budget_gb: float | None = None) -> Path:
    """Write sweep_dir/report/report.html (self-contained) and its PNGs beside it; returns the HTML's path.
    memory_budget_gb: the space's objective.memory_budget_gb when sweep.json does not record it."""
    return build_report(sweep_dir, memory_budget_gb).html_path


def report_files(sweep_dir: Path) -> list[Path]:
    """The PNGs of the last report written for this sweep (to log as MLflow artifacts), page order."""
    out_dir = Path(sweep_dir) / REPORT_DIR
    return [out_dir / name for name in FIGURE_NAMES if (out_dir / name).exists()]
