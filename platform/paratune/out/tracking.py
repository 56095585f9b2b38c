"""MLflow: one parent run per sweep, one child run per trial, comparable in the UI.

Everything goes through an explicit MlflowClient with explicit experiment and run ids: no
`mlflow.set_experiment`/active-run globals, which leak MLFLOW_EXPERIMENT_ID into Ray workers.
Params come only from the plan (whose env is restricted to communication settings), so no
secret from the environment can reach the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from paratune import __version__
from paratune.out.tables import strategy_label
from paratune.trial.results import TrialResult

DEFAULT_EXPERIMENT = "paratune"

# MLflow 3.17's UI opens an experiment by its kind: the experiment tag "mlflow.experimentKind"
# (server/js/src/experiment-tracking/constants.ts ExperimentKind, as built into
# mlflow/server/js/build/static/js/main.*.js; mlflow/demo/generators/traces.py sets
# "genai_development"). "custom_model_development" is its "Machine learning" kind: the runs table
# first, no traces/token-usage overview. With workflow-based navigation on (3.17's default), the
# UI's own GenAI / Machine learning switch (?workflowType=, else the browser's last choice, else
# GenAI) decides first: `paratune ui` prints the link with ?workflowType=machine_learning.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # a run's Description in the UI (markdown)

# The metrics every child run carries (when measured), so the compare view lines them up.
SCALAR_METRICS = ("tokens_per_s_per_gpu", "mfu", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
                  "step_time_spread", "comm_share", "data_wait_share", "all_to_all_share", "routing_balance", "launch_s", "compile_s",
                  "wall_s", "flops_per_token")


def redact(text: str) -> str:
    """Scrub the values of credential-like environment variables (HF_TOKEN, AWS_SECRET_ACCESS_KEY,
    ...) from text about to be logged: Ray's error messages can quote a worker's environment."""
    from paratune.config.plan import SECRET_NAME

    for key, value in os.environ.items():
        if SECRET_NAME.search(key) and len(value) >= 6 and value in text:
            text = text.replace(value, f"<{key} redacted>")
    return text


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
    metrics["failed"] = 1.0 if result.status == "failed" else 0.0
    metrics["stopped_early"] = 1.0 if result.stopped_early else 0.0
    if result.losses:
        metrics["final_loss"] = result.losses[-1]
    for layer, balance in enumerate(result.routing_balance_per_layer):  # MoE layers, model order
        if balance is not None:
            metrics[f"routing_balance_moe_layer_{layer}"] = balance
    return metrics


def experiment_id_for(client, name: str = DEFAULT_EXPERIMENT) -> str:
    """The experiment's id, created if missing, and marked a model-training experiment
    (EXPERIMENT_KIND) so that MLflow's UI opens it on its runs, not on an empty GenAI overview."""
    existing = client.get_experiment_by_name(name)
    if existing is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    if existing.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # one made by an older paratune
        client.set_experiment_tag(existing.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return existing.experiment_id


def runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table in MLflow 3.17's UI, in its "Machine learning" view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def _ms(epoch_s: float) -> int:
    return int(round(epoch_s * 1000))


def trial_times_ms(result: TrialResult) -> tuple[int, int]:
    """(start, end) of the trial itself in epoch ms: its launch (started_at) to started_at + wall_s,
    so the UI's Duration is the trial's, not the few ms it took to log it. A result without them
    (a trial refused before it launched) ends now, and starts wall_s before."""
    import time

    now = time.time()
    wall = max(0.0, result.wall_s or 0.0)
    start = result.started_at if result.started_at is not None else now - wall
    return _ms(start), _ms(start + wall)


def sweep_note(summary: dict[str, Any] | None, winner_dir: Path | None,
               parity_failures: list[dict[str, str]] | None = None) -> str:
    """The parent run's Description (markdown): the winner, its figures and how to train with it
    (winner/job.sh's `ray job submit` line, README "Train with the winner", and `paratune train`
    here), or why there is none. The first thing the UI shows of a sweep, so the commands come
    before the detail (the UI folds a long description after a few lines)."""
    lines: list[str] = []
    if summary is None:
        lines.append("**No winner**: no plan finished and passed the loss-parity check.")
    else:
        label = summary.get("label", "?")
        spread = summary.get("relative_spread")
        figures = [f"**{summary.get('tokens_per_s_per_gpu_median', 0):,.0f} tokens/s/GPU** (median of "
                   f"{summary.get('measurements', 1)} measurement(s)"
                   + (f", spread ±{spread / 2:.1%})" if spread is not None else ")")]
        figures.append(f"MFU {summary['mfu']:.2%}" if summary.get("mfu") is not None
                       else "MFU n/a (no peak FLOP/s known for this device)")
        if summary.get("peak_memory_bytes"):
            figures.append(f"peak memory {max(summary['peak_memory_bytes']) / 2**30:.2f} GiB per rank")
        if summary.get("parity_max_abs_loss_diff") is not None:
            figures.append(f"loss parity vs a single process: max |Δ| {summary['parity_max_abs_loss_diff']:.1e}"
                           + (" (on a proxy model)" if summary.get("parity_proxy") else "")
                           + (f", within the model's rounding envelope ({summary['parity_bound']})"
                              if summary.get("parity_bound") else ""))
        lines.append(f"**Winner: {label}**: " + ", ".join(figures) + ".")
        if winner_dir is not None:
            from paratune.out.export import train_command

            job, local = winner_dir / "job.sh", winner_dir / "train.sh"
            here = (local.read_text().strip().splitlines()[-1] if local.exists() else
                    train_command(str((winner_dir / "plan.yaml").resolve()), name=f"{winner_dir.resolve().parent.name}-train"))
            train = [f"- where the sweep ran (`winner/train.sh`): `{here}`"]
            if job.exists():
                train.append(f"- on the Ray cluster (`winner/job.sh`): `{job.read_text().strip().splitlines()[-1]}`")
            lines.append("Train with it:\n\n" + "\n".join(train))
        tied = [t for t in summary.get("tied_with") or [] if t != label]
        if tied:
            lines.append(f"Tied with it within the noise (the simpler plan wins a tie): {', '.join(tied)}.")
    for failure in parity_failures or []:
        lines.append(f"Not the winner, fails loss parity: {failure.get('label')}: {failure.get('reason')}")
    if summary is not None and winner_dir is not None:
        lines.append(f"Files: `{winner_dir.resolve()}/` (plan.yaml, train.sh, job.sh, env.sh, ...; also this run's `winner` "
                     "artifacts).")
    return "\n\n".join(lines)


class SweepTracker:
    """The sweep's MLflow parent run and its children."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = experiment_id_for(self.client, experiment)
        # log_trial is check-then-create, and drops children not yet marked complete: two calls at
        # once would log a trial twice, or drop the run the other is still logging.
        self._lock = threading.RLock()

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

    def _logged_children(self, parent_id: str) -> dict[tuple[str, int], Any]:
        """(phase, number) -> the child run, for children logged completely (others are deleted:
        a driver killed while logging leaves a partial run behind)."""
        done = {}
        for run in self.child_runs(parent_id):
            tags = run.data.tags
            if tags.get("paratune.logged") == "1" and "paratune.trial_number" in tags:
                done[(tags.get("paratune.phase", "search"), int(tags["paratune.trial_number"]))] = run
            else:
                self.client.delete_run(run.info.run_id)
        return done

    def log_trial(self, parent_id: str, number: int, result: TrialResult, phase: str = "search",
                  extra_params: dict[str, Any] | None = None, extra_metrics: dict[str, float] | None = None) -> str:
        """A child run: the flattened plan as params, measurements as metrics, loss/time series.

        Idempotent per (phase, number): logging a trial that is already there returns that run,
        so a resumed sweep never holds the same trial twice. Calls from several threads take turns."""
        with self._lock:
            return self._log_trial(parent_id, number, result, phase, extra_params, extra_metrics)

    def _log_trial(self, parent_id: str, number: int, result: TrialResult, phase: str,
                   extra_params: dict[str, Any] | None, extra_metrics: dict[str, float] | None) -> str:
        from mlflow.entities import Metric

        from paratune.config.plan import flatten_dict

        existing = self._logged_children(parent_id).get((phase, number))
        if existing is not None:
            return existing.info.run_id
        tags = {"mlflow.parentRunId": parent_id, "paratune.kind": "trial", "paratune.phase": phase,
                "paratune.trial_number": str(number),
                "paratune.status": result.status, "paratune.strategy": strategy_label(result.plan)}
        if result.placement:  # where every rank ran (paratune.trial.placement), e.g. "node 10.0.0.5 (ab12cd34): ranks 0-7"
            from paratune.trial.placement import RankPlace, describe

            tags["paratune.placement"] = describe([RankPlace(**p) for p in result.placement])[:5000]
            tags["paratune.nodes"] = str(len({p["node_id"] for p in result.placement}))
        if result.reason:
            tags["paratune.failure_reason"] = result.reason
            tags["paratune.failure_message"] = redact(result.message or "")[:5000]
        start_ms, end_ms = trial_times_ms(result)  # the trial's own, not the logging's
        run = self.client.create_run(self.experiment_id, start_time=start_ms,
                                     run_name=f"{phase}-{number:03d} {strategy_label(result.plan)}", tags=tags)
        run_id = run.info.run_id
        params = {**flatten_dict(result.plan), "status": result.status, "failure_reason": result.reason or "none",
                  **(extra_params or {})}
        self._log_params(run_id, params)
        metrics = [Metric(k, float(v), end_ms, 0) for k, v in {**trial_metrics(result), **(extra_metrics or {})}.items()]
        metrics += [Metric("loss", v, end_ms, i) for i, v in enumerate(result.losses)]
        metrics += [Metric("step_time_s", v, end_ms, i) for i, v in enumerate(result.step_times_s)]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(run_id, metrics=metrics[i : i + 500])
        self.client.set_tag(run_id, "paratune.logged", "1")  # last: marks the run complete
        # A trial stopped early (it could not reach the incumbent) shows as KILLED, not FAILED.
        status = "FINISHED" if result.ok else "KILLED" if result.stopped_early else "FAILED"
        self.client.set_terminated(run_id, status=status, end_time=end_ms)
        if result.stopped_early and result.message:
            self.client.set_tag(run_id, "paratune.stopped_early", result.message[:5000])
        return run_id

    def sync_ledger(self, parent_id: str, entries: list[Any]) -> int:
        """Make MLflow hold exactly the ledger's trials (a resumed sweep calls this first, every sweep
        before it finishes): log those missing (the driver died between the ledger and MLflow, or
        the server was down), drop partial runs. Returns how many were logged."""
        with self._lock:
            done = self._logged_children(parent_id)
            missing = [e for e in entries if (e.phase, e.number) not in done]
            for e in missing:  # with what the cost model predicted for it (the live sweep logged that too)
                self.log_trial(parent_id, e.number, e.result, phase=e.phase, extra_metrics=e.predicted)
            return len(missing)

    def finish_parent(self, parent_id: str, best: dict[str, float], winner: dict[str, Any] | None,
                      winner_dir: Path | None, status: str = "FINISHED", note: str | None = None) -> None:
        """winner: the winning plan as a plain (nested) dict; note: the run's Description (sweep_note)."""
        import time

        from paratune.config.plan import flatten_dict

        from mlflow.entities import Metric

        if note is not None:
            self.client.set_tag(parent_id, NOTE_TAG, note)
        if best:
            now = _ms(time.time())
            self.client.log_batch(parent_id, metrics=[Metric(f"best_{k}", float(v), now, 0) for k, v in best.items()])
        if winner:
            # Tags, not params: a resumed sweep with more trials may crown another plan.
            from mlflow.entities import RunTag

            self.client.set_tag(parent_id, "paratune.winner", strategy_label(winner))
            tags = [RunTag(f"winner.{k}", str(v)[:5000]) for k, v in sorted(flatten_dict(winner).items())]
            for i in range(0, len(tags), 100):
                self.client.log_batch(parent_id, tags=tags[i : i + 100])
        if winner_dir is not None and winner_dir.is_dir():
            self.client.log_artifacts(parent_id, str(winner_dir), artifact_path="winner")
        self.client.set_terminated(parent_id, status=status)

    def add_to_note(self, run_id: str, line: str) -> None:
        """Append a paragraph to the run's Description, replacing one that starts with the same word
        (a report written again is mentioned once)."""
        note = self.client.get_run(run_id).data.tags.get(NOTE_TAG, "")
        head = line.split(":", 1)[0] + ":"
        kept = [p for p in note.split("\n\n") if p and not p.startswith(head)]
        self.client.set_tag(run_id, NOTE_TAG, "\n\n".join([*kept, line]))

    def child_runs(self, parent_id: str) -> list[Any]:
        return self.client.search_runs([self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                       max_results=10_000)


# --------------------------------------------------------------------------- training runs
def _client(tracking_uri: str | None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri or default_tracking_uri())


def start_training_run(tracking_uri: str | None, plan, name: str, steps: int, checkpoint_every: int,
                       experiment: str = DEFAULT_EXPERIMENT) -> str:
    """One MLflow run per training run (not a sweep child): the plan as params, loss per step."""
    from paratune.config.plan import flatten_dict

    client = _client(tracking_uri)
    experiment_id = experiment_id_for(client, experiment)
    found = client.search_runs([experiment_id], f"tags.`paratune.train_name` = '{name}'", max_results=1)
    if found:  # the same name again: a resumed run continues its MLflow run
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=f"train {name} {strategy_label(plan.to_dict())}",
                            tags={"paratune.kind": "train", "paratune.train_name": name,
                                  "paratune.code_version": code_version(),
                                  "paratune.strategy": strategy_label(plan.to_dict())})
    from mlflow.entities import Param

    params = {**flatten_dict(plan.to_dict()), "train.steps": steps, "train.checkpoint_every": checkpoint_every}
    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[i : i + 100])
    return run.info.run_id


def log_training_progress(tracking_uri: str | None, run_id: str, report: dict[str, Any], tokens_per_step: int,
                          world: int, checkpoint_path: str | None) -> None:
    """One checkpoint's worth of steps: loss and step time per step, throughput, the checkpoint."""
    from mlflow.entities import Metric

    now = int(__import__("time").time() * 1000)
    first = int(report["first_step"])
    metrics = [Metric("loss", float(v), now, first + i) for i, v in enumerate(report["losses"])]
    metrics += [Metric("step_time_s", float(v), now, first + i) for i, v in enumerate(report["step_times_s"])]
    metrics.append(Metric("checkpoint_step", float(report["step"]), now, int(report["step"])))
    client = _client(tracking_uri)
    client.log_batch(run_id, metrics=metrics)
    if checkpoint_path:
        client.set_tag(run_id, "paratune.last_checkpoint", checkpoint_path)


def log_training_restart(tracking_uri: str | None, run_id: str, worker_errors: dict[int, str]) -> None:
    client = _client(tracking_uri)
    run = client.get_run(run_id)
    restarts = int(run.data.metrics.get("restarts", 0)) + 1
    client.log_metric(run_id, "restarts", restarts)
    client.set_tag(run_id, f"paratune.restart_{restarts}", redact(json.dumps(worker_errors))[:5000])


def finish_training_run(tracking_uri: str | None, run_id: str, outcome) -> None:
    client = _client(tracking_uri)
    if outcome.tokens_per_s_per_gpu is not None:
        client.log_metric(run_id, "tokens_per_s_per_gpu", outcome.tokens_per_s_per_gpu)
    if outcome.losses:
        client.log_metric(run_id, "final_loss", outcome.losses[-1])
    client.set_tag(run_id, "paratune.status", outcome.status)
    if outcome.reason:
        client.set_tag(run_id, "paratune.failure_reason", outcome.reason)
        client.set_tag(run_id, "paratune.failure_message", redact(outcome.message or "")[:5000])
    client.set_terminated(run_id, status="FINISHED" if outcome.ok else "FAILED")
