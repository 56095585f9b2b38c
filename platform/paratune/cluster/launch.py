"""Launching workers on Ray: the one place that assembles a Ray Train TorchTrainer and a worker demand.

A trial (paratune.cluster.trial), a reused worker group (paratune.cluster.session), a profile (paratune.costs.profile)
and a training run (paratune.train.training) all start Ray Train workers the same way: the plan's
device decides GPU or CPU workers, that decides what Ray reserves per worker, the backend and
the env vars in place before the process group starts (`worker_demand`), and `build_trainer`
turns that into a TorchTrainer. Measurements get the timed trainer (a deadline, never retried,
Ray's controller trimmed for a measurement); the training run keeps Ray's own TorchTrainer and
defaults. Ray's public API (RunConfig, FailureConfig, ScalingConfig, Train's documented
RAY_TRAIN_* variables, Ray Core's actors), on every release from OLDEST_RAY to NEWEST_RAY: what a
release lacks is read from its public config classes (`ray_features`) and its fallback said
(`RayFeatures.lost`). One private method, behind feature detection with Ray's own behaviour as the
fallback: a measurement skips two of Train's default actors (`measurement_trainer_class`).

Ray is imported inside the functions: the worker path imports this module without Ray.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paratune.trial import placement
from paratune.trial.failures import TrialTimeout
from paratune.config.home import default_storage
from paratune.config.plan import Plan

# The Ray releases paratune runs on (pyproject.toml declares the same range): from 2.49, the first
# Train V2 with FailureConfig(controller_failure_limit) (before it the controller retries a worker
# group that cannot start forever), to the next minor after 2.60. Ray's public API only; what a
# release lacks is feature-detected (ray_features) and its fallback said (RayFeatures.lost).
OLDEST_RAY = (2, 49)
NEWEST_RAY = (2, 61)


class RayVersionError(RuntimeError):
    """The installed Ray is outside the releases paratune supports."""


def check_ray_version(installed: str, oldest: tuple[int, int] = OLDEST_RAY, newest: tuple[int, int] = NEWEST_RAY) -> None:
    """Raise RayVersionError unless `installed` (ray.__version__) is a release from `oldest` to
    `newest` (major.minor, any patch)."""
    found = re.match(r"(\d+)\.(\d+)(?:\D|$)", installed or "")
    if found is None or not oldest <= (int(found.group(1)), int(found.group(2))) <= newest:
        raise RayVersionError(
            f"ray: installed {installed!r}; allowed: ray {oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}.x "
            f"(pyproject.toml; constraints.txt pins the tested one)")


@dataclass(frozen=True)
class RayFeatures:
    """What the installed Ray Train V2 offers through its public API (read from its config classes)."""

    version: str
    return_value: bool  # Result.return_value: rank 0's return (Ray 2.56)
    label_selector: bool  # ScalingConfig(label_selector=[per worker]) (Ray 2.53)
    controller_failure_limit: bool  # FailureConfig(controller_failure_limit) (Ray 2.49)

    def lost(self) -> list[str]:
        """What paratune does without on this Ray, and what it does instead (one line each; [] on 2.56
        and later). docs/install.md "Ray versions" says the same."""
        out = []
        if not self.return_value:
            out.append("no Result.return_value (Ray 2.56): rank 0's measurements come back in one last "
                       "ray.train.report with an empty checkpoint (one more barrier after the measured steps, "
                       "one small checkpoint folder per run); a training run reads its outcome from its last "
                       "checkpoint")
        if not self.label_selector:
            out.append("no ScalingConfig.label_selector (Ray 2.53): a whole-node trial's workers are not pinned "
                       "to the nodes leased to it (Ray packs them; every rank still checks the layout: "
                       "invalid_placement)")
        return out


def ray_features() -> RayFeatures:
    """The installed Ray's features; RayVersionError if ray.train came up as Train V1 (Ray 2.49-2.50
    with RAY_TRAIN_V2_ENABLED unset when ray.train was first imported: paratune/__init__.py sets it)."""
    import dataclasses

    import ray
    from ray.train import FailureConfig, Result, ScalingConfig

    def has(cls, name: str) -> bool:
        return any(f.name == name for f in dataclasses.fields(cls))

    from ray.train.torch import TorchTrainer

    if not TorchTrainer.__module__.startswith("ray.train.v2."):
        raise RayVersionError(f"ray {ray.__version__}: ray.train was imported with Train V1 (RAY_TRAIN_V2_ENABLED="
                              f"{os.environ.get('RAY_TRAIN_V2_ENABLED')!r}); paratune needs Train V2: import paratune "
                              "before ray.train, or set RAY_TRAIN_V2_ENABLED=1")
    return RayFeatures(ray.__version__, has(Result, "return_value"), has(ScalingConfig, "label_selector"),
                       has(FailureConfig, "controller_failure_limit"))


# --------------------------------------------------------------------------- Ray and storage
def ensure_ray(address: str | None = None) -> None:
    """Join RAY_ADDRESS (e.g. under `ray job submit`) or start an in-process local cluster."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    verbose = bool(os.environ.get("PARATUNE_VERBOSE"))
    import logging

    from paratune.config.quiet import quiet_ray_start

    quiet_ray_start()

    ray.init(address=address, log_to_driver=verbose, include_dashboard=False if address == "local" else None,
             logging_level=logging.INFO if verbose else logging.WARNING)


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
    placement demand of the whole group (paratune.trial.placement) and the workers' env vars."""

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
# Ray Train's controller settings for a measurement, by their documented environment variables (a
# user's own RAY_TRAIN_* values win; the training job, paratune.train.training, keeps Ray's defaults).
# Ray Train reads them in the process that calls fit() and hands them to its controller and workers:
# the measurement's runner actor gets them in its runtime_env.
# - A measurement is never retried (max_failures 0), so the preemption watcher (Ray 2.57+; an
#   actor per run that polls node drains) has nothing to do: off, one Ray process fewer per trial.
# - The controller polls its workers every 2 s by default: a trial's end is noticed up to 2 s late.
MEASUREMENT_CONTROLLER_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
V2_ENABLED_ENV = "RAY_TRAIN_V2_ENABLED"  # Ray 2.49-2.50: Train V2 only when set to 1 (paratune/__init__.py sets it)
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # named by Ray's own startup-timeout error


def runner_env(start_timeout_s: float | None) -> dict[str, str]:
    """The env of a measurement's runner: the caller's RAY_TRAIN_* (theirs win), then paratune's."""
    env = {k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}
    for name, value in MEASUREMENT_CONTROLLER_ENV.items():
        env.setdefault(name, value)
    env.setdefault(V2_ENABLED_ENV, "1")
    # Ray's default is 30 s before 2.55, 60 s since: paratune asks for 60 s on every release.
    env[WORKER_GROUP_START_TIMEOUT_ENV] = str(start_timeout_s) if start_timeout_s is not None else \
        env.get(WORKER_GROUP_START_TIMEOUT_ENV, "60")
    return env


RETURN_METRIC = "paratune_return"


def _return_by_report(train_loop, config):
    """Ray before 2.56 (no Result.return_value): rank 0's return reaches the driver as the metrics of
    one last ray.train.report (a barrier: every rank reports) with a tiny checkpoint, since Train V2
    keeps a report's metrics in Result.metrics only with a checkpoint. After the measured steps."""
    import base64
    import pickle
    import tempfile

    import ray.train

    out = train_loop(config)
    metrics = {RETURN_METRIC: base64.b64encode(pickle.dumps(out)).decode()}  # any picklable value, as return_value
    if ray.train.get_context().get_world_rank() == 0:
        with tempfile.TemporaryDirectory() as folder:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    else:
        ray.train.report(metrics)
    return out


def return_value(result) -> Any:
    """Rank 0's return: Result.return_value, or (Ray before 2.56) the last report's metrics."""
    import base64
    import pickle

    if result is None:
        return None
    if hasattr(result, "return_value"):
        return result.return_value
    metrics = result.metrics or {}
    return pickle.loads(base64.b64decode(metrics[RETURN_METRIC])) if RETURN_METRIC in metrics else None


@contextlib.contextmanager
def sigint_handler_kept():
    """Put back this process's SIGINT handler after a fit(). Ray Train's fit() (main thread) installs
    one that aborts the run on Ctrl-C and holds the run's controller: left in place, the finished
    run's controller (a Ray process) lives until the process's next fit() or its end."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


class FitRunner:
    """One TorchTrainer.fit() at a time, in a 0-CPU actor on the caller's node that paratune owns.

    The deadline is Ray Core's ownership: Ray Train's controller is an actor of the process that calls
    fit(), and its workers are the controller's, so ray.kill() on this runner ends them all (the
    placement group stays: remove_leaked_placement_groups). Not threaded: Ray 2.49-2.50's fit()
    registers a SIGINT handler, which only the main thread may. A runner whose fit() returned by itself
    serves the next measurement of its process (`_RunnerPool`): a Ray process and its imports fewer per
    launch."""

    def fit(self, train_loop, kwargs: dict[str, Any]):
        """(Result or None, the error that ended the run or None)."""
        if not ray_features().return_value:
            train_loop = functools.partial(_return_by_report, train_loop)
        return fit(_torch_trainer(train_loop, measurement=True, **kwargs))  # the caller sees Ray's own error

    def pid(self) -> int:
        """This runner's process id (also the pool's liveness check)."""
        return os.getpid()


@functools.cache
def _runner_class():
    import ray

    return ray.remote(FitRunner)


class _RunnerPool:
    """This process's idle runners, by cluster node and env: a measurement takes one (or starts one)
    and gives it back when its fit() returned by itself. A runner killed for a deadline or an abort is
    never given back; one that died meanwhile is replaced (a liveness call when taken)."""

    MAX_IDLE = 2  # a sweep's driver, a session's concurrent groups: each running measurement has its own

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._idle: list[tuple[tuple, Any]] = []

    @staticmethod
    def _key(env: dict[str, str]) -> tuple:
        import ray

        context = ray.get_runtime_context()  # a new cluster (ray.shutdown, ray.init) is a new node id
        return context.get_node_id(), context.get_job_id(), tuple(sorted(env.items()))

    def take(self, env: dict[str, str]):
        import ray

        key = self._key(env)
        while True:
            with self._lock:
                self._idle = [(k, r) for k, r in self._idle if k[:2] == key[:2]]  # another cluster's: gone with it
                found = next((i for i, (k, _) in enumerate(self._idle) if k == key), None)
                runner = self._idle.pop(found)[1] if found is not None else None
            if runner is None:
                return key, _runner_class().options(num_cpus=0, scheduling_strategy=placement.on_this_node(),
                                                    runtime_env={"env_vars": env}).remote()
            try:
                ray.get(runner.pid.remote(), timeout=30)
                return key, runner
            except Exception:  # noqa: BLE001 - dead or unresponsive: never used again
                ray.kill(runner, no_restart=True)

    def give_back(self, key: tuple, runner) -> None:
        import ray

        with self._lock:
            self._idle.append((key, runner))
            extra = self._idle[:-self.MAX_IDLE]
            self._idle = self._idle[-self.MAX_IDLE:]
        for _, old in extra:
            ray.kill(old, no_restart=True)

    def idle_pids(self) -> list[int]:
        """The process ids of this process's idle runners on the current cluster."""
        import ray

        with self._lock:
            runners = [r for k, r in self._idle]
        return sorted(ray.get([r.pid.remote() for r in runners], timeout=30))


_runners = _RunnerPool()


def idle_runner_pids() -> list[int]:
    """This process's idle measurement runners (their pids): what the next measurement reuses."""
    return _runners.idle_pids()


class TimedTrainer:
    """A measurement's TorchTrainer: fit() gives up after a deadline, ending the controller and its
    workers (abort() does the same from another thread; a session's request timeout)."""

    deadline_message: str = "hang: trial exceeded trial_timeout_s={deadline_s:.0f}s; workers aborted"

    def __init__(self, train_loop, kwargs: dict[str, Any], deadline: "Deadline"):
        self.train_loop, self.kwargs = train_loop, kwargs
        self.deadline_s = deadline.seconds
        self.start_timeout_s = deadline.start_timeout_s
        if deadline.message is not None:
            self.deadline_message = deadline.message
        self.runner = None
        self.aborted = False

    def fit(self):
        import ray

        key, runner = _runners.take(runner_env(self.start_timeout_s))
        self.runner = runner
        reusable = False
        try:
            done, _ = ray.wait([runner.fit.remote(self.train_loop, self.kwargs)], timeout=self.deadline_s)
            if not done or self.aborted:
                self.abort()
                raise TrialTimeout(self.deadline_message.format(deadline_s=self.deadline_s))
            result, error = ray.get(done[0])
            reusable = not self.aborted
            if error is not None:
                raise error
            return result
        finally:
            self.runner = None
            if reusable:
                _runners.give_back(key, runner)
            else:
                ray.kill(runner, no_restart=True)

    def abort(self) -> None:
        """End the run now, whatever its state (the runner, so its controller and workers)."""
        import ray

        self.aborted = True
        runner = self.runner
        if runner is not None:
            ray.kill(runner, no_restart=True)


# Ray Train V2 actors a measurement has no use for, by the class name of the controller callback
# that starts them: Ray Data's DatasetManager (started on Ray 2.60 with no dataset) and the
# detached PlacementGroupCleaner (a measurement's failure paths remove its placement group
# themselves: remove_leaked_placement_groups, the session's _end_after_failure). Two Ray processes
# and their imports fewer per launch. The training run keeps all of Ray's.
MEASUREMENT_SKIPPED_CALLBACKS = ("DatasetsCallback", "PlacementGroupCleanerCallback")


@functools.cache
def measurement_trainer_class():
    """TorchTrainer without MEASUREMENT_SKIPPED_CALLBACKS when it has no datasets. Ray's default
    callbacks come from a private method (DataParallelTrainer._create_default_callbacks, Ray
    2.49-2.60): used only where the installed Ray has it, else Ray's own TorchTrainer (every actor
    started, as before)."""
    from ray.train.torch import TorchTrainer

    if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
        return TorchTrainer

    class MeasurementTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if getattr(self, "datasets", None) or not isinstance(callbacks, list):
                return callbacks
            return [cb for cb in callbacks if type(cb).__name__ not in MEASUREMENT_SKIPPED_CALLBACKS]

    return MeasurementTrainer


def _torch_trainer(train_loop, *, train_loop_config, name, workers: "WorkerDemand", backend: str, comm_timeout_s: float,
                   storage_path, nodes, failure_config, checkpoint_config, callbacks, measurement: bool = False):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run: dict[str, Any] = {"name": name, "storage_path": str(storage_path)}
    if failure_config is not None:
        run["failure_config"] = failure_config
    if checkpoint_config is not None:
        run["checkpoint_config"] = checkpoint_config
    # Env vars reach every worker before TorchConfig starts the process group.
    run["worker_runtime_env"] = {"env_vars": workers.env} if workers.env else None
    if callbacks is not None:
        run["callbacks"] = callbacks
    scaling: dict[str, Any] = {}
    if nodes and ray_features().label_selector:
        scaling["label_selector"] = placement.pinned_selectors(workers.demand, nodes)
    trainer_class = measurement_trainer_class() if measurement else TorchTrainer
    return trainer_class(
        train_loop,
        train_loop_config=train_loop_config,
        scaling_config=ScalingConfig(num_workers=workers.workers, use_gpu=workers.use_gpu,
                                     resources_per_worker=workers.per_worker, **scaling),
        torch_config=TorchConfig(backend=backend, timeout_s=int(comm_timeout_s)),
        run_config=RunConfig(**run),
    )


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
    them, when given and Ray has per-worker label selectors), the process-group backend and timeout,
    and their env vars in place before the process group starts.

    With a `deadline`: a measurement, a TimedTrainer (fit in a runner actor, the controller trimmed
    by MEASUREMENT_CONTROLLER_ENV), never retried and never letting the controller loop forever.
    Without: Ray's own TorchTrainer, with `failure_config`, `checkpoint_config` and `callbacks`
    (Ray's defaults where None): the training run."""
    import ray

    check_ray_version(ray.__version__)
    kwargs: dict[str, Any] = dict(train_loop_config=train_loop_config, name=name, workers=workers, backend=backend,
                                  comm_timeout_s=comm_timeout_s, storage_path=str(storage_path or default_storage()),
                                  nodes=nodes, failure_config=failure_config, checkpoint_config=checkpoint_config,
                                  callbacks=callbacks)
    if deadline is None:
        ray_features()  # Train V2 in this process (fit() runs here), or say how to get it
        return _torch_trainer(train_loop, **kwargs)
    from ray.train import FailureConfig

    # A trial is a measurement: never retry it, and never let the controller loop forever.
    kwargs.update(failure_config=FailureConfig(max_failures=0, controller_failure_limit=0), checkpoint_config=None,
                  callbacks=None)
    return TimedTrainer(train_loop, kwargs, deadline)


def fit(trainer) -> tuple[Any, BaseException | None]:
    """(Ray Train's Result or None, the error that ended the run or None): never raises."""
    with sigint_handler_kept():  # Ray's TorchTrainer installs it where fit() runs (a runner, a training run)
        try:
            result = trainer.fit()
        except Exception as err:  # noqa: BLE001 - every failure becomes a classified result
            return None, err
    return result, result.error
