"""The sweep report's figures, each drawn from the sweep folder as a PNG of one fixed size.

Drawn on matplotlib.figure.Figure with the Agg canvas, never through pyplot: no display needed
on a cluster head, and no global backend switched under a caller.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paratune.sweep.folder import Row, SweepFolder, peak_bytes
from paratune.sweep.ledger import objective_value, unscored

# Every figure has this size so the page lays out the same for any sweep (and a test can check it).
FIGSIZE_IN = (9.0, 4.8)
DPI = 100
FIGURE_PIXELS = (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
# The PNG names, in page order; a figure not drawn this time (no data) leaves no file behind.
FIGURE_NAMES = ("throughput_memory.png", "importance.png", "predicted.png", "time_split.png", "losses.png",
                "compare.png")
MIN_IMPORTANCE_TRIALS = 5  # fewer scored trials say nothing about which knob matters
TOP_LOSS_PLANS = 3
GiB = 2**30


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
    out, failed and over-budget trials worth 0 (paratune.sweep.ledger.objective_value).

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
    """(predicted, measured, trial numbers) for peak memory (GiB: the trials that ran and those
    measured over the memory budget) and step time (s), from each ledger entry's `predicted`
    (absent on ledgers written before the sweep recorded it)."""
    pairs: dict[str, tuple[list[float], list[float], list[int]]] = {"memory": ([], [], []), "step_time": ([], [], [])}
    for e in folder.entries:
        predicted = getattr(e, "predicted", None)
        if not isinstance(predicted, dict) or not predicted:
            continue
        r = e.result
        memory = _predicted_memory_gib(predicted)
        # a trial measured over the memory budget (oom) kept its peak: the miss a sweep learns from
        if memory and (r.ok or r.reason == "oom") and peak_bytes(r):
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
    compiled = np.array([e.result.compile_s or 0.0 for e in folder.entries])  # in the warm-up, never measured
    other = np.maximum(0.0, wall - launch - compiled - measured)
    labels = [f"#{e.number}" + ("r" if e.phase == "remeasure" else "") for e in folder.entries]
    fig, ax = _new_figure()
    x = np.arange(len(labels))
    ax.bar(x, launch, color="tab:orange", label="launch (start to first step)")
    if compiled.any():
        ax.bar(x, compiled, bottom=launch, color="tab:purple", label="compiling blocks (first warm-up step)")
    ax.bar(x, measured, bottom=launch + compiled, color="tab:blue", label="measured steps")
    ax.bar(x, other, bottom=launch + compiled + measured, color="tab:gray",
           label="other (warm-up, memory/profiled steps, teardown)")
    for i, e in enumerate(folder.entries):
        if not (e.result.ok or e.result.stopped_early):
            ax.annotate("failed" if e.result.reason is None else str(e.result.reason),
                        (i, launch[i] + compiled[i] + measured[i] + other[i]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7, rotation=90, color="tab:red")
    ax.set_xticks(x, labels, rotation=90 if len(labels) > 16 else 0, fontsize=8)
    ax.set_xlabel("trial (r: re-measure)")
    ax.set_ylabel("seconds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncols=3, frameon=False)  # above the bars
    out.figure, out.png = fig, _png(fig)
    out.data = {"launch_s": launch, "compile_s": compiled, "measured_s": measured, "other_s": other, "labels": labels}
    total = wall.sum()
    compiling = f"{compiled.sum():.0f} s compiling blocks, " if compiled.any() else ""
    out.caption = (f"{total:.0f} s in trials: {launch.sum():.0f} s launching, {compiling}{measured.sum():.0f} s measured steps, "
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


# Where a point's label may go, in order of preference: (dx, dy) in points, horizontal alignment.
_LABEL_SPOTS = ((8, 5, "left"), (8, -15, "left"), (-8, 5, "right"), (-8, -15, "right"), (0, 12, "center"),
                (0, -24, "center"), (8, 18, "left"), (8, -28, "left"), (-8, 18, "right"), (-8, -28, "right"))


def _place_labels(fig, ax, x: np.ndarray, y: np.ndarray, texts: list[str], fontsize: float) -> None:
    """Annotate each point with its text where it covers no marker, no other label and stays inside
    the axes (the first free spot of _LABEL_SPOTS, else the least covered), in order: the first
    points get the nearest spots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # the layout, so data -> pixels is final
    px = fig.dpi / 72.0
    points = ax.transData.transform(np.column_stack([x, y]))
    frame = ax.get_window_extent()
    markers = [(px_ - 11, py_ - 11, px_ + 11, py_ + 11) for px_, py_ in points]
    labels: list[tuple[float, float, float, float]] = []

    def box(i: int, spot) -> tuple[float, float, float, float]:
        dx, dy, align = spot
        w, h = len(texts[i]) * fontsize * 0.58 * px, fontsize * 1.25 * px
        left = points[i][0] + dx * px - {"left": 0.0, "right": w, "center": w / 2}[align]
        bottom = points[i][1] + dy * px - (h if dy < 0 else 0.0)
        return left, bottom, left + w, bottom + h

    def covered(i: int, b) -> float:
        others = [m for j, m in enumerate(markers) if j != i] + labels
        area = sum(max(0.0, min(b[2], t[2]) - max(b[0], t[0])) * max(0.0, min(b[3], t[3]) - max(b[1], t[1]))
                   for t in others)
        outside = (b[0] < frame.x0) + (b[2] > frame.x1) + (b[1] < frame.y0) + (b[3] > frame.y1)
        return area + 1e6 * outside

    for i, text in enumerate(texts):
        spot = min(_LABEL_SPOTS, key=lambda s: (covered(i, box(i, s)) > 0, covered(i, box(i, s)),
                                                _LABEL_SPOTS.index(s)))
        labels.append(box(i, spot))
        far = _LABEL_SPOTS.index(spot) >= 4  # a leader line says whose label it is
        ax.annotate(text, (x[i], y[i]), textcoords="offset points", xytext=spot[:2], ha=spot[2],
                    va="top" if spot[1] < 0 else "bottom", fontsize=fontsize, color="0.15", zorder=5,
                    arrowprops={"arrowstyle": "-", "color": "0.45", "lw": 0.7, "shrinkB": 6} if far else None)


def plot_clusters(rows: list, tokens: float, currency: str | None = None, title: str = "") -> Figure:
    """Time to train against cost, one point per cluster (paratune.costs.compare.Row; GPU-hours where no
    prices were given), the band as error bars, the time-versus-cost Pareto front as a staircase."""
    from paratune.costs.compare import tokens_label

    out = Figure(FIGURE_NAMES[5], title or f"Time to train {tokens_label(tokens)} tokens against its cost, per cluster")
    shown = [r for r in rows if r.hours is not None and (r.cost is not None or currency is None)]
    missing = [r.outcome.cluster.label for r in rows if r not in shown]
    if not shown:
        out.note = "No cluster fits a plan: nothing to draw."
        return out
    days = max(r.hours for r in shown) >= 48
    unit, scale = ("days", 1 / 24) if days else ("hours", 1.0)
    y = np.array([r.hours * scale for r in shown])
    y_low, y_high = np.array([r.hours_low * scale for r in shown]), np.array([r.hours_high * scale for r in shown])
    x = np.array([r.cost if currency else r.gpu_hours for r in shown], float)
    x_low, x_high = x * y_low / y, x * y_high / y  # the cost follows the time (same GPUs, same price)
    front = np.array([r.pareto for r in shown])
    devices = list(dict.fromkeys(r.outcome.cluster.device for r in shown))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    markers = {"predicted": "o", "measured": "*", "scaled": "D"}
    fig, ax = _new_figure()
    for i, r in enumerate(shown):
        color = palette[devices.index(r.outcome.cluster.device) % len(palette)]
        ax.errorbar(x[i], y[i], xerr=[[x[i] - x_low[i]], [x_high[i] - x[i]]],
                    yerr=[[y[i] - y_low[i]], [y_high[i] - y[i]]], color=color, alpha=0.35, lw=1, capsize=3, zorder=2)
        ax.scatter(x[i], y[i], color=color, marker=markers.get(r.outcome.source, "o"),
                   s=160 if r.outcome.source == "measured" else 60, zorder=4, edgecolors="black", linewidths=0.6)
    order = np.argsort(x[front])
    ax.plot(x[front][order], y[front][order], drawstyle="steps-post", color="tab:green", lw=1.6, zorder=3,
            label="Pareto front (no cluster both faster and cheaper)")
    ax.scatter(x[front], y[front], s=260, facecolors="none", edgecolors="tab:green", linewidths=1.6, zorder=3)
    for name, color in zip(devices, palette):
        ax.scatter([], [], color=color, s=40, label=name)
    for source in sorted({r.outcome.source for r in shown} - {"predicted"}):
        ax.scatter([], [], color="0.5", marker=markers[source], s=60, label=f"{source} (a sweep's winner)"
                   if source == "measured" else "scaled by the device's measured / predicted")
    if max(x_high.max() / x_low.min(), y_high.max() / y_low.min()) > 20:
        _log_axis(ax.xaxis, ax)
        _log_axis(ax.yaxis, ax)
    ax.margins(0.15)
    ax.set_xlabel(f"cost to train, {currency}" if currency else "GPU-hours to train (no prices given)")
    ax.set_ylabel(f"time to train, {unit}")
    ax.set_title(out.title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    band = max((r.outcome.band for r in shown), default=0.0)
    ax.text(0.995, 0.01, f"bars: the prediction's band (± {band:.0%} on tokens/s/GPU)", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=7.5, color="0.4")
    _place_labels(fig, ax, x, y, [r.outcome.cluster.label + (" (fastest)" if r.fastest else " (tie with fastest)"
                                                             if r.tie_with_fastest else "") for r in shown], 8.5)
    out.figure, out.png = fig, _png(fig)
    out.data = {"labels": [r.outcome.cluster.label for r in shown], "time": y, "spend": x, "pareto": front,
                "sources": [r.outcome.source for r in shown]}
    out.caption = (f"{len(shown)} cluster(s); {int(front.sum())} on the Pareto front; error bars: the prediction's "
                   f"band (± {band:.0%} on tokens/s/GPU)" + (f"; not drawn (nothing fits, or no price): "
                                                             f"{', '.join(missing)}" if missing else "") + ".")
    return out


def plot_compare(folder: SweepFolder) -> Figure:
    """`paratune plan --compare --out SWEEP_DIR` left compare.json in the sweep folder: its clusters,
    the sweep's measured winner in place of its own cluster's prediction and the same device's other
    clusters scaled by measured / predicted (paratune.costs.compare.with_measured). No compare.json: no
    figure and no note (the page shows nothing)."""
    from paratune.costs.compare import from_document, rank, with_measured

    data = None
    try:
        data = json.loads((folder.path / "compare.json").read_text())
        outcomes, tokens, prices = from_document(data)
    except (OSError, ValueError, KeyError, TypeError):
        if data is not None:
            return Figure(FIGURE_NAMES[5], "Time and cost to train, per cluster", note="compare.json is unreadable.")
        return Figure(FIGURE_NAMES[5], "Time and cost to train, per cluster")
    device = folder.state.get("device")
    gpus = (folder.winner_plan or {}).get("num_workers")
    measured = (folder.winner_summary or {}).get("tokens_per_s_per_gpu_median")
    ratio = None
    if device and gpus and measured:
        outcomes, ratio = with_measured(outcomes, device, int(gpus), float(measured), folder.winner_summary.get("label"))
    out = plot_clusters(rank(outcomes, tokens, prices), tokens, prices.currency if prices else None,
                        "Time and cost to train, per cluster")
    if ratio is None:
        why = (f"the sweep ran on {gpus} x {device}, not one of these clusters" if device and gpus else
               "the sweep has no winner or did not record its device")
        out.caption += f" All predicted ({why})."
    else:
        out.caption += (f" {device}:{gpus}: the sweep's measured winner ({measured:,.0f} tokens/s/GPU); the other "
                        f"{device} clusters: predicted x {ratio:.2f} (measured / predicted on {device}); other devices: "
                        "predicted.")
    return out
