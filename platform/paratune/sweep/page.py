"""A finished sweep as one HTML page: the leaderboard and the figures that explain it.

The page is built from the sweep folder alone (ledger.jsonl, sweep.json, winner/, parity.json, and
compare.json where `paratune plan --compare --out` wrote one:
paratune.sweep.folder), so `paratune report SWEEP_DIR` can rebuild it any time, a resumed sweep
included. Every image is embedded as a base64 data URI so report.html still works when moved or
mailed; the same PNGs are written beside it so they can be logged to MLflow as artifacts one by
one. Imports no Ray: `paratune report` must not load Ray Tune.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

from paratune.sweep.figures import (FIGURE_NAMES, FIGURE_PIXELS, Figure, plot_compare, plot_importance, plot_losses,
                                    plot_predicted, plot_throughput_memory, plot_time_split)
from paratune.sweep.folder import Row, SweepFolder, leaderboard, read_sweep
from paratune.out.tables import strategy_label

REPORT_DIR = "report"
HTML_NAME = "report.html"


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


def _experts_html(folder: SweepFolder) -> str:
    """Mixture-of-experts trials: each one's routing balance (busiest expert / mean, worst MoE
    layer and every layer's) and all-to-all share beside its communication share. Empty for
    sweeps without routed experts."""
    moe = [e for e in folder.entries if e.result.ok and e.result.routing_balance is not None]
    if not moe:
        return ""
    head = ("<tr><th>trial</th><th>plan</th><th>routing balance (worst layer)</th><th>per MoE layer</th>"
            "<th>comm share</th><th>all-to-all share</th></tr>")
    body = []
    for e in moe:
        r = e.result
        layers = ", ".join(_num(b, ".2f") for b in r.routing_balance_per_layer)
        body.append(f'<tr><td class="num">{e.number}</td><td>{html.escape(strategy_label(r.plan))}</td>'
                    f'<td class="num">{_num(r.routing_balance, ".2f")}</td><td>{html.escape(layers)}</td>'
                    f'<td class="num">{_num(r.comm_share, ".1%")}</td>'
                    f'<td class="num">{_num(r.all_to_all_share, ".1%")}</td></tr>')
    return ('<h2>Experts</h2><p>Routing balance: the busiest expert\'s routed tokens over the mean, per MoE layer, '
            "over the measured steps and all ranks (1.00: perfectly balanced). All-to-all share: the part of the "
            "profiled step with expert parallelism's all-to-all in flight.</p>"
            f'<table id="experts">{head}{"".join(body)}</table>')


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
               plot_time_split(folder), plot_losses(folder, rows), plot_compare(folder)]
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
            + _experts_html(folder)
            + "".join(_figure_html(f) for f in figures if f.png or f.note)  # compare.png: only with compare.json
            + "</body></html>")
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
