"""Where the sweep's trials run: the Tune trainable, the worker-group pool, node leases and pruning.

Each Tune trial is a function trainable (reserving no CPU itself) that runs one measured trial:
in a reused worker group of the sweep's pool (paratune.cluster.session) when there is one, else in a
Ray Train job of its own, on whole nodes leased for it when the plan wants them
(paratune.trial.placement). Plans the cluster can never hold are pruned before anything starts.
Ray is imported where it is used, so the rest of the package loads without it.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from paratune.trial import placement
from paratune.costs.measure import TrialStopRule
from paratune.config.plan import load_plan_dict
from paratune.sweep.space import Space
from paratune.sweep.ledger import OBJECTIVE, SweepError
from paratune.trial.results import TrialResult
from paratune.cluster.launch import worker_demand
from paratune.cluster.trial import run_trial


# --------------------------------------------------------------------------- one trial
def measure_plan(plan: dict[str, Any], stop_rule: dict[str, Any] | None, pool: str | None,
                 storage: str | None = None, leases: str | None = None) -> TrialResult:
    """One measured trial: in a reused worker group of the sweep's pool (paratune.cluster.session, which
    places whole nodes itself) when there is one, else in a worker group of its own, on whole
    nodes leased from the sweep's `leases` actor when the plan wants them (paratune.trial.placement)."""
    rule = TrialStopRule(**stop_rule) if stop_rule else None
    if pool:
        return pool_measure(pool, plan, rule)
    checked = load_plan_dict(plan)
    if leases is None or not placement.exclusive_nodes(checked):
        return run_trial(checked, storage_path=storage, stop_rule=rule)
    import uuid

    demand = worker_demand(checked).demand
    if placement.shortfall(demand, placement.alive_nodes()) is not None:
        return run_trial(checked, storage_path=storage, stop_rule=rule)  # says insufficient_resources
    owner = uuid.uuid4().hex[:8]
    nodes = placement.acquire_nodes(leases, owner, demand, bound_s=checked.trial_timeout_s)
    if nodes is None:
        return TrialResult.failed(checked, "insufficient_resources", f"no {demand.nodes_needed} whole node(s) "
                                  f"came free within trial_timeout_s={checked.trial_timeout_s:g}: {demand.describe()}")
    try:
        return run_trial(checked, storage_path=storage, stop_rule=rule, nodes=nodes)
    finally:
        placement.release_nodes(leases, owner)


def trainable(config: dict[str, Any], *, plans: dict[str, dict], storage: str, pool: str | None = None,
              leases: str | None = None) -> None:
    """One Tune trial = one measured Ray Train trial. Never raises for a failing plan."""
    from ray import tune

    key = config["point"]
    result = measure_plan(plans[key], config.get("stop_rule"), pool, storage, leases)
    tune.report({OBJECTIVE: result.tokens_per_s_per_gpu or 0.0, "point": key,
                 "trial_result": result.model_dump_json()})


def pool_measure(pool: str, plan: dict[str, Any], rule: TrialStopRule | None) -> TrialResult:
    """The trial in one of the pool's worker groups. Never raises for a failing plan."""
    import ray

    from paratune.trial.failures import classify
    from paratune.cluster.pool import get_pool_actor

    try:
        out = ray.get(get_pool_actor(pool).measure.remote(plan, rule._asdict() if rule else None))
    except Exception as err:  # noqa: BLE001 - the pool actor itself died: a failed trial, not a lost sweep
        return TrialResult.failed(plan, *classify(err))
    return TrialResult.model_validate(out)


# --------------------------------------------------------------------------- the cluster
def concurrency(space: Space) -> int:
    """Trials at once: on whole nodes (paratune.trial.placement, default when gpus_per_node is set),
    the nodes that can host one trial's share / the nodes a trial needs, so concurrent trials
    never share a node; else the workers the cluster holds / a trial's workers."""
    plan = max((c.plan for c in space.candidates), key=lambda p: p.num_workers)
    return placement.trials_at_once(worker_demand(plan).demand, placement.alive_nodes())


def device_tag() -> str:
    """What the cluster computes on, as the parent run's tag: 'N GPU' or 'cpu (N CPUs)'."""
    import ray

    res = ray.cluster_resources()
    return f"{int(res.get('GPU', 0))} GPU" if res.get("GPU") else f"cpu ({int(res.get('CPU', 0))} CPUs)"


def prune_unplaceable(space: Space, console: Console) -> Space:
    """Plans this cluster can never hold are removed before anything starts, by rule, with what
    they need and what the cluster has (an autoscaler can add nodes: then nothing is removed,
    and each trial waits for its nodes, bounded). A `device: cuda` space on a cluster with no GPU
    yet waits for one the same way, or is an error: it never falls back to the CPU."""
    import dataclasses

    import ray

    first = space.candidates[0].plan
    if first.device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
        gpu_demand = placement.Demand(1, {"GPU": 1}, None, False)
        missing = placement.wait_for_room(gpu_demand, placement.wait_for_nodes_bound_s(), console.print) \
            if placement.autoscaler_configured() else placement.shortfall(gpu_demand, placement.alive_nodes())
        if missing is not None:
            raise SweepError(f"device: 'cuda' in the space, but {missing.removeprefix('insufficient_resources: ')}; "
                             "start GPU nodes (or set PARATUNE_AUTOSCALER=1 to wait for an autoscaler), or use device: "
                             "auto|cpu")
    if placement.autoscaler_configured():
        return space
    nodes = placement.alive_nodes()
    removed, examples, kept = space.removed.copy(), dict(space.examples), []
    for c in space.candidates:
        demand = worker_demand(c.plan).demand
        missing = placement.shortfall(demand, nodes)
        if missing is None:
            kept.append(c)
            continue
        rule = f"insufficient_resources: needs {demand.describe()}"
        removed[rule] += 1
        examples.setdefault(rule, missing)
    if not kept:
        raise SweepError(f"the cluster cannot hold any plan of the space: {next(iter(examples.values()))}")
    return dataclasses.replace(space, candidates=kept, removed=removed, examples=examples)


# --------------------------------------------------------------------------- worker-group reuse
# The driver holds a handle to each pool it starts: Ray garbage-collects a named actor, groups
# and all, once no handle to it is left, and the trainables' handles come and go with each trial.
_POOL_HANDLES: dict[str, Any] = {}


def start_pool(console: Console) -> str | None:
    """The name of this sweep's pool of reusable worker groups (paratune.cluster.session: a 0-CPU actor
    every trainable reaches by name), or None (every trial then launches its own workers)."""
    try:
        import uuid

        from paratune.cluster.pool import get_pool_actor

        name = f"paratune-sweep-pool-{uuid.uuid4().hex[:8]}"
        _POOL_HANDLES[name] = get_pool_actor(name)
        return name
    except Exception as err:  # noqa: BLE001 - measuring without reuse is slower, not wrong
        console.print(f"[yellow]worker groups will not be reused ({type(err).__name__}: {escape(str(err))[:200]})[/yellow]")
        return None


def start_leases() -> str:
    """The sweep's record of whole nodes held by its trials (paratune.trial.placement.NodeLeases), when
    trials launch their own worker groups; the driver holds the handle (see _POOL_HANDLES)."""
    import uuid

    name = f"paratune-sweep-leases-{uuid.uuid4().hex[:8]}"
    _POOL_HANDLES[name] = placement.get_leases_actor(name)
    return name


def close_leases(name: str) -> None:
    """Ends the sweep's node-lease actor (start_leases)."""
    import ray

    actor = _POOL_HANDLES.pop(name, None)
    if actor is not None:
        ray.kill(actor, no_restart=True)


def close_pool(pool: str) -> None:
    """Closes the pool's worker groups, then ends its actor (start_pool); a pool actor that died
    during the sweep is noted, never raised (the sweep's results stand)."""
    import ray

    from paratune.cluster.pool import get_pool_actor

    actor = _POOL_HANDLES.pop(pool, None) or get_pool_actor(pool)
    try:
        ray.get(actor.close.remote(), timeout=300)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
        # The pool's actor is gone (Ray's memory monitor, a lost node) or stuck: its worker groups
        # went with it or go with its kill below. The sweep's results are already in its ledger;
        # ending it with a traceback here would lose the summary and the winner's files.
        print(f"note: the worker-group pool could not close its groups ({type(err).__name__}); ended instead")
    finally:
        try:
            ray.kill(actor, no_restart=True)
        except (ValueError, ray.exceptions.RayError):  # already gone
            pass


def pool_runner(pool: str | None, request):
    """run_profile's runner: the profile runs in the pool's worker group for the request's
    workers and env (the group the plans with that env then reuse), or None: a group of its own."""
    if pool is None:
        return None
    import ray

    from paratune.cluster.profiling import workers_plan
    from paratune.cluster.pool import get_pool_actor

    def runner(function_path: str, payload: dict[str, Any]) -> dict[str, Any]:
        plan = workers_plan(request).to_dict()
        return ray.get(get_pool_actor(pool).run.remote(plan, function_path, payload, request.timeout_s))

    return runner
