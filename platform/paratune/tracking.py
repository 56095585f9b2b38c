"""MLflow: one parent run per sweep, one child run per trial, comparable in the UI.

Everything goes through an explicit MlflowClient with explicit experiment and run ids: no
`mlflow.set_experiment`/active-run globals, which leak MLFLOW_EXPERIMENT_ID into Ray workers.
Params come only from the plan (whose env is restricted to communication settings), so no
secret from the environment can reach the store.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from paratune import __version__
from paratune.report import strategy_label
from paratune.trial import TrialResult

DEFAULT_EXPERIMENT = "paratune"

# The metrics every child run carries (when measured), so the compare view lines them up.
SCALAR_METRICS = ("tokens_per_s_per_gpu", "mfu", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
                  "step_time_spread", "comm_share", "launch_s", "wall_s", "flops_per_token")


def default_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def code_version() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"paratune {__version__}" + (f" ({sha})" if sha else "")


def trial_metrics(result: TrialResult) -> dict[str, float]:
    metrics = {name: float(getattr(result, name)) for name in SCALAR_METRICS if getattr(result, name) is not None}
    if result.peak_memory_bytes:
        metrics["peak_memory_gib"] = max(result.peak_memory_bytes) / 2**30
    metrics["failed"] = 0.0 if result.ok else 1.0
    if result.losses:
        metrics["final_loss"] = result.losses[-1]
    return metrics


class SweepTracker:
    """The sweep's MLflow parent run and its children."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        existing = self.client.get_experiment_by_name(experiment)
        self.experiment_id = existing.experiment_id if existing else self.client.create_experiment(experiment)

    def start_parent(self, name: str, space_file: Path | None, params: dict[str, Any], tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=f"sweep {name}",
                                     tags={"paratune.kind": "sweep", "paratune.code_version": code_version(), **tags})
        self._log_params(run.info.run_id, params)
        if space_file is not None:
            self.client.log_artifact(run.info.run_id, str(space_file), artifact_path="space")
        return run.info.run_id

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_trial(self, parent_id: str, number: int, result: TrialResult, phase: str = "search",
                  extra_params: dict[str, Any] | None = None) -> str:
        """A child run: the flattened plan as params, measurements as metrics, loss/time series."""
        from mlflow.entities import Metric

        from paratune.plan import flatten_dict

        tags = {"mlflow.parentRunId": parent_id, "paratune.kind": "trial", "paratune.phase": phase,
                "paratune.status": result.status, "paratune.strategy": strategy_label(result.plan)}
        if result.reason:
            tags["paratune.failure_reason"] = result.reason
            tags["paratune.failure_message"] = (result.message or "")[:5000]
        run = self.client.create_run(self.experiment_id, run_name=f"{phase}-{number:03d} {strategy_label(result.plan)}",
                                     tags=tags)
        run_id = run.info.run_id
        params = {**flatten_dict(result.plan), "status": result.status, "failure_reason": result.reason or "none",
                  **(extra_params or {})}
        self._log_params(run_id, params)
        metrics = [Metric(k, v, 0, 0) for k, v in trial_metrics(result).items()]
        metrics += [Metric("loss", v, 0, i) for i, v in enumerate(result.losses)]
        metrics += [Metric("step_time_s", v, 0, i) for i, v in enumerate(result.step_times_s)]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(run_id, metrics=metrics[i : i + 500])
        self.client.set_terminated(run_id, status="FINISHED" if result.ok else "FAILED")
        return run_id

    def finish_parent(self, parent_id: str, best: dict[str, float], winner: dict[str, Any] | None,
                      winner_dir: Path | None, status: str = "FINISHED") -> None:
        """winner: the winning plan as a plain (nested) dict."""
        from paratune.plan import flatten_dict

        from mlflow.entities import Metric

        if best:
            self.client.log_batch(parent_id, metrics=[Metric(f"best_{k}", v, 0, 0) for k, v in best.items()])
        if winner:
            self.client.set_tag(parent_id, "paratune.winner", strategy_label(winner))
            self._log_params(parent_id, {f"winner.{k}": v for k, v in flatten_dict(winner).items()})
        if winner_dir is not None and winner_dir.is_dir():
            self.client.log_artifacts(parent_id, str(winner_dir), artifact_path="winner")
        self.client.set_terminated(parent_id, status=status)

    def child_runs(self, parent_id: str) -> list[Any]:
        return self.client.search_runs([self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                       max_results=10_000)
