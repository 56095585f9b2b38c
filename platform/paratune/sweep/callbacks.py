"""The sweep's Ray Tune callbacks: each finished trial into the ledger and MLflow; Tune's console quiet.

The one module of the package that imports Ray Tune at the top (its classes subclass Tune's).
"""

from __future__ import annotations

from typing import Any

from ray.tune import Callback
from rich.console import Console
from rich.markup import escape

from paratune.out.progress import ProgressDisplay, SweepProgress, format_trial_line, status_text
from paratune.sweep.ledger import (Ledger, LedgerEntry, apply_budget, log_trial_or_say, observe_calibration,
                                   predicted_only)
from paratune.sweep.searchers import TimePredictions
from paratune.out.tables import env_label, strategy_label, varying_env
from paratune.trial.results import TrialResult


try:  # Tune's console reporter: on Tune's "internals" page, not its stable API (present Ray 2.43-2.60)
    from ray.tune.experimental.output import AirVerbosity
    from ray.tune.experimental.output import ProgressReporter as AirProgressReporter
except ImportError:  # a Ray without it: Tune's own output at verbose 0 (its banner and result folder show)
    AirVerbosity = AirProgressReporter = None


class QuietTuneOutput(AirProgressReporter or object):
    """Ray Tune's console output, silenced: its banner table, "View detailed results here", the
    TensorBoard hint and its trial tables say nothing a paratune user needs (paratune prints
    progress itself, paratune.out.progress). tune.run reports to the first such reporter among the
    callbacks, so the one Tune appends by itself (at AirVerbosity 0 here) only ever gets calls
    that print nothing at that verbosity. `paratune tune --verbose` leaves Tune's own in place."""

    available = AirProgressReporter is not None
    if available:
        _heartbeat_threshold = _start_end_verbosity = _intermediate_result_verbosity = AirVerbosity.DEFAULT
    # The base class leaves this None for its subclasses to set, and formats it in every per-trial
    # line: unset, a trial that errored at Tune's level (its actor's node died) raised AttributeError
    # in this callback, which Tune turns into a TuneError that ended the whole sweep.
    _addressing_tmpl = "Trial {}"

    def __init__(self) -> None:
        super().__init__(AirVerbosity.SILENT)

    def experiment_started(self, *args: Any, **kwargs: Any) -> None:
        """Tune prints the banner, the result folder and the TensorBoard hint here, whatever the verbosity."""

    def print_heartbeat(self, trials, *args: Any, force: bool = False) -> None:
        """No trial-status table (paratune's progress line says how far the sweep is)."""

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """Tune prints its error line here whatever the verbosity; paratune records and says the
        failure itself (LedgerCallback.on_trial_error), and the sweep goes on."""


class LedgerCallback(Callback):
    """Driver side: as each trial finishes, record it in the ledger and MLflow, and say so (with
    the sweep's progress: paratune.out.progress)."""

    def __init__(self, ledger: Ledger, tracker, parent: str, budget_gb: float | None, console: Console, total: int,
                 plans: dict[str, dict], calibration=None, predictions: TimePredictions | None = None,
                 progress: SweepProgress | None = None, display: ProgressDisplay | None = None):
        self.ledger, self.tracker, self.parent, self.plans = ledger, tracker, parent, plans
        self.calibration, self.predictions = calibration, predictions
        self.budget_gb, self.console, self.total = budget_gb, console, total
        self.progress = progress or SweepProgress(total)
        self.display = display
        self.env_keys = varying_env(p.get("env") for p in plans.values())  # shared ones: said once, at the start
        self.nodes_at_start: dict[str, set[str]] = {}  # trial id -> the alive nodes when it started

    def __getstate__(self) -> dict:
        # Tune pickles its callbacks with the experiment state; the live MLflow client and
        # console stay behind (paratune resumes from its own ledger, never from Tune's state).
        return {"total": self.total}

    def _record(self, key: str, result: TrialResult, trial_id: str | None = None) -> None:
        if key in self.ledger.keys():
            return
        number = len(self.ledger.search_entries()) + 1
        result = apply_budget(result, self.budget_gb)
        metrics = observe_calibration(self.calibration, result)
        predicted = self.predictions.observe(key, result) if self.predictions is not None else {}
        metrics.update(predicted)  # the calibrated model's step time replaces the roofline's
        # The ledger first (the durable record), then MLflow (idempotent; a resume fills gaps).
        self.ledger.append(LedgerEntry(number, key, result, "search", predicted_only(metrics)))
        log_trial_or_say(self.tracker, self.parent, number, result, self.console, extra_metrics=metrics)
        if result.ok:
            what = f"{result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
        elif result.stopped_early:
            what = f"[yellow]stopped early[/yellow] ({escape(result.message or '')})"
        else:
            what = f"[red]{result.reason}[/red]: {escape(result.message or '')}"
        if "step_time_prediction_error" in predicted:
            what += f" (predicted {predicted['predicted_step_time_s']:.3g} s/step, {predicted['step_time_prediction_error']:+.0%})"
        env = env_label(result.plan.get("env"), self.env_keys)
        label = strategy_label(result.plan) + (f" {env}" if env else "")
        self.progress.finish(trial_id, label, result.tokens_per_s_per_gpu, result.ok)
        live = self.display is not None and self.display.is_live  # the live line shows the rest
        self.console.print(format_trial_line(number, self.total, label, what,
                                             None if live else escape(status_text(self.progress))),
                           soft_wrap=True)  # one line per trial, however narrow the log's console

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.start(trial.trial_id)
        from paratune.trial.placement import alive_nodes

        try:  # a Tune trial that dies with a node (its trainable was there) is node_lost, not error
            self.nodes_at_start[trial.trial_id] = {n.node_id for n in alive_nodes()}
        except Exception:  # noqa: BLE001 - Ray unreachable: the error stays an error
            self.nodes_at_start.pop(trial.trial_id, None)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        if "trial_result" in last:
            self._record(last["point"], TrialResult.model_validate_json(last["trial_result"]), trial.trial_id)
        self.progress.running.discard(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info):
        key = trial.config.get("point")
        if key in self.plans:
            error = info.get("error") or getattr(trial, "error_msg", None) or "the Tune trial itself failed"
            from paratune.cluster.trial import node_lost_or

            # the trainable itself died: with a node of the cluster, the node failed, not the plan (a resume re-runs it)
            reason, message = node_lost_or("error", str(error)[:2000], self.nodes_at_start.get(trial.trial_id, set()))
            self._record(key, TrialResult.failed(self.plans[key], reason, message), trial.trial_id)
        self.progress.running.discard(trial.trial_id)
