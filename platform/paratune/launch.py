"""Launching workers on Ray: the one place that assembles a Ray Train TorchTrainer and a worker demand.

A trial (paratune.trial), a reused worker group (paratune.session), a profile (paratune.profile)
and a training run (paratune.training) all start Ray Train workers the same way: the plan's
device decides GPU or CPU workers, that decides what Ray reserves per worker, the backend and
the env vars in place before the process group starts (`worker_demand`), and `build_trainer`
turns that into a TorchTrainer. Measurements get the timed trainer (a deadline, never retried,
Ray's controller trimmed for a measurement); the training run keeps Ray's own TorchTrainer and
defaults. Ray-private overrides live only here, checked against the Ray version they mirror.

Ray is imported inside the functions: the worker path imports this module without Ray.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paratune import placement
from paratune.failures import TrialTimeout
from paratune.plan import Plan

# The Ray release whose private TorchTrainer internals (`_initialize_and_run_controller`,
# `_create_default_callbacks`) the timed trainer mirrors; pyproject.toml allows only its patches.
MIRRORED_RAY_VERSION = "2.60"


class RayVersionError(RuntimeError):
    """The installed Ray is not the one whose private internals the timed trainer mirrors."""


def check_ray_version(installed: str, mirrored: str = MIRRORED_RAY_VERSION) -> None:
    """Raise RayVersionError unless `installed` (ray.__version__) is a release of `mirrored`
    (major.minor; any patch): another Ray may have changed what the overrides copy."""
    found = re.match(r"(\d+)\.(\d+)(?:\D|$)", installed or "")
    want = tuple(int(x) for x in mirrored.split(".")[:2])
    if found is None or (int(found.group(1)), int(found.group(2))) != want:
        raise RayVersionError(
            f"ray: installed {installed!r}, but paratune's timed trainer (paratune.launch: TimedTorchTrainer's "
            f"_initialize_and_run_controller and _create_default_callbacks) mirrors Ray {mirrored}'s private "
            f"internals; allowed: ray {mirrored}.x (pyproject.toml; constraints.txt pins it)")


# --------------------------------------------------------------------------- Ray and storage
def ensure_ray(address: str | None = None) -> None:
    """Join RAY_ADDRESS (e.g. under `ray job submit`) or start an in-process local cluster."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    verbose = bool(os.environ.get("PARATUNE_VERBOSE"))
    import logging

    from paratune.quiet import quiet_ray_start

    quiet_ray_start()

    ray.init(address=address, log_to_driver=verbose, include_dashboard=False if address == "local" else None,
             logging_level=logging.INFO if verbose else logging.WARNING)


def paratune_home() -> Path:
    """Where sweeps and training runs write (PARATUNE_HOME, else ./paratune_runs). Under `ray job
    submit` the working directory is a temporary copy, so jobs/runtime_env.yaml sets it."""
    return Path(os.environ.get("PARATUNE_HOME") or Path.cwd() / "paratune_runs").expanduser().resolve()


def default_storage() -> str:
    """Ray Train's storage_path: PARATUNE_STORAGE (shared storage: NFS path or s3://... on a
    multi-node cluster, where checkpoints must outlive a node), else under paratune_home()."""
    return os.environ.get("PARATUNE_STORAGE") or str(paratune_home() / "ray")


# --------------------------------------------------------------------------- what workers need
def wants_gpu(plan: Plan) -> bool:
    """The plan's device: cuda/cpu as set, or auto = GPUs when the cluster has any."""
    import ray

    if plan.device == "cuda":
        return True
    if plan.device == "cpu":
        return False
    return ray.cluster_resources().get("GPU", 0) >= 1


def needs_cpu_collectives(plan: Plan) -> bool:
    """Whether a plan runs collectives on host tensors: under FSDP2 CPU offload the gradients
    live on the host, so gradient clipping's all-reduce runs on CPU tensors."""
    return plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.cpu_offload


def process_group_backend(plan: Plan, use_gpu: bool) -> str:
    """gloo on CPU workers; NCCL on GPUs, plus gloo for CPU tensors when the plan has CPU-side
    collectives (an NCCL-only group cannot reduce host tensors: the step would crash)."""
    if not use_gpu:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if needs_cpu_collectives(plan) else "nccl"


def gpu_node_cpus_per_gpu(nodes: list[dict[str, Any]]) -> float | None:
    """CPUs per GPU on the alive GPU nodes (the smallest ratio, so any node can host a worker)."""
    ratios = [n["Resources"].get("CPU", 0) / n["Resources"]["GPU"] for n in nodes
              if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
    return min(ratios) if ratios else None


def worker_resources(plan: Plan, use_gpu: bool, nodes: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """What Ray reserves per worker. CPUs matter beyond scheduling: Ray sets OMP_NUM_THREADS to a
    worker's CPUs (1 when it reserves none), and offload plans run their optimizer on them, so a
    GPU worker reserving 0 CPUs would measure offload on one thread. Default on GPUs: the GPU
    nodes' CPUs / GPUs, floored (a whole share of the node), never less than 1."""
    if not use_gpu:
        return {"CPU": plan.cpus_per_worker or 1}
    cpus = plan.cpus_per_worker
    if cpus is None:
        ratio = gpu_node_cpus_per_gpu(nodes or [])
        cpus = max(1, int(ratio)) if ratio else 1
    return {"GPU": 1, "CPU": cpus}


# Set on GPU workers unless the plan sets them. Ray Train sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# (TearDown) when unset, and torch's default (3) also kills the process: the driver then sees a
# dead actor (worker_died) where the truth is a collective timeout. 2 (CleanUpOnly, still in torch
# 2.13's ErrorHandlingMode) aborts the communicators but keeps the process, so the next collective
# raises DistBackendError in the worker: classified comm_timeout.
GPU_WORKER_ENV: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def worker_env(plan: Plan, use_gpu: bool) -> dict[str, str]:
    """Env vars for the workers, in place before their process group starts (the plan's win)."""
    return {**GPU_WORKER_ENV, **plan.env} if use_gpu else dict(plan.env)


@dataclass(frozen=True)
class WorkerDemand:
    """What a plan's workers need of Ray: GPU workers or not, the resources each reserves, the
    placement demand of the whole group (paratune.placement) and the workers' env vars."""

    use_gpu: bool
    per_worker: dict[str, float]
    demand: placement.Demand
    env: dict[str, str]
    # The plan leaves state in its processes that no reset removes (async TP: torch's symmetric-memory
    # registry keeps each tp group's rank, size and store by group name, refuses a name twice, and
    # group names count from 0 again in every fresh process group): its workers serve it alone.
    single_use: bool = False

    @classmethod
    def for_plan(cls, plan: Plan, use_gpu: bool, nodes: list[dict[str, Any]] | None = None) -> "WorkerDemand":
        """The demand on GPU (use_gpu) or CPU workers; `nodes`: ray.nodes(), for a GPU worker's CPUs."""
        per_worker = worker_resources(plan, use_gpu, nodes)
        return cls(use_gpu, per_worker, placement.demand_for(plan, per_worker), worker_env(plan, use_gpu),
                   single_use=bool(plan.async_tp))

    @property
    def workers(self) -> int:
        return self.demand.workers


def worker_demand(plan: Plan) -> WorkerDemand:
    """The plan's WorkerDemand on the running cluster (GPUs if it has them for device auto)."""
    import ray

    use_gpu = wants_gpu(plan)
    return WorkerDemand.for_plan(plan, use_gpu, ray.nodes() if use_gpu else None)


# --------------------------------------------------------------------------- placement groups
def placement_groups() -> dict[str, str]:
    """Every placement group of the cluster: id (hex) -> state."""
    from ray.util import placement_group_table

    return {pg_id: info["state"] for pg_id, info in placement_group_table().items()}


def idle_placement_groups(candidates: set[str]) -> set[str]:
    """Those of the given placement groups in which nothing runs (all their resources free)."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    idle = set()
    for pg_id in candidates:
        keys = [k for k in total if k.endswith(f"_group_{pg_id}")]
        if keys and all(free.get(k, 0) >= total[k] for k in keys):
            idle.add(pg_id)
    return idle


def remove_placement_group(pg_id: str) -> None:
    """Remove one placement group by its id (hex)."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group as remove

    remove(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def remove_leaked_placement_groups(before: set[str]) -> int:
    """A failed process-group setup leaves its placement group behind (seen with Ray 2.60),
    starving every later trial. Remove the groups created since this trial started once they
    hold nothing (their failed workers take a few seconds to go), seen idle in two checks 1 s
    apart, so a concurrent trial's group (busy) is left alone."""
    new = {pg_id for pg_id, state in placement_groups().items() if pg_id not in before and state == "CREATED"}
    idle: set[str] = set()
    previous: set[str] = set()
    for _ in range(15):
        if not new:
            break
        now_idle = idle_placement_groups(new)
        idle = now_idle & previous
        if idle == new:
            break
        previous = now_idle
        time.sleep(1)
    for pg_id in idle:
        remove_placement_group(pg_id)
    return len(idle)


# --------------------------------------------------------------------------- the timed trainer
def abort_controller(controller) -> None:
    """End a Ray Train run now, whatever its state: abort (shuts the worker group down), then kill."""
    import ray

    try:
        ray.get(controller.abort.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - abort exits the actor; kill it in any case
        pass
    ray.kill(controller, no_restart=True)


# Ray Train's controller settings for a measurement (Ray's own switches; a user's environment
# wins; the training job, paratune.training, keeps Ray's defaults):
# - A measurement is never retried (max_failures 0), so the preemption watcher (an actor per run
#   that polls node drains to hand the run a grace window before a restart) has nothing to do: a
#   trial on a drained node ends node_lost either way. Off: one Ray process fewer per trial (a
#   few CPU-seconds of imports each).
# - The controller polls its workers every 2 s: a trial's end (and its failure) is noticed up to
#   2 s late, every trial of a sweep. Every 0.5 s: a poll is one small task per worker, and a
#   missed poll is only a worker's fault after 10 minutes of them.
MEASUREMENT_CONTROLLER_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def timed_trainer_class():
    """TorchTrainer whose fit() gives up after a deadline, aborting the controller and workers.

    Ray Train's own timeouts cover process-group setup and collectives (TorchConfig.timeout_s)
    but not a worker stuck elsewhere; a sweep must never wait forever on one trial. This mirrors
    Ray 2.60's `_initialize_and_run_controller`, waiting on the controller with a deadline
    (check_ray_version refuses another Ray). While the run lasts `controller` is its handle (a
    session aborts it from another thread); then the handle goes, so Ray ends the controller and
    with it the workers and placement group a failed run (e.g. its process group setup) would
    otherwise keep alive.
    """
    import ray
    import ray.train.v2.api.data_parallel_trainer as dpt
    from ray.train.torch import TorchTrainer

    check_ray_version(ray.__version__)

    class TimedTorchTrainer(TorchTrainer):
        deadline_s: float = 1800.0
        deadline_message: str = "hang: trial exceeded trial_timeout_s={deadline_s:.0f}s; workers aborted"
        controller = None
        start_timeout_s: float | None = None  # Ray Train's worker-group start timeout (None: its 60 s)

        def _create_default_callbacks(self):
            """Ray's callbacks, less the datasets callback when there are no datasets (a trial
            has none): with none it still starts a DatasetManager actor per run, a process that
            imports Ray Data (pandas, pyarrow: ~2.7 CPU-seconds) and serves nothing."""
            from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if self.datasets or not isinstance(c, DatasetsCallback)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            env_vars = dpt.get_env_vars_to_propagate()
            if self.start_timeout_s is not None:
                from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR

                env_vars[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(self.start_timeout_s)
            env_vars.setdefault(dpt.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                                dpt.DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
            for name, value in MEASUREMENT_CONTROLLER_ENV.items():
                env_vars.setdefault(name, value)  # set by the user (propagated by Ray): theirs
            controller_cls = ray.remote(
                num_cpus=0,
                label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
                runtime_env={"env_vars": env_vars},
            )(dpt.TrainController)
            self.controller = controller = controller_cls.remote(**controller_init_kwargs)
            try:
                done, _ = ray.wait([controller.run.remote()], timeout=self.deadline_s)
                if not done:
                    abort_controller(controller)
                    raise TrialTimeout(self.deadline_message.format(deadline_s=self.deadline_s))
                ray.get(done[0])
                return ray.get(controller.get_result.remote())
            finally:
                self.controller = controller = None

    return TimedTorchTrainer


@dataclass(frozen=True)
class Deadline:
    """A measurement's bounds: fit() gives up after `seconds` (controller and workers aborted).
    `message` (None: the trial's) formats {deadline_s}; `start_timeout_s`: Ray Train's
    worker-group start timeout (None: Ray's 60 s)."""

    seconds: float
    message: str | None = None
    start_timeout_s: float | None = None


def build_trainer(train_loop: Callable[[dict[str, Any]], Any], train_loop_config: dict[str, Any], *, name: str,
                  workers: WorkerDemand, backend: str, comm_timeout_s: float,
                  storage_path: str | Path | None = None, nodes: list[str] | None = None,
                  deadline: Deadline | None = None, failure_config: Any = None, checkpoint_config: Any = None,
                  callbacks: list[Any] | None = None):
    """The TorchTrainer for `workers`: their resources (pinned to `nodes`, whole nodes held for
    them, when given), the process-group backend and timeout, and their env vars in place before
    the process group starts.

    With a `deadline`: a measurement, on the timed trainer (its controller trimmed by
    MEASUREMENT_CONTROLLER_ENV), never retried and never letting the controller loop forever.
    Without: Ray's own TorchTrainer, with `failure_config`, `checkpoint_config` and `callbacks`
    (Ray's defaults where None): the training run."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run: dict[str, Any] = {"name": name, "storage_path": str(storage_path or default_storage())}
    if deadline is not None:
        # A trial is a measurement: never retry it, and never let the controller loop forever.
        run["failure_config"] = FailureConfig(max_failures=0, controller_failure_limit=0)
    elif failure_config is not None:
        run["failure_config"] = failure_config
    if checkpoint_config is not None:
        run["checkpoint_config"] = checkpoint_config
    # Env vars reach every worker before TorchConfig starts the process group.
    run["worker_runtime_env"] = {"env_vars": workers.env} if workers.env else None
    if callbacks is not None:
        run["callbacks"] = callbacks
    trainer_cls = timed_trainer_class() if deadline is not None else TorchTrainer
    trainer = trainer_cls(
        train_loop,
        train_loop_config=train_loop_config,
        scaling_config=ScalingConfig(
            num_workers=workers.workers, use_gpu=workers.use_gpu, resources_per_worker=workers.per_worker,
            label_selector=placement.pinned_selectors(workers.demand, nodes) if nodes else None),
        torch_config=TorchConfig(backend=backend, timeout_s=int(comm_timeout_s)),
        run_config=RunConfig(**run),
    )
    if deadline is not None:
        trainer.deadline_s = deadline.seconds
        trainer.start_timeout_s = deadline.start_timeout_s
        if deadline.message is not None:
            trainer.deadline_message = deadline.message
    return trainer


def fit(trainer) -> tuple[Any, BaseException | None]:
    """(Ray Train's Result or None, the error that ended the run or None): never raises."""
    try:
        result = trainer.fit()
    except Exception as err:  # noqa: BLE001 - every failure becomes a classified result
        return None, err
    return result, result.error
