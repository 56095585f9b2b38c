"""How a sweep ends: the top plans re-measured, the winner by noise and loss parity, exported, logged.

Then the page (paratune.sweep.page) is written and logged to the parent run. Nothing here
imports Ray Tune, so `paratune report` (write_page) loads none of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from paratune.sweep.parity import winner_parity
from paratune.config.plan import load_plan_dict
from paratune.sweep.space import Space
from paratune.sweep.cluster import measure_plan
from paratune.sweep.ledger import Ledger, LedgerEntry, apply_budget, log_trial_or_say
from paratune.out.tables import strategy_label


@dataclass
class SweepOutcome:
    """What run_sweep returns: the ledger's trials, the verdict, the winner and how the sweep went."""

    out_dir: Path
    parent_run_id: str
    entries: list[LedgerEntry]
    verdict: Any = None
    winner_dir: Path | None = None
    winner_parity: float | None = None  # the winner's max |loss - reference|
    # Plans passed over because their loss-parity check failed: label, key and why.
    parity_failures: list[dict[str, str]] = field(default_factory=list)
    time_split: dict[str, float] = field(default_factory=dict)
    pruning: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)  # the cost model's errors and constants
    stop_reason: str = ""  # why the calibrated search stopped measuring (its stated rule)
    # The step-time model's out-of-sample errors (each trial predicted before it ran).
    time_model: dict[str, Any] = field(default_factory=dict)
    # Every loss-parity check run at the end (parity.json): label, key, passed, losses compared.
    parity_checks: list[dict[str, Any]] = field(default_factory=list)
    report_path: Path | None = None  # report/report.html (paratune.sweep.page), when it could be written




def finish_sweep(space: Space, outcome: SweepOutcome, ledger: Ledger, tracker, budget_gb: float | None,
                 console: Console, calibration=None, pool: str | None = None) -> None:
    """Re-measure the top plans side by side, decide with the noise, check parity, export."""
    from paratune.out.export import export_winner
    from paratune.sweep.verdict import Standing, complexity, decide

    settings = space.spec.search
    standings: dict[str, Standing] = {}
    for e in ledger.entries:
        if e.result.ok:
            s = standings.setdefault(e.key, Standing(e.key, strategy_label(e.result.plan), e.result.plan))
            s.results.append(e.result)
    top = sorted(standings.values(), key=lambda s: -s.median)[: settings.top_k]
    rounds_done = max((sum(1 for e in ledger.entries if e.phase == "remeasure" and e.key == s.key) for s in top), default=0)
    if len(top) > 1:
        for round_ in range(rounds_done, settings.remeasure_rounds):
            for s in top:  # interleaved: every plan once per round, so drift hits all alike
                result = apply_budget(measure_plan(s.plan, None, pool), budget_gb)
                number = len(ledger.entries) + 1
                ledger.append(LedgerEntry(number, s.key, result, "remeasure"))
                log_trial_or_say(tracker, outcome.parent_run_id, number, result, console, phase="remeasure")
                s.results.append(result)
                console.print(f"re-measure {round_ + 1}/{settings.remeasure_rounds} {s.label}: "
                              f"{result.tokens_per_s_per_gpu or 0:,.0f} tokens/s/GPU")
    verdict = decide(list(standings.values()))
    # A fast plan that trains wrong is never the winner: check parity, fall back down the ranking.
    # A check that cannot run is a failed check with its reason, never the end of the sweep.
    winner, parity = None, None
    order: list[Standing] = []
    for s in [verdict.winner, *sorted(verdict.tied_with_best, key=lambda t: complexity(t.plan)), *verdict.ranked]:
        if s is not None and s not in order:
            order.append(s)
    for candidate in order:
        check = winner_parity(candidate.plan, candidate.results[0])
        outcome.parity_checks.append(check.to_record(candidate.label, candidate.key))
        if check.passed:
            winner, parity = candidate, check
            if check.mode == "deterministic":
                console.print(f"loss parity of {escape(candidate.label)} judged with the model's random draws off on "
                              f"both sides ({escape(', '.join(check.switched_off))}); its measured steps kept them")
            if check.rounding_envelope is not None:  # a model that amplifies rounding: how its bound was made
                console.print(f"loss parity of {escape(candidate.label)}: {escape(check.reason)}")
            break
        outcome.parity_failures.append({"label": candidate.label, "key": candidate.key, "reason": check.reason})
        console.print(f"[red]{escape(candidate.label)} fails loss parity ({escape(check.reason)}); not a winner[/red]")
    verdict.winner = winner
    outcome.verdict = verdict
    # For the sweep report (paratune.sweep.page): every check, the losses it compared.
    (outcome.out_dir / "parity.json").write_text(json.dumps(outcome.parity_checks, indent=1) + "\n")
    outcome.winner_parity = parity.max_abs_loss_diff if parity is not None else None
    launch = sum(e.result.launch_s or 0 for e in ledger.entries)
    measured = sum(sum(e.result.step_times_s) for e in ledger.entries)
    wall = sum(e.result.wall_s or 0 for e in ledger.entries)
    compiled = sum(e.result.compile_s or 0 for e in ledger.entries)  # inside the warm-up, never measured
    outcome.time_split = {"trials_wall_s": wall, "launch_s": launch, "compile_s": compiled, "measured_s": measured,
                         "other_s": max(0.0, wall - launch - compiled - measured)}
    best_metrics: dict[str, float] = {}
    summary: dict[str, Any] | None = None
    if winner is not None:
        plan = load_plan_dict(winner.plan)
        summary = {"sweep": space.spec.name, "label": winner.label, "tokens_per_s_per_gpu_median": winner.median,
                   "relative_spread": winner.relative_spread, "measurements": len(winner.values),
                   "parity_max_abs_loss_diff": parity.max_abs_loss_diff, "parity_proxy": parity.proxy,
                   "parity_mode": parity.mode, "parity_switched_off": parity.switched_off,
                   "parity_bound": (parity.rounding_envelope or {}).get("how"),  # None: the fixed tolerance
                   "parity_failed_above": outcome.parity_failures,
                   "tied_with": [s.label for s in verdict.tied_with_best],
                   "mfu": winner.results[0].mfu, "peak_memory_bytes": winner.results[0].peak_memory_bytes}
        if winner.results[0].routing_balance is not None:  # a mixture-of-experts winner: how it routed
            summary.update(routing_balance=winner.results[0].routing_balance,
                           routing_balance_per_layer=winner.results[0].routing_balance_per_layer,
                           all_to_all_share=winner.results[0].all_to_all_share)
        outcome.winner_dir = out_dir_winner = outcome.out_dir / "winner"
        export_winner(plan, out_dir_winner, summary)
        # The child runs' names with best_ before them, so the parent lines up with its trials.
        first = winner.results[0]
        best_metrics = {"tokens_per_s_per_gpu": winner.median, "measurement_spread": winner.relative_spread,
                        "parity_max_abs_loss_diff": parity.max_abs_loss_diff,
                        **({"mfu": first.mfu} if first.mfu is not None else {}),
                        **({"step_time_spread": first.step_time_spread} if first.step_time_spread is not None else {}),
                        **({"peak_memory_gib": max(first.peak_memory_bytes) / 2**30} if first.peak_memory_bytes else {}),
                        **({"routing_balance": first.routing_balance} if first.routing_balance is not None else {}),
                        **({"all_to_all_share": first.all_to_all_share} if first.all_to_all_share is not None else {})}
    if calibration is not None:
        # the memory scales the launch risk learnt (paratune.costs.risk), set by the driver, kept
        outcome.calibration = {"device": calibration.device.name, **calibration.summary(), **outcome.calibration}
    from paratune.out.tracking import sweep_note

    note = sweep_note(summary, outcome.winner_dir, outcome.parity_failures)
    try:
        log_sweep_end(tracker, outcome, ledger, best_metrics, winner.plan if winner else None, note, console)
    except Exception as err:  # noqa: BLE001 - the results are on disk: MLflow down must not lose them
        console.print(f"[yellow]MLflow: the sweep's end is not logged ({type(err).__name__}: {escape(str(err))[:300]}); "
                      f"its results are in {outcome.out_dir}; the same command with `--resume` logs them[/yellow]",
                      soft_wrap=True)


def log_sweep_end(tracker, outcome: SweepOutcome, ledger: Ledger, best_metrics: dict[str, float],
                  winner: dict[str, Any] | None, note: str, console: Console) -> None:
    """The parent run's last writes: what MLflow missed of the ledger (the server was down, or a
    lost answer left a run half-written), parity failures, calibration, winner, status."""
    from mlflow.entities import Metric

    filled = tracker.sync_ledger(outcome.parent_run_id, ledger.entries)
    if filled:
        console.print(f"logged {filled} trial(s) to MLflow that it missed during the sweep")
    if outcome.parity_failures:
        tracker.client.set_tag(outcome.parent_run_id, "paratune.parity_failures",
                               "\n".join(f"{f['label']}: {f['reason']}" for f in outcome.parity_failures)[:5000])
    if outcome.calibration:
        tracker.client.log_batch(outcome.parent_run_id, metrics=[
            Metric(f"calibration_{k}", float(v), 0, 0) for k, v in outcome.calibration.items() if isinstance(v, float)])
    tracker.finish_parent(outcome.parent_run_id, best_metrics, winner, outcome.winner_dir, note=note)


def write_page(sweep_dir: Path, tracker, parent_run_id: str | None, console: Console,
               announce: bool = True) -> Path | None:
    """The sweep report (paratune.sweep.page: report/report.html and its PNGs), logged to the
    parent run under "report". Never raises: the sweep's results are on disk and in MLflow
    already, and a report that cannot be drawn must not lose them; it says why instead."""
    try:
        from paratune.sweep.page import write_sweep_report

        path = Path(write_sweep_report(sweep_dir))
    except Exception as err:  # noqa: BLE001 - see the docstring
        console.print(f"[yellow]no sweep report ({type(err).__name__}: {escape(str(err))[:500]}); the results are "
                      f"in {sweep_dir}[/yellow]")
        return None
    if tracker is not None and parent_run_id:
        try:
            tracker.client.log_artifacts(parent_run_id, str(path.parent), artifact_path="report")
            tracker.add_to_note(parent_run_id, f"Report: `report/{path.name}` in this run's artifacts "
                                               f"(on disk: `{path}`).")
        except Exception as err:  # noqa: BLE001 - the report is on disk; MLflow lacks only its copy
            console.print(f"[yellow]the sweep report was not logged to MLflow ({type(err).__name__}: "
                          f"{escape(str(err))[:300]})[/yellow]")
    if announce:
        console.print(f"sweep report: {path}", soft_wrap=True)
    return path


