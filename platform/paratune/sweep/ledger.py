"""The sweep's record: the ledger of finished trials, and how each trial is scored (no Ray here).

Every finished trial is appended to the ledger (one JSON line, flushed) before anything else
happens, so an interrupted sweep resumes without losing or re-running a finished trial, and the
ledger warm-starts the searcher. A failed trial scores 0 tokens/s so the searcher learns from it.
A trial the cluster failed (failures.CLUSTER_REASONS) is recorded but never scored, and
`--resume` measures its plan again. Imported by the page (paratune report) too: nothing here
may import Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from paratune.trial.failures import CLUSTER_REASONS
from paratune.costs.measure import TrialStopRule
from paratune.config.plan import load_plan_dict
from paratune.sweep.stopping import Incumbent
from paratune.trial.results import TrialResult

OBJECTIVE = "objective"


class SweepError(RuntimeError):
    """A sweep that cannot start (its folder belongs to another space, or already has trials)."""


# --------------------------------------------------------------------------- points
def point_key(choices: dict[str, Any], env: dict[str, str]) -> str:
    """The ledger's key of one point: its structural choices and its env, as sorted JSON."""
    return json.dumps({"choices": choices, "env": env}, sort_keys=True, default=str)


def candidate_key(point: str) -> str:
    """The structural candidate a point belongs to (its choices, env aside; Candidate.key)."""
    return json.dumps(json.loads(point)["choices"], sort_keys=True, default=str)


# --------------------------------------------------------------------------- ledger
@dataclass
class LedgerEntry:
    number: int
    key: str
    result: TrialResult
    phase: str = "search"
    # What the cost model predicted for this trial before it ran (predicted_* and *_prediction_error,
    # as logged to MLflow), for the sweep report; empty when the sweep predicted nothing.
    predicted: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "key": self.key, "phase": self.phase,
                           "result": self.result.model_dump(), "predicted": self.predicted})

    @classmethod
    def from_json(cls, line: str) -> "LedgerEntry":
        d = json.loads(line)
        return cls(d["number"], d["key"], TrialResult.model_validate(d["result"]), d["phase"],
                   dict(d.get("predicted") or {}))  # ledgers written before it have none


class Ledger:
    """Append-only record of finished trials (one JSON line each, flushed as it happens)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: list[LedgerEntry] = []
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    try:
                        self.entries.append(LedgerEntry.from_json(line))
                    except (json.JSONDecodeError, KeyError):
                        pass  # a line cut by a crash mid-write: that trial was not finished

    def append(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)
        with self.path.open("a") as f:
            f.write(entry.to_json() + "\n")
            f.flush()

    def search_entries(self) -> list[LedgerEntry]:
        return [e for e in self.entries if e.phase == "search"]

    def keys(self) -> set[str]:
        """Points measured (failed included) and not to be run again: a trial the cluster failed
        (failures.CLUSTER_REASONS) says nothing about its plan, so a resumed sweep re-runs it."""
        return {e.key for e in self.search_entries() if not unscored(e.result)}


def unscored(result: TrialResult) -> bool:
    """A trial the cluster failed, not its plan: recorded, never scored."""
    return result.status == "failed" and result.reason in CLUSTER_REASONS


def objective_value(result: TrialResult, memory_budget_gb: float | None) -> float:
    """tokens/s/GPU, or 0 for a failed or over-budget trial (so the searcher learns to avoid it).
    A trial stopped early scores what its measured steps reached: a real figure below the
    incumbent, not a failure."""
    result = apply_budget(result, memory_budget_gb)
    usable = result.ok or result.stopped_early
    return float(result.tokens_per_s_per_gpu) if usable and result.tokens_per_s_per_gpu else 0.0


def incumbent_of(results: dict[str, TrialResult], memory_budget_gb: float | None) -> Incumbent | None:
    """The best fully measured plan (stopped-early and failed trials never are)."""
    full = {k: apply_budget(r, memory_budget_gb) for k, r in results.items()}
    full = {k: r for k, r in full.items() if r.ok and r.tokens_per_s_per_gpu}
    if not full:
        return None
    key = max(full, key=lambda k: full[k].tokens_per_s_per_gpu)
    return Incumbent(key, float(full[key].tokens_per_s_per_gpu), float(full[key].step_time_spread or 0.0))


def stop_rule_for(incumbent: Incumbent | None, min_steps: int) -> dict[str, Any] | None:
    """What a trial launched now is stopped against (measure.TrialStopRule as a dict), if anything."""
    if incumbent is None:
        return None
    return TrialStopRule(incumbent.tokens_per_s_per_gpu, incumbent.spread, min_steps)._asdict()


def apply_budget(result: TrialResult, memory_budget_gb: float | None) -> TrialResult:
    """A plan measured above the memory budget is a failed trial with reason oom (over budget)."""
    if result.ok and memory_budget_gb and result.peak_memory_bytes and \
            max(result.peak_memory_bytes) > memory_budget_gb * 2**30:
        peak = max(result.peak_memory_bytes) / 2**30
        return result.model_copy(update={"status": "failed", "reason": "oom",
                                         "message": f"over budget: peak {peak:.2f} GiB > memory_budget_gb {memory_budget_gb}"})
    return result


def predicted_only(metrics: dict[str, float]) -> dict[str, float]:
    """The predictions among a trial's extra metrics (predicted_*, *_prediction_error): what the
    ledger keeps beside the measurement, without the model's fitted constants."""
    return {k: float(v) for k, v in metrics.items()
            if (k.startswith("predicted_") or k.endswith("_prediction_error")) and isinstance(v, (int, float))}


def observe_calibration(calibration, result: TrialResult) -> dict[str, float]:
    """Predicted beside measured for one trial (and a refit of the time model). A trial over the
    memory budget (apply_budget: failed, oom) measured its peak too: predicted beside it as well."""
    if calibration is None:
        return {}
    plan = load_plan_dict(result.plan)
    measured = result.ok or (result.status == "failed" and result.reason == "oom")
    peak = max(result.peak_memory_bytes) if measured and result.peak_memory_bytes else None
    return calibration.observe(plan, peak, result.step_time_median_s if result.ok else None,
                               routing_balance=result.routing_balance if result.ok else None)


def log_trial_or_say(tracker, parent: str, number: int, result: TrialResult, console: Console,
                     phase: str = "search", extra_metrics: dict[str, float] | None = None) -> None:
    """Log a trial to MLflow, or say why not and go on. The ledger is the sweep's record and MLflow
    its view: a tracking server down past MLflow's own retries must not end a sweep of hours. The
    trial is logged when the sweep ends (sync_ledger), or by `--resume`."""
    try:
        tracker.log_trial(parent, number, result, phase=phase, extra_metrics=extra_metrics)
    except Exception as err:  # noqa: BLE001 - see the docstring
        console.print(f"[yellow]MLflow: {phase} trial {number} not logged ({type(err).__name__}: "
                      f"{escape(str(err))[:300]}); it is in the ledger, and is logged when the sweep ends "
                      "or on --resume[/yellow]", soft_wrap=True)
