"""A finished sweep's folder read back: its records and the leaderboard they make.

The records are ledger.jsonl, sweep.json, winner/ and parity.json, read tolerantly (a sweep may
be unfinished or resumed) and from the folder alone, so `paratune report SWEEP_DIR` can rebuild
the page any time. No Ray (paratune.sweep.ledger has none).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratune.sweep.ledger import Ledger, LedgerEntry, unscored
from paratune.out.tables import env_label, strategy_label
from paratune.trial.results import TrialResult
from paratune.sweep.verdict import Standing, decide


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
    """The sweep folder's records. The ledger is read with paratune.sweep.ledger.Ledger (a line cut by a
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
    the ok results, exactly as paratune.sweep.finish builds them; the winner is the one exported to
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
