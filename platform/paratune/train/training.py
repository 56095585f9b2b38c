"""The full training run of a plan (an exported winner): checkpointed, and resumed after a fault.

Unlike a trial (a measurement, never retried), a training run is worth saving: every
`checkpoint_every` steps each rank writes its own shards (torch.distributed.checkpoint, or
DeepSpeed's checkpoint for ZeRO) and reports them to Ray Train, which merges them into one
checkpoint directory in storage. When a worker dies, Ray Train's FailureConfig restarts the
worker group and `ray.train.get_checkpoint()` hands back the last checkpoint; the run continues
from that step. The global batch of a step is a pure function of (seed, step) and the RNG is
re-seeded per step, so the resumed run has the same loss curve as an uninterrupted one.
Running it again with the same `name` resumes from the last checkpoint too (Ray Train restores a
run from its storage folder), e.g. after the job's driver was killed.

A checkpoint counts once Ray Train's controller has registered it (it polls the workers every
2 s): a worker lost within that window after a save resumes from the checkpoint before it, which
redoes more steps but gives the same curve.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from paratune.costs import measure
from paratune.config.sizes import config_sizes
from paratune.trial.failures import Reason, classify
from paratune.train.hf_export import export_hf_folder, export_refusal, trained_modules
from paratune.config.plan import Plan, PlanError, load_plan_dict
from paratune.cluster.launch import build_trainer, ensure_ray, fit, process_group_backend, worker_demand
from paratune.trial.worker import maybe_inject_fault, reduce_losses_and_times, sync_device

PROGRESS_FILE = "progress.json"  # next step and the loss curve so far (rank 0 writes it)
STATE_DIR = "state"  # model + optimizer shards
HF_DIR = "hf_model"  # the last checkpoint's trained model as a Hugging Face folder (paratune.train.hf_export)


class TrainingResult(BaseModel):
    status: Literal["ok", "failed"]
    reason: Reason | None = None
    message: str | None = None
    name: str
    steps: int
    losses: list[float] = Field(default_factory=list)  # every step, across restarts
    resumed_at_steps: list[int] = Field(default_factory=list)  # where each restart picked up
    tokens_per_s_per_gpu: float | None = None  # median over the steps of the last attempt
    checkpoint: str | None = None
    hf_model: str | None = None  # a folder AutoModelForCausalLM.from_pretrained loads (the last step's values)
    hf_model_note: str | None = None  # why there is none (a layout paratune.train.hf_export does not write)
    mlflow_run_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------- worker side
def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker for a training run."""
    import ray.train
    import ray.train.torch

    from paratune.config.data import TokenBatches
    from paratune.model.build import build_config
    from paratune.parallel import build_runner
    from paratune.parallel.dims import ParallelDims
    from paratune.trial.placement import place_and_check

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    plan = load_plan_dict(config["plan"])
    steps, every = int(config["steps"]), int(config["checkpoint_every"])
    device = ray.train.torch.get_device()
    # The same placement check as a trial (a tp group across nodes fails here, named, not later).
    _, local_world = place_and_check(plan, rank, ctx.get_world_size(), ctx.get_local_world_size())
    dims = ParallelDims.from_plan(plan, device.type)
    dp_rank = dims.dp_rank(rank)
    model_config = build_config(plan.model, plan.model_overrides)
    runner = build_runner(model_config, plan, device, local_world)
    data = TokenBatches(plan.data, config_sizes(model_config).vocab, plan.seq_len, plan.global_batch, plan.seed)

    start, losses, resumed_at = 0, [], []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            progress = json.loads((Path(folder) / PROGRESS_FILE).read_text())
            runner.load_state(str(Path(folder) / STATE_DIR))
        start, losses, resumed_at = progress["next_step"], progress["losses"], progress["resumed_at"] + [progress["next_step"]]

    pending_losses: list[torch.Tensor | None] = []
    pending_times: list[float] = []
    times_this_attempt: list[float] = []
    for step in range(start, steps):
        if checkpoint is None:  # a fault injected for a test fires in the first attempt only
            maybe_inject_fault(rank, step)
        torch.manual_seed(plan.seed + 1_000_003 * (step + 1) + dp_rank)  # same RNG after a resume
        micro = [m.to(device) for m in data.micro_batches(step, dp_rank, dims.dp, plan.micro_batch)]
        sync_device(device)
        t0 = time.perf_counter()
        pending_losses.append(runner.train_step(micro))
        sync_device(device)
        pending_times.append(time.perf_counter() - t0)
        done = step + 1
        if done % every and done != steps:
            continue
        new_losses, new_times = reduce_losses_and_times(pending_losses, pending_times, device)
        first = done - len(new_losses)
        losses += new_losses
        times_this_attempt += new_times
        pending_losses, pending_times = [], []
        with tempfile.TemporaryDirectory() as folder:
            runner.save_state(str(Path(folder) / STATE_DIR))
            if done == steps and export_refusal(plan) is None:  # the trained model, as from_pretrained loads it
                export_hf_folder(trained_modules(runner, plan), model_config, plan, rank, Path(folder) / HF_DIR)
            if rank == 0:
                (Path(folder) / PROGRESS_FILE).write_text(json.dumps(
                    {"next_step": done, "losses": losses, "resumed_at": resumed_at}))
            report = {"step": done, "first_step": first, "losses": new_losses, "step_times_s": new_times}
            if done == steps:  # the run's throughput with its last checkpoint (Ray before 2.56 reads it there)
                report["tokens_per_s_per_gpu"] = _throughput(plan, times_this_attempt)
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder),
                             checkpoint_dir_name=f"step_{done:08d}")
    return {"losses": losses, "resumed_at": resumed_at,
            "tokens_per_s_per_gpu": _throughput(plan, times_this_attempt)}


def _throughput(plan: Plan, times: list[float]) -> float | None:
    """tokens/s/GPU over an attempt's steps; its first pays for warm-up and is left out."""
    measured = times[1:] or times
    return measure.tokens_per_second_per_gpu(plan.tokens_per_step, measured, plan.num_workers) if measured else None


def _outcome_of(result: Any, steps: int) -> dict[str, Any] | None:
    """Rank 0's outcome: Result.return_value (Ray 2.56+), else read from the run's last checkpoint
    (its progress file, and the throughput its report carried): an extra checkpoint for the return
    value (paratune.cluster.launch's fallback for measurements) would become the run's latest."""
    if result is None or hasattr(result, "return_value"):
        return result.return_value if result is not None else None
    if result.checkpoint is None:
        return None
    with result.checkpoint.as_directory() as folder:
        progress = json.loads((Path(folder) / PROGRESS_FILE).read_text())
    if progress["next_step"] != steps:
        return None
    return {"losses": progress["losses"], "resumed_at": progress["resumed_at"],
            "tokens_per_s_per_gpu": (result.metrics or {}).get("tokens_per_s_per_gpu")}


# --------------------------------------------------------------------------- driver side
def _progress_callback(tracking_uri: str | None, run_id: str | None, tokens_per_step: int, world: int):
    """Logs each checkpoint's losses to the MLflow run as it is saved (runs in Ray Train's controller)."""
    from ray.train import UserCallback

    class MlflowProgress(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if run_id is None or not metrics:
                return
            from paratune.out.tracking import log_training_progress

            log_training_progress(tracking_uri, run_id, metrics[0], tokens_per_step, world,
                                  checkpoint.path if checkpoint is not None else None)

        def after_exception(self, run_context, worker_exceptions):
            if run_id is None:
                return
            from paratune.out.tracking import log_training_restart

            log_training_restart(tracking_uri, run_id, {r: str(e)[:500] for r, e in worker_exceptions.items()})

    return MlflowProgress()


def run_training(plan: Plan | dict[str, Any], *, steps: int, checkpoint_every: int = 100, max_failures: int = 3,
                 name: str | None = None, storage_path: str | None = None, tracking_uri: str | None = None,
                 track: bool = True, ray_address: str | None = None, hf_out: str | None = None) -> TrainingResult:
    """Train `plan` for `steps` optimizer steps on the Ray cluster, checkpointing and resuming.

    The same `name` (and storage) continues a run from its last checkpoint. The last checkpoint
    holds the trained model as a Hugging Face folder (`hf_model`); `hf_out` copies it there too."""
    name = name or f"train-{uuid.uuid4().hex[:8]}"
    if not isinstance(plan, Plan):
        try:
            plan = load_plan_dict(plan)
        except PlanError as err:
            return TrainingResult(status="failed", reason="invalid_config", message=str(err), name=name, steps=steps)
    if steps < 1 or checkpoint_every < 1:
        return TrainingResult(status="failed", reason="invalid_config", name=name, steps=steps,
                              message=f"steps: got {steps}, checkpoint_every: got {checkpoint_every}; allowed: >= 1")
    from paratune.config.model_config import ModelError
    from paratune.checks.refusals import check_plan

    try:  # the model laid out as the plan asks, checked on the meta device before any worker starts
        check_plan(plan)
    except (ModelError, PlanError) as err:
        return TrainingResult(status="failed", reason="invalid_config", message=str(err), name=name, steps=steps)

    from ray.train import CheckpointConfig, FailureConfig

    ensure_ray(ray_address)
    workers = worker_demand(plan)
    run_id = None
    if track:
        from paratune.out.tracking import default_tracking_uri, start_training_run

        tracking_uri = tracking_uri or default_tracking_uri()  # resolved here: the controller's cwd differs
        run_id = start_training_run(tracking_uri, plan, name, steps, checkpoint_every)
    # Ray's own TorchTrainer and defaults (no deadline): a training run is retried and checkpointed.
    trainer = build_trainer(
        train_loop, {"plan": plan.to_dict(), "steps": steps, "checkpoint_every": checkpoint_every},
        name=name, workers=workers, backend=process_group_backend(plan, workers.use_gpu),
        comm_timeout_s=plan.comm_timeout_s, storage_path=storage_path,
        failure_config=FailureConfig(max_failures=max_failures), checkpoint_config=CheckpointConfig(num_to_keep=2),
        callbacks=[_progress_callback(tracking_uri, run_id, plan.tokens_per_step, plan.num_workers)])
    result, error = fit(trainer)  # an error: the run failed past max_failures
    out = _outcome_of(result, steps)
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    if error is not None or out is None:
        reason, message = classify(error) if error is not None else ("error", "no result from rank 0")
        outcome = TrainingResult(status="failed", reason=reason, message=message, name=name, steps=steps,
                                 checkpoint=checkpoint, mlflow_run_id=run_id)
    else:
        hf_model, note = _hf_model_of(result.checkpoint, plan, hf_out)
        outcome = TrainingResult(status="ok", name=name, steps=steps, losses=out["losses"],
                                 resumed_at_steps=out["resumed_at"], tokens_per_s_per_gpu=out["tokens_per_s_per_gpu"],
                                 checkpoint=checkpoint, hf_model=hf_model, hf_model_note=note, mlflow_run_id=run_id)
    if run_id is not None:
        from paratune.out.tracking import finish_training_run

        finish_training_run(tracking_uri, run_id, outcome)
    return outcome


def _hf_model_of(checkpoint: Any, plan: Plan, hf_out: str | None) -> tuple[str | None, str | None]:
    """(the Hugging Face folder of the last checkpoint, or None, and why not). With `hf_out` the
    folder is copied there (from any storage Ray Train writes to: `Checkpoint.as_directory`)."""
    refusal = export_refusal(plan)
    if refusal is not None:
        return None, refusal
    if checkpoint is None:
        return None, "no checkpoint was reported"
    import shutil

    with checkpoint.as_directory() as folder:
        source = Path(folder) / HF_DIR
        if not source.is_dir():
            return None, f"the last checkpoint {checkpoint.path} has no {HF_DIR} folder"
        if hf_out is None:
            return str(Path(checkpoint.path) / HF_DIR), None
        shutil.copytree(source, hf_out, dirs_exist_ok=True)
    return str(Path(hf_out).resolve()), None
