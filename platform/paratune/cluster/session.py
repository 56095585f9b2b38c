"""Launch once, measure many: one reused Ray Train worker group (WorkerSession) serving plans in turn.

Starting a Ray Train worker group costs 10-30 s, a plan's measured steps a few seconds. Plans
that need the same workers (world size, per-worker resources, GPU use and worker environment
variables: `GroupKey`) are therefore measured in one long-running TorchTrainer whose train loop
(`_serve`) serves requests from the driver through a small async actor (`_Mailbox`):

- every request runs in a fresh default process group: the last one (and with it every
  subgroup, DeviceMesh and NCCL communicator of the previous plan) is destroyed, and a new one is
  created with the request's backend on a new TCP store rank 0 opens on a free port and publishes
  through the mailbox (not through the old group, which may be NCCL, or broken);
- after it, memory is released (gc, the CUDA cache) and the peaks are reset, so the next plan's
  figures start from the same place as in a fresh process;
- any exception on any rank raises out of the train loop, and Ray Train ends the group (a dead
  worker too; a stuck one past the request's timeout has its controller aborted): that request
  fails with a classified reason, and the next request for the key gets a fresh group.

Environment variables are part of the key because NCCL and gloo read many of them once per
process: a plan whose env differs never reuses a group.

The pool of such groups, shared by a sweep's trainables, is paratune.cluster.pool.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from paratune.costs import measure
from paratune.trial import placement
from paratune.trial.failures import Reason, TrialTimeout, classify
from paratune.config.home import default_storage
from paratune.cluster.launch import (
    Deadline,
    WorkerDemand,
    build_trainer,
    placement_groups,
    remove_leaked_placement_groups,
    remove_placement_group,
)
from paratune.config.plan import Plan, load_plan_dict
from paratune.trial.worker import release_cached_memory, train_and_measure

MEASURE_FUNCTION = "paratune.cluster.session:measure_request"
# A group's own deadline (the controller is aborted past it). Requests have their own timeouts;
# this only bounds a group nobody closes.
DEFAULT_GROUP_LIFETIME_S = 7 * 24 * 3600.0
_POLL_S = 0.25


class RequestFailed(RuntimeError):
    """A request that did not complete on every rank; its worker group has ended."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(message)
        self.reason: Reason = reason
        self.message = message

    def __reduce__(self):  # keeps reason and message through Ray's pickling
        return (RequestFailed, (self.reason, self.message))


@dataclass(frozen=True)
class GroupKey:
    """What two plans must share to be measured in the same worker group."""

    world_size: int
    use_gpu: bool
    resources: tuple[tuple[str, float], ...]  # per worker
    env: tuple[tuple[str, str], ...]  # worker_env(plan, use_gpu), sorted
    slots_per_node: int | None = None  # the plan's gpus_per_node
    exclusive: bool = False  # on whole nodes of its own (paratune.trial.placement)
    single_use: bool = False  # one plan per group (paratune.cluster.launch.WorkerDemand.single_use: async TP)

    @classmethod
    def for_plan(cls, plan: Plan, use_gpu: bool, nodes: list[dict[str, Any]] | None = None) -> "GroupKey":
        """`nodes`: ray.nodes(), for a GPU worker's CPUs (paratune.cluster.launch.worker_resources)."""
        return cls.for_workers(WorkerDemand.for_plan(plan, use_gpu, nodes))

    @classmethod
    def for_workers(cls, workers: WorkerDemand) -> "GroupKey":
        demand = workers.demand
        return cls(demand.workers, workers.use_gpu, tuple(sorted((k, float(v)) for k, v in workers.per_worker.items())),
                   tuple(sorted(workers.env.items())), demand.slots_per_node, demand.exclusive, workers.single_use)

    @property
    def placement_demand(self) -> placement.Demand:
        return placement.Demand(self.world_size, dict(self.resources), self.slots_per_node, self.exclusive)

    @property
    def workers(self) -> WorkerDemand:
        """What the group's workers need of Ray (paratune.cluster.launch.build_trainer's input)."""
        return WorkerDemand(self.use_gpu, dict(self.resources), self.placement_demand, dict(self.env), self.single_use)

    def demand(self) -> dict[str, float]:
        """Cluster resources the whole group holds."""
        return {kind: amount * self.world_size for kind, amount in self.resources}


# --------------------------------------------------------------------------- the mailbox
class _Mailbox:
    """Requests in, rendezvous addresses across, results out: one async actor per group (0 CPUs).

    Every rank takes request `seq` itself (no collective needed to learn it), rank 0 posts the
    new store's address, and every rank reports when done; a result is complete only when all
    ranks have reported, so a request that failed on any rank never looks like a success."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.requests: dict[int, dict[str, Any]] = {}
        self.stores: dict[int, tuple[str, int]] = {}
        self.done: dict[int, dict[int, tuple[int, Any]]] = {}
        self.placement_group: str | None = None
        self.closed = False
        self._cond = None

    def _condition(self):
        import asyncio

        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _set(self, change: Callable[[], None]) -> None:
        cond = self._condition()
        async with cond:
            change()
            cond.notify_all()

    async def _until(self, ready: Callable[[], bool]) -> None:
        cond = self._condition()
        async with cond:
            await cond.wait_for(ready)

    async def submit(self, seq: int, request: dict[str, Any]) -> None:
        await self._set(lambda: self.requests.__setitem__(seq, request))

    async def take(self, seq: int, placement_group: str | None = None) -> dict[str, Any] | None:
        """Request `seq` once submitted; None once the group is closed."""
        if placement_group:
            self.placement_group = placement_group
        await self._until(lambda: self.closed or seq in self.requests)
        return None if self.closed and seq not in self.requests else self.requests[seq]

    async def post_store(self, seq: int, host: str, port: int) -> None:
        await self._set(lambda: self.stores.__setitem__(seq, (host, port)))

    async def store(self, seq: int) -> tuple[str, int]:
        await self._until(lambda: seq in self.stores)
        return self.stores[seq]

    async def finish(self, seq: int, rank: int, pid: int, result: Any) -> None:
        await self._set(lambda: self.done.setdefault(seq, {}).__setitem__(rank, (pid, result)))

    async def result(self, seq: int) -> dict[str, Any]:
        """Rank 0's result and every rank's pid, once all ranks are done."""
        await self._until(lambda: len(self.done.get(seq, {})) == self.world_size)
        done = self.done.pop(seq)
        self.requests.pop(seq, None)
        self.stores.pop(seq, None)
        return {"result": done[0][1], "pids": [done[r][0] for r in range(self.world_size)]}

    async def placement_group_id(self) -> str | None:
        return self.placement_group

    async def close(self) -> None:
        await self._set(lambda: setattr(self, "closed", True))


# --------------------------------------------------------------------------- worker side
def _import_function(path: str) -> Callable[..., dict[str, Any]]:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"function_path: {path!r} is not 'module:function'")
    return getattr(importlib.import_module(module), name)


def _drop_process_groups() -> None:
    """Destroy the default group and every subgroup, and what libraries cache about them."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # all groups: _world is emptied, group names count from 0 again
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:  # DeepSpeed's tp/dp groups and mpu are module globals (see parallel/zero.py)
        groups._release_process_group_references(None)
    random = sys.modules.get("torch.distributed.tensor._random")
    if random is not None:  # DTensor's RNG tracker is created (and seed-synced) once per process
        random._rng_tracker = None
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is not None:  # sharding decisions cached per mesh: a fresh process starts empty
        try:
            api.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        except AttributeError:
            pass


def _init_process_group(mailbox, seq: int, rank: int, world: int, backend: str, timeout_s: float) -> None:
    """A new default group on a new TCP store: rank 0 opens it on a free port (port 0: no race
    with another process) and publishes the address through the mailbox. Same call as Ray Train's
    TorchConfig (`init_process_group(backend, rank, world_size, timeout)`, no device_id: NCCL
    communicators are created lazily, as in a fresh trial)."""
    import ray
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, world, True, timeout, wait_for_workers=False)
        port = int(store.port)
        ray.get(mailbox.post_store.remote(seq, host, port))
    else:
        host, port = ray.get(mailbox.store.remote(seq))
        store = dist.TCPStore(host, port, world, False, timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    if "nccl" in backend and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ \
            and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # what Ray Train's TorchConfig sets
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _release_memory(device) -> None:
    """Free what the last request left and reset the peaks, as a fresh process would start."""
    gc.collect()
    _drop_process_groups()
    gc.collect()
    release_cached_memory(device)  # the device's caches and the pinned host cache of offload plans
    try:  # Linux: reset the process's peak RSS (ru_maxrss, read by the RSS fallbacks) to its current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _serve(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker for a session group: serve requests until closed.

    A request's exception is not caught: it ends the train loop, and Ray Train the group."""
    import ray
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world, local_world = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size()
    device = ray.train.torch.get_device()
    mailbox = config["mailbox"]
    pg = ray.get_runtime_context().get_placement_group_id() if rank == 0 else None
    seq = 0
    while True:
        request = ray.get(mailbox.take.remote(seq, pg))
        if request is None:
            break
        _drop_process_groups()
        _init_process_group(mailbox, seq, rank, world, request["backend"], request["comm_timeout_s"])
        function = _import_function(request["function"])
        result = function(request["payload"], rank, world, local_world, device)
        if rank == 0 and not isinstance(result, dict):
            raise TypeError(f"{request['function']} returned {type(result).__name__}, not a dict")
        _release_memory(device)
        ray.get(mailbox.finish.remote(seq, rank, os.getpid(), result if rank == 0 else None))
        del result
        seq += 1
    _release_memory(device)
    if _ray_destroys_the_group_unchecked():
        # Ray before 2.55 ends a multi-worker group with dist.destroy_process_group() unchecked: with
        # no default group it raises, the group's shutdown stops there and its placement group is
        # never released. Leave it one (gloo, a new store) to destroy.
        _init_process_group(mailbox, seq, rank, world, "gloo", 60)
    return {"requests": seq}


def _ray_destroys_the_group_unchecked() -> bool:
    import re

    import ray

    found = re.match(r"(\d+)\.(\d+)", ray.__version__)
    return found is not None and (int(found.group(1)), int(found.group(2))) < (2, 55)


def probe(payload: dict[str, Any], rank: int, world: int, local_world: int, device) -> dict[str, Any]:
    """A health check of a group: one all-reduce on the request's process group, and what that
    group is. `sleep_s` holds the group that long first (e.g. to see a request's timeout work)."""
    import torch
    import torch.distributed as dist

    time.sleep(float(payload.get("sleep_s", 0)))
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    return {"backend": str(dist.get_backend()), "world": dist.get_world_size(), "all_reduce": float(ones),
            "master_port": int(os.environ.get("MASTER_PORT", 0))}


def measure_request(payload: dict[str, Any], rank: int, world: int, local_world: int, device) -> dict[str, Any]:
    """The trial's worker side as a session function: train_and_measure on one plan."""
    plan = load_plan_dict(payload["plan"])
    rule = measure.TrialStopRule(**payload["stop_rule"]) if payload.get("stop_rule") else None
    return train_and_measure(plan, rank, world, local_world, device, stop_rule=rule)


# --------------------------------------------------------------------------- driver side
GROUP_LIFETIME_MESSAGE = "hang: worker group exceeded its lifetime {deadline_s:.0f}s; workers aborted"


class WorkerSession:
    """One long-running Ray Train worker group serving requests one at a time.

    Once it has ended (closed, a failed request, a dead worker, a timeout) it serves nothing more."""

    def __init__(self, key: GroupKey, *, storage_path: str | Path | None = None,
                 lifetime_s: float = DEFAULT_GROUP_LIFETIME_S, start: bool = True, nodes: list[str] | None = None):
        self.key = key
        self.nodes = nodes or []  # whole nodes it holds (exclusive keys), its workers pinned there
        self.id = uuid.uuid4().hex[:8]
        self.storage_path = str(storage_path or default_storage())
        self.lifetime_s = lifetime_s
        self.requests_served = 0
        self.pids: list[int] = []
        self.last_used = time.monotonic()
        self.busy = False  # set by the pool
        self._seq = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self._trainer = None
        self._mailbox = None
        self._thread: threading.Thread | None = None
        self._before: set[str] = set()
        if start:
            self.start()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    @property
    def submitted(self) -> int:
        """Requests submitted so far (the one running included)."""
        return self._seq

    def start(self) -> None:
        """Start the worker group (in the background: requests wait in the mailbox meanwhile)."""
        import ray

        if self._thread is not None:
            return
        self._before = set(placement_groups())
        self._mailbox = ray.remote(_Mailbox).options(num_cpus=0).remote(self.key.world_size)
        # The timed trainer keeps its runner's handle while the run lasts (its fit() runs there), so a
        # request past its timeout can end the group from another thread; its deadline is the group's life.
        trainer = build_trainer(
            _serve, {"mailbox": self._mailbox}, name=f"session-{self.id}", workers=self.key.workers,
            # Replaced before the first request runs (by the request's backend and timeout). NCCL
            # on GPUs, as Ray Train's default: its communicators are made lazily, so this costs
            # nothing, and a cluster where gloo cannot connect still measures NCCL-only plans.
            backend="nccl" if self.key.use_gpu else "gloo", comm_timeout_s=1800,
            storage_path=self.storage_path, nodes=self.nodes,
            deadline=Deadline(self.lifetime_s, GROUP_LIFETIME_MESSAGE, placement.worker_start_timeout_s()))
        self._trainer = trainer
        self._thread = threading.Thread(target=self._fit, name=f"paratune-session-{self.id}", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            result = self._trainer.fit()
            self._error = result.error
        except BaseException as err:  # noqa: BLE001 - whatever ended the group is the request's failure
            self._error = err
        finally:
            self._ended.set()

    def run(self, function_path: str, payload: dict[str, Any], timeout_s: float, *,
            backend: str | None = None, comm_timeout_s: float | None = None) -> dict[str, Any]:
        """Run `module:function(payload, rank, world, local_world, device)` on every rank in a
        fresh process group; rank 0's dict, plus `session` (group_id, pids, request index,
        submitted_epoch_s, wall_s). Raises RequestFailed (the group has then ended)."""
        import ray

        with self._lock:
            if self.ended or self._mailbox is None:
                raise RequestFailed("error", f"worker group {self.id} has ended")
            seq, self._seq = self._seq, self._seq + 1
            request = {"function": function_path, "payload": payload,
                       "backend": backend or ("nccl" if self.key.use_gpu else "gloo"),
                       "comm_timeout_s": float(comm_timeout_s or timeout_s)}
            submitted, t0 = time.time(), time.perf_counter()
            ray.get(self._mailbox.submit.remote(seq, request))
            ref = self._mailbox.result.remote(seq)
            try:
                reply = self._wait(ref, t0 + timeout_s, timeout_s)
            finally:
                self.last_used = time.monotonic()
            wall = time.perf_counter() - t0
            self.requests_served += 1
            self.pids = reply["pids"]
            out = dict(reply["result"])
            out["session"] = {"group_id": self.id, "pids": reply["pids"], "request": seq + 1,
                              "submitted_epoch_s": submitted, "wall_s": wall}
            return out

    def _wait(self, ref, deadline: float, timeout_s: float) -> dict[str, Any]:
        import ray

        while True:
            ready, _ = ray.wait([ref], timeout=_POLL_S)
            if not ready and self.ended:  # the group ended: a last look, its result may be in
                ready, _ = ray.wait([ref], timeout=_POLL_S)
            if ready:
                try:
                    return ray.get(ready[0])
                except Exception as err:  # noqa: BLE001 - the mailbox died: the group is no use
                    self._abort()
                    raise RequestFailed(*classify(err)) from err
            if self.ended:
                error = self._error or RuntimeError("worker group ended before the request completed")
                self._end_after_failure()
                raise RequestFailed(*classify(error))
            if time.perf_counter() > deadline:
                self._abort()
                error = TrialTimeout(f"hang: request exceeded its timeout of {timeout_s:.0f}s; workers aborted")
                raise RequestFailed(*classify(error))

    def _abort(self) -> None:
        until = time.monotonic() + 30
        while getattr(self._trainer, "runner", None) is None and not self.ended and time.monotonic() < until:
            time.sleep(0.5)  # None until fit has made it
        if self._trainer is not None:
            self._trainer.abort()
        self._ended.wait(90)
        self._end_after_failure()

    def _end_after_failure(self) -> None:
        """The group has ended (or is ending): free its placement group if Ray Train left it."""
        import ray

        self._ended.wait(90)
        pg_id = None
        mailbox, self._mailbox = self._mailbox, None
        if mailbox is not None:
            try:
                pg_id = ray.get(mailbox.placement_group_id.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(mailbox, no_restart=True)
        if pg_id:  # the workers said which one was theirs: remove exactly it
            if placement_groups().get(pg_id) == "CREATED":
                remove_placement_group(pg_id)
        else:  # they never got that far (setup failed): the idle groups made since it started
            # (as run_trial does; a group another thread starts meanwhile is busy, or so new that
            # it is seen idle twice only if its workers take seconds to be placed: a known race)
            remove_leaked_placement_groups(self._before)

    def close(self, timeout_s: float = 60.0) -> None:
        """End the group: its train loop returns, Ray Train shuts the workers down (aborted if
        they do not finish within `timeout_s`, e.g. a request still running)."""
        import ray

        if self._thread is None:
            self._ended.set()
            return
        if self._mailbox is None:  # already ended and cleaned up (a failed request)
            return
        if self.ended and self._error is not None:  # it ended on its own (a worker died while idle)
            self._end_after_failure()
            return
        if not self.ended:
            try:
                ray.get(self._mailbox.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
            self._ended.wait(timeout_s)
        if not self.ended:
            self._abort()
            return
        self._thread.join(5)
        mailbox, self._mailbox = self._mailbox, None
        if mailbox is not None:
            ray.kill(mailbox, no_restart=True)

    def describe(self) -> dict[str, Any]:
        return {"group_id": self.id, "world_size": self.key.world_size, "use_gpu": self.key.use_gpu, "nodes": self.nodes,
                "resources": dict(self.key.resources), "env": dict(self.key.env), "pids": self.pids,
                "requests_served": self.requests_served, "busy": self.busy, "ended": self.ended}
