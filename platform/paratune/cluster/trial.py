"""The measured trial's driver side: run_trial, the flow that measures one plan.

Validate, start N workers with the plan's env vars in place before their process group starts
(paratune.cluster.launch), wait, and turn whatever happened into a TrialResult; a failure is a result with a
classified reason, never an exception through the caller. `prepare_trial` and `TrialLaunch` are
that flow (check -> Ray -> demand -> room -> run -> failed or summarized), shared with the reused
worker groups of paratune.cluster.pool. The workers run paratune.trial.worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratune.config import devices
from paratune.costs import measure
from paratune.trial import placement
from paratune.trial.failures import Reason, classify
from paratune.cluster.launch import (
    Deadline,
    WorkerDemand,
    build_trainer,
    ensure_ray,
    fit,
    placement_groups,
    return_value,
    process_group_backend,
    remove_leaked_placement_groups,
    wants_gpu,
    worker_demand,
)
from paratune.config.plan import Plan, PlanError, load_plan_dict
from paratune.trial.results import TrialResult

# Public here too (users import them from paratune.cluster.trial): TrialResult (paratune.trial.results) and
# TrialTimeout (paratune.trial.failures).
from paratune.trial.failures import TrialTimeout  # noqa: F401
from paratune.trial.worker import worker_loop


# transformers imports its classes lazily, and two threads importing the same one at once can see
# a half-initialised module ("cannot import name 'AutoConfig' from 'transformers'"): seen in the
# sweep's worker-group pool, a threaded actor checking two concurrent trials' plans.
_MODEL_CHECK_LOCK = threading.RLock()


def check_before_launch(plan: Plan | dict[str, Any], ray_address: str | None = None) -> tuple[Plan, float] | TrialResult:
    """(the plan, its model FLOPs per token), or the failed result that means no worker should
    start: every rule paratune.checks.refusals collects, and what CPU workers cannot run (a plan on
    device 'auto' with such a lever or cp asks the cluster, joining Ray first)."""
    if not isinstance(plan, Plan):
        try:
            plan = load_plan_dict(plan)
        except PlanError as err:
            return TrialResult.failed(plan, "invalid_config", str(err))
    from paratune.config.model_config import ModelError
    from paratune.checks.refusals import check_plan, device_refusal

    try:
        with _MODEL_CHECK_LOCK:  # one thread at a time: see _MODEL_CHECK_LOCK
            # input files where the command runs, the family's layout rules on the meta device, a user loop's limits
            model_config = check_plan(plan, inputs_source="plan", build=True)
            flops_tok = measure.model_flops_per_token(model_config, plan.seq_len)  # builds it on meta
    except (ModelError, PlanError) as err:
        return TrialResult.failed(plan, "invalid_config", str(err))
    except Exception as err:  # noqa: BLE001 - a config transformers accepts but cannot build
        import traceback

        where = traceback.extract_tb(err.__traceback__)[-1]  # e.g. a file a library looked for
        return TrialResult.failed(plan, "invalid_config", f"model: '{plan.model}' cannot be built: "
                                  f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})")
    # What CPU workers cannot run (cp, async TP), on device 'auto': ask the cluster (device 'cpu': the plan
    # refuses it). The GPU model is not known here: float8 without FP8 is the cost model's refusal.
    if (on_cpu := device_refusal(plan, None, False)) is not None:
        ensure_ray(ray_address)
        if not wants_gpu(plan):
            return TrialResult.failed(plan, "invalid_config", on_cpu)
    return plan, flops_tok


def run_trial(plan: Plan | dict[str, Any], *, storage_path: str | Path | None = None,
              ray_address: str | None = None, stop_rule: measure.TrialStopRule | None = None,
              nodes: list[str] | None = None) -> TrialResult:
    """Run one plan on Ray Train (its own worker group) and measure it. Never raises for a failing
    plan. With a stop rule, a trial that cannot reach the incumbent ends as stopped_early. With
    `nodes` (whole nodes a sweep leased to it: paratune.trial.placement) its workers run there only."""
    launch = prepare_trial(plan, ray_address)
    if isinstance(launch, TrialResult):
        return launch
    plan, workers = launch.plan, launch.workers
    before = set(placement_groups())
    alive = launch.note_nodes()
    if nodes is None and workers.demand.exclusive and len(alive) > 1:  # on its own (no sweep's leases): whole nodes
        nodes = placement.choose_nodes(workers.demand, alive, set())
    trainer = build_trainer(
        worker_loop, {"plan": plan.to_dict(), "stop_rule": stop_rule._asdict() if stop_rule else None},
        name=f"trial-{uuid.uuid4().hex[:8]}", workers=workers, backend=process_group_backend(plan, workers.use_gpu),
        comm_timeout_s=plan.comm_timeout_s, storage_path=storage_path, nodes=nodes,
        deadline=Deadline(plan.trial_timeout_s, start_timeout_s=placement.worker_start_timeout_s()))
    t0, fit_started = time.perf_counter(), time.time()
    result, error = fit(trainer)
    out = return_value(result)
    wall = time.perf_counter() - t0
    if error is not None or out is None:
        remove_leaked_placement_groups(before)
        reason, message = classify(error) if error is not None else ("error", "no result from rank 0")
        return launch.failed(reason, message, wall_s=wall, started_at=fit_started)
    return launch.measured(out, launched_at=fit_started, wall_s=wall, started_at=fit_started, stop_rule=stop_rule)


@dataclass
class TrialLaunch:
    """A checked plan the cluster has room for: what measuring it needs between the launch and
    its result, whichever worker group runs it (its own: run_trial; a reused one: paratune.cluster.pool)."""

    plan: Plan
    flops_per_token: float
    workers: WorkerDemand
    waited_s: float  # for an autoscaler's nodes (0 when none was needed)
    t0: float  # perf_counter when the launch began (after the plan's checks)
    started_at: float  # epoch seconds then
    nodes_at_start: set[str] = dataclasses.field(default_factory=set)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def note_nodes(self) -> list[placement.NodeRoom]:
        """The alive nodes now, remembered: a node gone by the end makes a failure node_lost."""
        alive = placement.alive_nodes()
        self.nodes_at_start = {n.node_id for n in alive}
        return alive

    def setup_failed(self, err: BaseException) -> TrialResult:
        """Ray (or the worker group) failed before the plan ran: a result, not a raise."""
        return TrialResult.failed(self.plan, *classify(err), wall_s=self.elapsed())

    def failed(self, reason: Reason, message: str, *, wall_s: float, started_at: float,
               result_type: type[TrialResult] = TrialResult, **fields: Any) -> TrialResult:
        """The run failed: its reason (node_lost when a node died meanwhile), wall time, wait."""
        reason, message = node_lost_or(reason, message, self.nodes_at_start)
        return result_type.failed(self.plan, reason, message, wall_s=wall_s, waited_for_nodes_s=self.waited_s or None,
                                  started_at=started_at, **fields)

    def measured(self, out: dict[str, Any], *, launched_at: float, wall_s: float | None, started_at: float,
                 stop_rule: measure.TrialStopRule | None, result_type: type[TrialResult] = TrialResult,
                 **fields: Any) -> TrialResult:
        """Rank 0's measurements summarized; launch_s counts from `launched_at` (epoch seconds)."""
        out["launch_s"] = out.pop("first_step_epoch_s") - launched_at
        result = summarize(self.plan, out, self.flops_per_token, wall_s, stop_rule)
        update = {"waited_for_nodes_s": self.waited_s or None, "started_at": started_at, **fields}
        if result_type is TrialResult:
            return result.model_copy(update=update)
        return result_type(**{**result.model_dump(), **update})


def prepare_trial(plan: Plan | dict[str, Any], ray_address: str | None = None, *,
                  setup_errors_are_results: bool = False) -> TrialLaunch | TrialResult:
    """The flow's first half: the plan's checks, Ray joined, the workers' demand, room for them
    on the cluster (waiting for an autoscaler's nodes, bounded). A failed TrialResult when no
    worker should start. `setup_errors_are_results`: Ray failing here (e.g. unreachable) is a
    failed result too (the pool's way; run_trial lets it raise)."""
    checked = check_before_launch(plan, ray_address)
    if isinstance(checked, TrialResult):
        return checked
    plan, flops_tok = checked
    t0, started_at = time.perf_counter(), time.time()
    try:
        ensure_ray(ray_address)
        workers = worker_demand(plan)
        missing, waited = placement.ensure_room(workers.demand)
    except Exception as err:  # noqa: BLE001 - only when asked for: a result, not a raise
        if not setup_errors_are_results:
            raise
        return TrialResult.failed(plan, *classify(err), wall_s=time.perf_counter() - t0)
    if missing is not None:  # nothing started: the cluster cannot hold it (named: needs / has)
        return TrialResult.failed(plan, "insufficient_resources", missing, wall_s=waited, waited_for_nodes_s=waited)
    return TrialLaunch(plan, flops_tok, workers, waited, t0, started_at)


def node_lost_or(reason: Reason, message: str, nodes_at_start: set[str]) -> tuple[Reason, str]:
    """A trial whose workers died (or whose peers timed out waiting for them) while a node of the
    cluster died is node_lost, naming the node: the node, not the plan, failed."""
    if reason not in ("worker_died", "comm_timeout", "hang", "error"):
        return reason, message
    from paratune.trial.placement import alive_nodes

    try:
        gone = sorted(nodes_at_start - {n.node_id for n in alive_nodes()})
    except Exception:  # noqa: BLE001 - Ray unreachable: keep what the error said
        return reason, message
    if not gone:
        return reason, message
    return "node_lost", f"node(s) {', '.join(g[:8] for g in gone)} died during the trial; {message}"[:500]


def summarize(plan: Plan, out: dict[str, Any], flops_tok: float, wall_s: float | None = None,
              stop_rule: measure.TrialStopRule | None = None) -> TrialResult:
    """Turn a worker's raw measurements into the trial's numbers (partial ones for a trial
    stopped early: its figures are over the measured steps it ran)."""
    step_times = out["step_times_s"]
    stopped = bool(out.get("stopped_early"))
    message = stop_rule.explain(plan.tokens_per_step, step_times, plan.num_workers, plan.measure_steps) \
        if stopped and stop_rule is not None else ("stopped early" if stopped else None)
    stats = measure.step_stats(step_times)
    expert_tokens = out.get("expert_tokens") or []
    worst_balance, layer_balance = measure.routing_summary(expert_tokens)
    tps = measure.tokens_per_second_per_gpu(plan.tokens_per_step, step_times, plan.num_workers)
    peak = devices.device_peak_flops(out.get("device", "cpu"), plan.precision)
    return TrialResult(
        status="stopped_early" if stopped else "ok", message=message,
        plan=plan.to_dict(), world_size=plan.num_workers, device=out.get("device", "cpu"),
        tokens_per_step=plan.tokens_per_step, tokens_per_s_per_gpu=tps,
        step_time_median_s=stats.median, step_time_p10_s=stats.p10, step_time_p90_s=stats.p90,
        step_time_spread=stats.spread, mfu=measure.mfu(tps, flops_tok, peak), flops_per_token=flops_tok,
        peak_memory_bytes=out.get("peak_memory_bytes", []), memory_method=out.get("memory_method"),
        local_parameter_counts=out.get("local_parameter_counts", []),
        comm_share=out.get("comm_share"), comm_method=out.get("comm_method"),
        data_wait_s=measure.median(out["data_wait_s"]) if out.get("data_wait_s") else None,
        data_wait_share=measure.share_of_steps(out.get("data_wait_s"), step_times),
        all_to_all_share=out.get("all_to_all_share"), routing_balance=worst_balance,
        routing_balance_per_layer=layer_balance, expert_tokens=expert_tokens, routing_method=out.get("routing_method"),
        construction_peak_bytes=out.get("construction_peak_bytes", []),
        construction_method=out.get("construction_method"), construction_s=out.get("construction_s"),
        linear_matmul_dtypes=out.get("linear_matmul_dtypes", {}), optimizer_class=out.get("optimizer_class"),
        model_init=out.get("model_init"),
        losses=out["losses"], step_times_s=step_times, launch_s=out.get("launch_s"), wall_s=wall_s,
        compile_s=out.get("compile_s"), compile_graphs=out.get("compile_graphs"),
        loss_form=out.get("loss_form"), loss_form_fallback=out.get("loss_form_fallback"),
        env_seen=out.get("env_seen", {}), placement=out.get("placement", []),
    )
