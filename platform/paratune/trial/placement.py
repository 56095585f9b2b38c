"""Where a trial's ranks run, and whether that keeps the plan's promises.

Ray Train packs a trial's workers wherever there is room and numbers them node by node, so on a
cluster of several nodes (with other trials running, or nodes partly used) a tensor-parallel
group (consecutive ranks) can straddle two nodes and ranks can see different local world sizes.
paratune never lets that pass silently:

- on the driver, before any worker starts: can the cluster hold the plan at all
  (`shortfall`: `insufficient_resources`, naming what it needs and what the cluster has), or,
  with an autoscaler, wait for it with a visible message and a bound (`wait_for_room`);
- whole nodes for a trial (`NodeLeases`, default when the plan sets `gpus_per_node`): a sweep
  leases nodes to one trial at a time and pins its workers to them (Ray Train's per-worker
  label selectors), so concurrent trials never share a node and never disturb each other's
  figures, and the ranks of one node are exactly the ranks the plan gives it;
- on every rank, before the first step: the layout is gathered (`gather_layout`) and checked
  (`placement_violations`); a tp group or a hybrid-sharding group across nodes, or a node with
  more ranks than `gpus_per_node`, ends the trial as `invalid_placement` with the actual layout.
  Every trial records its layout (node, local rank) in its result and in MLflow.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from paratune.config.plan import Plan

# Ray's built-in node label (ray._raylet.RAY_NODE_ID_KEY): every node carries its own id.
NODE_ID_LABEL = "ray.io/node-id"
# How long a sweep waits for an autoscaler to bring nodes up, unless the space says otherwise.
DEFAULT_WAIT_FOR_NODES_S = 900.0


class PlacementError(RuntimeError):
    """The ranks were placed in a way the plan cannot run correctly or be measured fairly."""

    def __init__(self, message: str):
        super().__init__(f"invalid_placement: {message}")


# --------------------------------------------------------------------------- worker side
@dataclass(frozen=True)
class RankPlace:
    rank: int
    node_id: str
    node_ip: str
    local_rank: int
    local_world_size: int


def this_rank_place(rank: int, local_world: int) -> RankPlace:
    """This rank's node (Ray's node id and IP) and local rank (Ray Train's), or, in a process
    group started without Ray (the tests' gloo harness, the GPU bench), the host.

    Ray is looked up, not imported: a process that runs under Ray has imported it already, and
    one that has not (the GPU acceptance run, on an image without Ray) must not need it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        import ray.train

        try:
            local_rank = ray.train.get_context().get_local_rank()
        except Exception:  # noqa: BLE001 - a Ray task outside Ray Train
            local_rank = rank % max(1, local_world)
        return RankPlace(rank, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                         local_rank, local_world)
    import socket

    return RankPlace(rank, socket.gethostname(), "127.0.0.1", rank % max(1, local_world), local_world)


def gather_layout(place: RankPlace, world: int) -> list[RankPlace]:
    """Every rank's place, on every rank (one all_gather_object on the trial's process group)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, asdict(place))
    return by_node_id([RankPlace(**g) for g in sorted(gathered, key=lambda g: g["rank"])])


def by_node_id(layout: list[RankPlace]) -> list[RankPlace]:
    """Local rank and local world size by Ray node id. Ray Train groups ranks by node IP, which
    two raylets on one host share (the multi-node test cluster; containers on one machine); the
    node id is what a node is."""
    nodes = ranks_by_node(layout)
    return [RankPlace(p.rank, p.node_id, p.node_ip, nodes[p.node_id].index(p.rank), len(nodes[p.node_id]))
            for p in layout]


def ranks_by_node(layout: list[RankPlace]) -> dict[str, list[int]]:
    nodes: dict[str, list[int]] = {}
    for p in layout:
        nodes.setdefault(p.node_id, []).append(p.rank)
    return nodes


def describe(layout: list[RankPlace]) -> str:
    """'node 10.0.0.5 (ab12cd34): ranks 0-2; node 10.0.0.6 (ef56ab78): rank 3'."""
    ip = {p.node_id: p.node_ip for p in layout}
    parts = []
    for node, ranks in ranks_by_node(layout).items():
        span = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
            else ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
        parts.append(f"node {ip[node]} ({node[:8]}): {span}")
    return "; ".join(parts)


def node_local_groups(plan: Plan) -> list[tuple[str, int]]:
    """The rank groups the plan needs inside one node, as (name, consecutive ranks per group):
    a tp group (tp innermost), and under hybrid sharding a shard group with its cp and tp ranks
    (paratune.parallel.dims: pp x dp_replicate x dp_shard x cp x tp)."""
    groups = []
    if plan.tp > 1:
        groups.append(("tp group", plan.tp))
    if plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.sharding == "hybrid":
        shard = plan.fsdp.shard_group_size or (plan.gpus_per_node // plan.tp if plan.gpus_per_node else None)
        if shard:
            groups.append(("hybrid shard group", shard * plan.cp * plan.tp))
    return groups


def placement_violations(plan: Plan, layout: list[RankPlace]) -> list[str]:
    """What the layout breaks (empty: it keeps every promise). Pure: a unit test feeds it layouts."""
    node_of = {p.rank: p.node_id for p in layout}
    problems = []
    for name, size in node_local_groups(plan):
        for start in range(0, len(layout), size):
            nodes = {node_of[r] for r in range(start, min(start + size, len(layout)))}
            if len(nodes) > 1:
                problems.append(f"{name} of ranks {start}-{start + size - 1} spans {len(nodes)} nodes")
    per_node = ranks_by_node(layout)
    if plan.gpus_per_node:
        for node, ranks in per_node.items():
            if len(ranks) > plan.gpus_per_node:
                problems.append(f"{len(ranks)} ranks on node {node[:8]}, more than gpus_per_node {plan.gpus_per_node}")
    hybrid = plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.sharding == "hybrid"
    if hybrid and plan.fsdp.shard_group_size is None and not plan.gpus_per_node \
            and len({len(r) for r in per_node.values()}) > 1:
        problems.append("hybrid sharding without shard_group_size or gpus_per_node needs the same number of ranks "
                        f"on every node, got {sorted(len(r) for r in per_node.values())}")
    return problems


def check_layout(plan: Plan, layout: list[RankPlace]) -> int:
    """The local world size every rank must use (the same on all ranks: a mesh built from each
    rank's own local world would differ between ranks and hang), or PlacementError."""
    problems = placement_violations(plan, layout)
    if problems:
        hint = "" if plan.gpus_per_node else "; set gpus_per_node so that paratune places whole nodes"
        raise PlacementError(f"{'; '.join(problems)} (layout: {describe(layout)}){hint}")
    return min(len(r) for r in ranks_by_node(layout).values())


def place_and_check(plan: Plan, rank: int, world: int, local_world: int) -> tuple[list[RankPlace], int]:
    """Worker side, before the model is built: (the trial's layout, the agreed local world)."""
    layout = gather_layout(this_rank_place(rank, local_world), world)
    return layout, check_layout(plan, layout)


# --------------------------------------------------------------------------- driver side
@dataclass(frozen=True)
class NodeRoom:
    node_id: str
    ip: str
    resources: dict[str, float]  # what the node has in total (trial workers come and go)


def alive_nodes() -> list[NodeRoom]:
    import ray

    return [NodeRoom(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def workers_on(resources: dict[str, float], per_worker: dict[str, float]) -> int:
    """How many workers a node can host at once."""
    counts = [resources.get(k, 0.0) / v for k, v in per_worker.items() if v > 0]
    return int(math.floor(min(counts) + 1e-9)) if counts else 0


@dataclass(frozen=True)
class Demand:
    """What one trial needs of the cluster."""

    workers: int
    per_worker: dict[str, float]
    slots_per_node: int | None  # the plan's gpus_per_node: ranks per node, at most
    exclusive: bool  # whole nodes, never shared with another trial

    @property
    def ranks_per_node(self) -> int:
        return min(self.workers, self.slots_per_node or self.workers)

    @property
    def nodes_needed(self) -> int:
        return math.ceil(self.workers / self.ranks_per_node) if self.exclusive else 1

    def describe(self) -> str:
        res = ", ".join(f"{k} {v:g}" for k, v in sorted(self.per_worker.items()))
        what = f"{self.workers} workers x {{{res}}}"
        if self.exclusive:
            what += f" on {self.nodes_needed} whole node(s) of >= {self.ranks_per_node} worker(s) each"
        return what


def exclusive_nodes(plan: Plan) -> bool:
    """A trial on whole nodes: the plan's `exclusive_nodes`, else on when `gpus_per_node` is set."""
    return plan.exclusive_nodes if plan.exclusive_nodes is not None else plan.gpus_per_node is not None


def demand_for(plan: Plan, per_worker: dict[str, float]) -> Demand:
    return Demand(plan.num_workers, dict(per_worker), plan.gpus_per_node, exclusive_nodes(plan))


def nodes_that_fit(demand: Demand, nodes: list[NodeRoom]) -> list[NodeRoom]:
    """Nodes that can host the ranks one node of the trial gets."""
    return [n for n in nodes if workers_on(n.resources, demand.per_worker) >= demand.ranks_per_node]


def shortfall(demand: Demand, nodes: list[NodeRoom]) -> str | None:
    """Why the cluster (by its total resources, ignoring what runs now) can never hold the trial,
    or None. The message names what it needs and what the cluster has."""
    if demand.exclusive:
        ok = len(nodes_that_fit(demand, nodes)) >= demand.nodes_needed
    else:
        ok = sum(workers_on(n.resources, demand.per_worker) for n in nodes) >= demand.workers
    if ok:
        return None
    keys = sorted(demand.per_worker)
    has = "; ".join(f"{n.ip} ({n.node_id[:8]}): " + ", ".join(f"{k} {n.resources.get(k, 0):g}" for k in keys)
                    + f" -> {workers_on(n.resources, demand.per_worker)} worker(s)" for n in nodes) or "no alive node"
    return f"insufficient_resources: the plan needs {demand.describe()}; the cluster has {len(nodes)} node(s): {has}"


def trials_at_once(demand: Demand, nodes: list[NodeRoom]) -> int:
    """How many such trials the cluster runs side by side: whole nodes / nodes per trial when
    exclusive, else workers it holds / workers per trial (at least 1)."""
    if demand.exclusive:
        return max(1, len(nodes_that_fit(demand, nodes)) // demand.nodes_needed)
    return max(1, sum(workers_on(n.resources, demand.per_worker) for n in nodes) // demand.workers)


def pinned_selectors(demand: Demand, node_ids: list[str]) -> list[dict[str, str]]:
    """Ray Train's per-worker label selectors: the first ranks_per_node workers on the first
    node, and so on (Ray Train numbers ranks node by node, so each node gets consecutive ranks)."""
    per = demand.ranks_per_node
    return [{NODE_ID_LABEL: node_ids[i // per]} for i in range(demand.workers)]


def choose_nodes(demand: Demand, nodes: list[NodeRoom], held: set[str]) -> list[str] | None:
    """Whole nodes for one trial among those nobody holds (None: not enough free now)."""
    free = [n for n in nodes_that_fit(demand, nodes) if n.node_id not in held]
    if len(free) < demand.nodes_needed:
        return None
    return [n.node_id for n in free[: demand.nodes_needed]]


def autoscaler_configured() -> bool:
    """Whether nodes can still come: PARATUNE_AUTOSCALER=1|0 says so; else the cluster
    launcher's autoscaling config on the driver's node (the head: `ray up` writes
    ~/ray_bootstrap_config.yaml, and ray_cluster.yaml starts Ray with it)."""
    flag = os.environ.get("PARATUNE_AUTOSCALER")
    if flag is not None:
        return flag.strip().lower() in ("1", "true", "yes")
    return Path("~/ray_bootstrap_config.yaml").expanduser().exists()


def request_nodes(demand: Demand | None) -> None:
    """Ask the autoscaler for the trial's workers (None: withdraw the request). Best effort."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[demand.per_worker] * demand.workers if demand else [])
    except Exception:  # noqa: BLE001 - without an autoscaler there is nothing to ask
        pass


def wait_for_room(demand: Demand, bound_s: float, say: Callable[[str], None], *, poll_s: float = 5.0,
                  nodes: Callable[[], list[NodeRoom]] = alive_nodes,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Wait (visibly, at most bound_s) until the cluster can hold the trial; None when it can,
    else the shortfall. Used only when an autoscaler can add nodes."""
    start = clock()
    missing = shortfall(demand, nodes())
    if missing is None:
        return None
    request_nodes(demand)
    last_said = -math.inf
    try:
        while missing is not None:
            waited = clock() - start
            if waited >= bound_s:
                return f"{missing} (waited {waited:.0f} s for the autoscaler, the bound)"
            if waited - last_said >= 30 or last_said == -math.inf:
                say(f"waiting for nodes ({waited:.0f} s of at most {bound_s:.0f} s): "
                    f"{missing.removeprefix('insufficient_resources: ')}")
                last_said = waited
            sleep(poll_s)
            missing = shortfall(demand, nodes())
        return None
    finally:
        request_nodes(None)


def wait_for_nodes_bound_s() -> float:
    """How long a trial may wait for an autoscaler's nodes (PARATUNE_WAIT_FOR_NODES_S)."""
    return float(os.environ.get("PARATUNE_WAIT_FOR_NODES_S", DEFAULT_WAIT_FOR_NODES_S))


def ensure_room(demand: Demand, say: Callable[[str], None] = print) -> tuple[str | None, float]:
    """Before any worker starts: (why the cluster cannot hold the trial, or None; seconds waited
    for an autoscaler). Without an autoscaler a shortfall is final at once."""
    t0 = time.monotonic()
    missing = shortfall(demand, alive_nodes())
    if missing is not None and autoscaler_configured():
        missing = wait_for_room(demand, wait_for_nodes_bound_s(), say)
    return missing, time.monotonic() - t0


def worker_start_timeout_s() -> float | None:
    """Ray Train's worker-group start timeout for a trial (60 s by default): with an autoscaler,
    the wait bound, so a trial whose nodes are still booting is not failed after a minute."""
    return wait_for_nodes_bound_s() if autoscaler_configured() else None


# --------------------------------------------------------------------------- whole-node leases
class NodeLeases:
    """Which nodes each running trial holds (a named actor per sweep, so every trainable and the
    worker-group pool see one record). A trial takes whole nodes or nothing."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}  # node id -> owner

    def acquire(self, owner: str, demand: dict[str, Any], nodes: list[dict[str, Any]]) -> list[str] | None:
        chosen = choose_nodes(Demand(**demand), [NodeRoom(**n) for n in nodes], set(self.held))
        for node in chosen or []:
            self.held[node] = owner
        return chosen

    def release(self, owner: str) -> int:
        mine = [n for n, o in self.held.items() if o == owner]
        for node in mine:
            del self.held[node]
        return len(mine)

    def holders(self) -> dict[str, str]:
        return dict(self.held)


def on_this_node():
    """A scheduling strategy that keeps an actor on the caller's node (the driver's), never on a
    worker node that may die under it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def get_leases_actor(name: str):
    """The sweep's named NodeLeases actor (created on first use, 0 CPUs, on the driver's node)."""
    import ray

    return ray.remote(NodeLeases).options(name=name, get_if_exists=True, num_cpus=0, lifetime=None,
                                          scheduling_strategy=on_this_node()).remote()


def acquire_nodes(leases_name: str, owner: str, demand: Demand, bound_s: float,
                  say: Callable[[str], None] = print, poll_s: float = 1.0) -> list[str] | None:
    """Whole nodes for a trial from the sweep's leases, waiting while other trials hold them
    (they finish), at most bound_s; None when the bound passed."""
    import ray

    actor = get_leases_actor(leases_name)
    start = time.monotonic()
    while True:
        got = ray.get(actor.acquire.remote(owner, asdict(demand), [asdict(n) for n in alive_nodes()]))
        if got is not None:
            return got
        if time.monotonic() - start > bound_s:
            return None
        time.sleep(poll_s)


def release_nodes(leases_name: str, owner: str) -> None:
    import ray

    try:
        ray.get(get_leases_actor(leases_name).release.remote(owner), timeout=30)
    except Exception:  # noqa: BLE001 - the sweep's actor is gone: nothing is held any more
        pass
