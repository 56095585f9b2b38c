"""The sweep's worker-group pool: reused worker groups (paratune.cluster.session) by key, shared through one Ray actor.

`SessionPool` keeps groups by key (thread-safe) and makes room for a new one by closing idle
groups of other keys; `SessionPool.measure` is the trial (paratune.cluster.trial's flow) in a group of
the plan's key. `get_pool_actor` wraps a pool in a 0-CPU threaded Ray actor, so the sweep's
trainables (each in its own process) can share one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from paratune.costs import measure
from paratune.trial import placement
from paratune.trial.failures import classify
from paratune.cluster.launch import ensure_ray, process_group_backend, worker_demand
from paratune.config.plan import Plan, load_plan_dict
from paratune.trial.results import SessionTrialResult, TrialResult
from paratune.cluster.session import (
    DEFAULT_GROUP_LIFETIME_S,
    MEASURE_FUNCTION,
    GroupKey,
    RequestFailed,
    WorkerSession,
)
from paratune.cluster.trial import prepare_trial

DEFAULT_POOL_NAME = "paratune-session-pool"


class SessionPool:
    """Worker groups by GroupKey: an idle group of the right key is reused; a new one is started
    after closing idle groups of other keys (least recently used first) until it fits.

    It fits when at most `max_groups` groups stay alive, or (max_groups None) when the cluster's
    resources (GPUs, CPUs, ...) hold every alive group's workers plus the new ones. When busy
    groups hold what is missing, the caller waits for one to come back. Thread-safe."""

    def __init__(self, max_groups: int | None = None, *, storage_path: str | Path | None = None,
                 ray_address: str | None = None, lifetime_s: float = DEFAULT_GROUP_LIFETIME_S,
                 max_requests_per_group: int | None = None):
        self.max_groups = max_groups
        # A group is replaced after this many requests (None: never), should a long run show
        # something creeping in its processes (e.g. memory a library never gives back).
        self.max_requests_per_group = max_requests_per_group
        self.storage_path = storage_path
        self.ray_address = ray_address
        self.lifetime_s = lifetime_s
        self._sessions: list[WorkerSession] = []
        self._cond = threading.Condition()
        self._closed = False

    # ----------------------------------------------------------------- requests
    def measure(self, plan: Plan | dict[str, Any], stop_rule: measure.TrialStopRule | None = None) -> TrialResult:
        """The trial (as run_trial) in a group of the plan's key. Never raises for a failing plan.

        launch_s: the request's submission to the first step (a fresh group's start included);
        wall_s: the request's wall time."""
        launch = prepare_trial(plan, self.ray_address, setup_errors_are_results=True)
        if isinstance(launch, TrialResult):
            return launch  # an invalid plan never reaches the workers; nor one the cluster cannot hold
        plan = launch.plan
        try:
            session = self._acquire(GroupKey.for_workers(launch.workers))
        except Exception as err:  # noqa: BLE001 - e.g. Ray unreachable: a result, not a raise
            return launch.setup_failed(err)
        payload = {"plan": plan.to_dict(), "stop_rule": stop_rule._asdict() if stop_rule else None}
        launch.note_nodes()
        try:
            out = session.run(MEASURE_FUNCTION, payload, plan.trial_timeout_s,
                              backend=process_group_backend(plan, launch.workers.use_gpu),
                              comm_timeout_s=plan.comm_timeout_s)
        except RequestFailed as err:
            return launch.failed(err.reason, err.message, wall_s=launch.elapsed(), started_at=launch.started_at,
                                 result_type=SessionTrialResult, group_id=session.id, group_request=session.submitted)
        except Exception as err:  # noqa: BLE001
            return launch.failed(*classify(err), wall_s=launch.elapsed(), started_at=launch.started_at,
                                 result_type=SessionTrialResult, group_id=session.id)
        finally:
            self._release(session)
        info = out.pop("session")
        return launch.measured(out, launched_at=info["submitted_epoch_s"], wall_s=info["wall_s"],
                               started_at=launch.started_at, stop_rule=stop_rule, result_type=SessionTrialResult,
                               group_id=info["group_id"], group_request=info["request"], worker_pids=info["pids"])

    def run(self, plan: Plan | dict[str, Any], function_path: str, payload: dict[str, Any],
            timeout_s: float | None = None) -> dict[str, Any]:
        """`module:function(payload, rank, world, local_world, device)` on every rank of a group
        of the plan's key, with its backend and comm timeout (timeout default: the plan's
        trial_timeout_s). Rank 0's dict plus `session`. Raises RequestFailed (reason, message)."""
        plan = plan if isinstance(plan, Plan) else load_plan_dict(plan)
        ensure_ray(self.ray_address)
        workers = worker_demand(plan)
        session = self._acquire(GroupKey.for_workers(workers))
        try:
            return session.run(function_path, payload, float(timeout_s or plan.trial_timeout_s),
                               backend=process_group_backend(plan, workers.use_gpu), comm_timeout_s=plan.comm_timeout_s)
        finally:
            self._release(session)

    # ----------------------------------------------------------------- groups
    def _fits(self, key: GroupKey, alive: list[WorkerSession]) -> bool:
        if self.max_groups is not None:
            return len(alive) + 1 <= self.max_groups
        if key.exclusive:  # whole nodes nobody else's group holds
            return self._free_nodes(key, alive) is not None
        import ray

        total = ray.cluster_resources()
        held: dict[str, float] = {}
        for session in alive:
            for kind, amount in session.key.demand().items():
                held[kind] = held.get(kind, 0.0) + amount
        return all(held.get(kind, 0.0) + amount <= total.get(kind, 0.0) + 1e-9
                   for kind, amount in key.demand().items())

    @staticmethod
    def _free_nodes(key: GroupKey, alive: list[WorkerSession]) -> list[str] | None:
        """Whole nodes for a group of an exclusive key that no alive group holds (the pool is the
        sweep's only source of worker groups, so it is the record of who holds which node); None
        while a shared group is alive (its workers could be on any node) or too few are free."""
        if any(not s.key.exclusive for s in alive):
            return None
        held = {node for s in alive for node in s.nodes}
        return placement.choose_nodes(key.placement_demand, placement.alive_nodes(), held)

    def _acquire(self, key: GroupKey) -> WorkerSession:
        """An idle group of `key` (marked busy), or a new one once there is room for it."""
        while True:
            with self._cond:
                if self._closed:
                    raise RuntimeError("session pool is closed")
                # Ended while idle (a worker died), or served its share: closed before anything
                # starts, so the resources they free are free when the new group asks for them.
                done = [s for s in self._sessions if not s.busy and (s.ended or self._retired(s))]
                if not done:
                    for session in self._sessions:
                        if session.key == key and not session.busy:
                            session.busy = True
                            return session
                    idle = sorted((s for s in self._sessions if not s.busy), key=lambda s: s.last_used)
                    alive, victims = list(self._sessions), []
                    while not self._fits(key, alive) and idle:
                        victims.append(idle.pop(0))
                        alive.remove(victims[-1])
                    if self._fits(key, alive) or not any(s.busy for s in alive):
                        nodes = self._free_nodes(key, alive) if key.exclusive and self.max_groups is None else None
                        session = WorkerSession(key, storage_path=self.storage_path, lifetime_s=self.lifetime_s,
                                                start=False, nodes=nodes)
                        session.busy = True
                        self._sessions = alive + [session]
                        break
                    self._cond.wait(5)  # busy groups hold what is missing: wait for one to come back
                    continue
                self._sessions = [s for s in self._sessions if s not in done]
            for session in done:
                session.close()
        try:
            for victim in victims:  # their workers must be gone before the new group asks for room
                victim.close()
            session.start()
        except Exception:
            session.close()
            self._release(session)
            raise
        return session

    def _retired(self, session: WorkerSession) -> bool:
        """Served its share: `max_requests_per_group`, or its one plan (a single-use key: async TP)."""
        limit = 1 if session.key.single_use else self.max_requests_per_group
        return limit is not None and session.requests_served >= limit

    def _release(self, session: WorkerSession) -> None:
        with self._cond:
            session.busy = False
            session.last_used = time.monotonic()
            if session.ended and session in self._sessions:
                self._sessions.remove(session)
            self._cond.notify_all()

    def groups(self) -> list[dict[str, Any]]:
        with self._cond:
            return [s.describe() for s in self._sessions]

    def close(self) -> None:
        """End every group (a running request is aborted after a grace period)."""
        with self._cond:
            self._closed = True
            sessions, self._sessions = self._sessions, []
            self._cond.notify_all()
        for session in sessions:
            session.close()

    def __enter__(self) -> "SessionPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- the pool as an actor
class PoolActor:
    """A SessionPool in a threaded Ray actor, shared by the sweep's trainables (each in its own
    process). It reserves no CPU: the workers of its groups hold the cluster's."""

    def __init__(self, max_groups: int | None = None, storage_path: str | None = None,
                 max_requests_per_group: int | None = None):
        self.pool = SessionPool(max_groups, storage_path=storage_path, max_requests_per_group=max_requests_per_group)

    def measure(self, plan: dict[str, Any], stop_rule: dict[str, Any] | None = None) -> dict[str, Any]:
        """SessionTrialResult as a dict (TrialResult.model_validate accepts it)."""
        rule = measure.TrialStopRule(**stop_rule) if stop_rule else None
        return self.pool.measure(plan, rule).model_dump()

    def run(self, plan: dict[str, Any], function_path: str, payload: dict[str, Any],
            timeout_s: float | None = None) -> dict[str, Any]:
        return self.pool.run(plan, function_path, payload, timeout_s)

    def groups(self) -> list[dict[str, Any]]:
        return self.pool.groups()

    def close(self) -> None:
        self.pool.close()


def get_pool_actor(name: str = DEFAULT_POOL_NAME, *, namespace: str | None = None, detached: bool = False,
                   max_groups: int | None = None, storage_path: str | None = None,
                   max_requests_per_group: int | None = None, max_concurrency: int = 64):
    """The named pool actor, created on first use (get_if_exists: every trainable gets the same;
    the options count only for the call that creates it). Create it in the sweep's driver before
    the trials start: a non-detached actor dies with the process that created it, so one made by
    a trainable would go (and its groups with it) when that trial ends. Detached: it outlives
    every process (call close.remote(), then ray.kill it). Its methods: measure(plan_dict, stop_rule_dict
    or None) -> SessionTrialResult dict; run(plan_dict, function_path, payload, timeout_s=None) ->
    dict (raises RequestFailed); groups() -> list[dict]; close().
    It runs on the caller's node (the driver's: the head on a cluster), as Ray Train pins its
    controller there: a 0-CPU actor may otherwise land on any node, and when that node dies, every
    worker group of the sweep (whose runners and Train controllers it owns) goes with it."""
    import ray

    return ray.remote(PoolActor).options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached" if detached else None,
        num_cpus=0, max_concurrency=max_concurrency, scheduling_strategy=placement.on_this_node(),
    ).remote(max_groups, storage_path, max_requests_per_group)
