"""The measured trial: one plan's workers timed (worker side), and run_trial, the flow that measures it.

Driver side (`run_trial`): validate, start N workers with the plan's env vars in place before
their process group starts (paratune.launch), wait, and turn whatever happened into a
TrialResult; a failure is a result with a classified reason, never an exception through the
caller. `prepare_trial` and `TrialLaunch` are that flow (check -> Ray -> demand -> room -> run ->
failed or summarized), shared with the reused worker groups of paratune.pool.

Worker side (`train_and_measure`): build the model identically on every rank, apply the plan's
strategy, run warm-up then measured whole optimizer steps timed after device synchronisation,
then one profiled step (communication share) and one memory-tracked step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratune import devices, measure, placement
from paratune.config_sizes import config_sizes
from paratune.devices import sync_device
from paratune.failures import Reason, classify
from paratune.launch import (Deadline, WorkerDemand, build_trainer, ensure_ray, fit, placement_groups, return_value,
                             process_group_backend, remove_leaked_placement_groups, wants_gpu, worker_demand)
from paratune.plan import Plan, PlanError, load_plan_dict
from paratune.results import TrialResult
from paratune.routing import RoutingCounter
from paratune.step_memory import MeasuredPeak, tracked_peak_bytes

# Public here too (users import them from paratune.trial): TrialResult (paratune.results) and
# TrialTimeout (paratune.failures).
from paratune.failures import TrialTimeout  # noqa: F401

# Fault injection for tests: "kill:rank=1:step=2[:delay_s=3][:seed=7]" | "hang:rank=0:step=1" | "none"
# (seed=N: only in plans with that seed, so one plan of several in a reused worker group fails).
FAULT_ENV = "PARATUNE_FAULT"


# --------------------------------------------------------------------------- worker side
def release_cached_memory(device: torch.device) -> None:
    """Give back what the caching allocators keep after a plan's tensors are freed, and reset the
    peak counters, so the next plan in this process starts as a fresh one would: the device's
    caching allocator and cuBLAS workspaces, and the pinned host cache. FSDP2's CPU offload and
    ZeRO's offload (pin_memory) copy through pinned host buffers; freed, they stay in torch's
    CachingHostAllocator (page-locked: the OS cannot reclaim them), and every offload plan of a
    reused worker group would add its own until the node runs out of host memory.

    Call after the plan's objects are gone (gc.collect first): a cache frees only blocks no
    tensor uses. A no-op on CPU devices (no caching allocator, no pinned memory)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # held outside empty_cache's reach
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # CUDA builds (torch 2.11 and 2.13): CachingHostAllocator
        torch._C._host_emptyCache()
    elif hasattr(torch.accelerator, "memory") and hasattr(torch.accelerator.memory, "empty_host_cache"):
        torch.accelerator.memory.empty_host_cache()  # a torch with only the device-generic form
    torch.cuda.reset_peak_memory_stats(device)
    if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()


def maybe_inject_fault(rank: int, step: int, seed: int | None = None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or spec == "none":
        return
    kind, *fields = spec.split(":")
    where = dict(f.split("=", 1) for f in fields)
    if int(where.get("rank", -1)) != rank or int(where.get("step", -1)) != step:
        return
    if "seed" in where and int(where["seed"]) != seed:
        return
    time.sleep(float(where.get("delay_s", 0)))  # e.g. a node lost some seconds into the step
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)


def check_finite(losses: list[torch.Tensor | None], rank: int, world: int, device: torch.device) -> None:
    """Raise Diverged on every rank (one all-gather, after the timed loop) when a step's loss was
    NaN or inf on any rank, naming the first such step and its rank; a pipeline stage without a
    loss (None) says nothing."""
    import math

    import torch.distributed as dist

    from paratune.failures import Diverged

    first = next(((i, float(x)) for i, x in enumerate(losses) if x is not None and not math.isfinite(float(x))),
                 None)
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, first)
    bad = [(step, value, r) for r, found in enumerate(seen) if found is not None for step, value in [found]]
    if bad:
        step, value, where = min(bad)
        raise Diverged(f"loss not finite from step {step} on rank {where} ({value}); {len(bad)} of {world} "
                       "rank(s) saw a non-finite loss")


def reduce_losses_and_times(losses: list[torch.Tensor | None], times: list[float],
                            device: torch.device) -> tuple[list[float], list[float]]:
    """One collective per quantity, after the timed loop: the mean loss over the ranks that
    compute one (all of them, except pipeline stages before the last), the slowest rank's time."""
    import torch.distributed as dist

    holds_loss = losses[0] is not None
    loss_t = torch.stack([x if x is not None else torch.zeros((), device=device) for x in losses]).to(device)
    loss_t = torch.cat([loss_t, torch.tensor([1.0 if holds_loss else 0.0], device=device)])
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    loss_t = loss_t[:-1] / loss_t[-1]
    time_t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
    return loss_t.tolist(), time_t.tolist()


def _local_parameter_count(runner) -> int:
    """Parameter elements this rank optimizes (sharded by FSDP/TP/ZeRO, split by PP).

    Counted from the optimizer, which holds what the rank really updates (DDP's TP transform
    and DeepSpeed swap the module's own parameters around)."""
    from torch.distributed.tensor import DTensor

    groups = getattr(runner.optimizer, "param_groups", None)
    # (ZeRO-3's optimizer keeps its groups empty between steps: then the module's partitions.)
    params = list({id(p): p for g in groups or [] for p in g["params"]}.values()) or list(runner.model.parameters())
    def held(p: torch.Tensor) -> int:
        if isinstance(p, DTensor):
            return p.to_local().numel()
        if hasattr(p, "ds_tensor"):  # a ZeRO-3 parameter: the rank holds its partition only
            return p.ds_tensor.numel()
        return p.numel()

    return sum(held(p) for p in params)


def train_and_measure(plan: Plan, rank: int, world: int, local_world: int, device: torch.device,
                      stop_rule: measure.TrialStopRule | None = None) -> dict[str, Any]:
    """Everything a worker does. Returns the same dict on every rank (reduced across ranks).

    With a stop rule, each measured step's slowest-rank time is agreed on by all ranks (one small
    all-reduce after the clock is read), so every rank stops at the same step when the trial
    cannot reach the incumbent; the extra profiled and memory-tracked steps are then skipped."""
    import torch.distributed as dist

    from paratune import user_loop

    if user_loop.TRAIN_LOOP_ENV in plan.env:  # the user's own loop, timed by paratune.user_loop's rules
        return user_loop.run(plan, rank, world, device, stop_rule=stop_rule)
    from paratune.data import TokenBatches, step_loader
    from paratune.materialize import ConstructionMeter
    from paratune.models import build_config, model_init
    from paratune.parallel import build_runner
    from paratune.parallel.compile import eager_blocks, on_every_rank, watch_compiled
    from paratune.parallel.dims import ParallelDims
    from paratune.quiet import quiet_torchao_import
    from paratune.precision import LinearMatmulDtypes

    from paratune.placement import place_and_check

    # Before anything is built: every rank's place, checked against the plan's node-local groups
    # (PlacementError: invalid_placement), and one local world size for all ranks.
    layout, local_world = place_and_check(plan, rank, world, local_world)
    quiet_torchao_import()  # before transformers imports torchao (building the model)
    dims = ParallelDims.from_plan(plan, device.type)
    dp_rank = dims.dp_rank(rank)
    env_seen = {key: os.environ.get(key) for key in plan.env}
    config = build_config(plan.model, plan.model_overrides)
    meter = ConstructionMeter(device).start()
    try:
        runner = build_runner(config, plan, device, local_world, meter)
    finally:
        meter.abandon()
    devices.warm_up_process_groups(device)  # communicators and cuBLAS before step 0, not in compile_s
    torch.manual_seed(plan.seed + 1 + dp_rank)  # dropout differs per data rank (same within a tp group)
    data = TokenBatches(plan.data, config_sizes(config).vocab, plan.seq_len, plan.global_batch, plan.seed)

    def batches(step: int) -> list[torch.Tensor]:
        return [m.to(device) for m in data.micro_batches(step, dp_rank, dims.dp, plan.micro_batch)]

    # The timed steps read through the DataLoader (workers and prefetch as the plan's data asks); the
    # clock runs from before the batch is asked for, so a step that waits for data is a slower step.
    loader = step_loader(data, 0, plan.total_steps, dp_rank, dims.dp, plan.micro_batch)
    waits: list[float] = []

    # Tokens per expert over the measured steps; a compiled plan's blocks would trace the hook, so
    # it counts in its extra eager step instead (see below).
    stages = runner.model if isinstance(runner.model, torch.nn.Module) else torch.nn.ModuleList(runner.model)  # pp: a list
    routing = RoutingCounter(stages, plan.ep, counts_tokens=dims.coords(rank)[2] == 0, device=device)
    losses, times = [], []
    slowest: list[float] = []  # measured steps, slowest rank (only with a stop rule)
    stopped = False
    first_step_at = None
    dtypes = LinearMatmulDtypes()
    watch = watch_compiled(runner.model, plan)  # compiled plans: one graph per block class, none measured
    compile_graphs = None
    window = MeasuredPeak(device)  # the allocator's peak over the measured steps only
    ran = 0  # steps run so far, extra ones too (the window's clock)

    def train(micro: list[torch.Tensor]):
        nonlocal ran
        ran += 1
        return runner.train_step(micro)

    for step in range(plan.total_steps):
        maybe_inject_fault(rank, step, plan.seed)
        if step == plan.warmup_steps:
            window.open(ran)
        routing.counting = step >= plan.warmup_steps and watch is None
        sync_device(device)
        t0 = time.perf_counter()
        ready = next(loader)  # the wait for data: the loader's hand-over only (the copy to the device is the step's)
        waits.append(time.perf_counter() - t0)
        micro = [m.to(device) for m in ready]
        first_step_at = first_step_at or time.time()
        # A warm-up step (never timed) records compute dtypes; a compiled plan's first step must compile
        # (a dispatch mode around it would make Dynamo skip the blocks): it records in an extra eager step.
        if step == 0 and plan.warmup_steps > 0 and watch is None:
            with dtypes:
                loss = train(micro)
        else:
            loss = train(micro)
        sync_device(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if watch is not None and step + 1 == plan.warmup_steps:
            compile_graphs = on_every_rank(watch.warmed_up, device)
        if stop_rule is not None and step >= plan.warmup_steps:
            agreed = torch.tensor([times[-1]], dtype=torch.float64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            slowest.append(float(agreed))
            if step + 1 < plan.total_steps and stop_rule.cannot_reach(plan.tokens_per_step, slowest, world):
                stopped = True
                break

    routing.counting = False
    window.close(ran)  # before any extra step below can raise the allocator's peak
    check_finite(losses, rank, world, device)  # a plan whose loss blew up did not train: no figures
    del loader  # its workers end here (a trial stopped early leaves steps unread)
    if watch is not None:
        on_every_rank(watch.measured, device)
    all_losses, all_times = reduce_losses_and_times(losses, times, device)
    step_times = all_times[plan.warmup_steps :]
    wait_t = torch.tensor(waits, dtype=torch.float64, device=device)
    dist.all_reduce(wait_t, op=dist.ReduceOp.MAX)
    step_waits = wait_t.tolist()[plan.warmup_steps :]

    out: dict[str, Any] = {
        "losses": all_losses,
        "step_times_s": step_times,
        "data_wait_s": step_waits,
        "first_step_epoch_s": first_step_at,
        "env_seen": env_seen,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "stopped_early": stopped,
        "planned_measure_steps": plan.measure_steps,
        "placement": [dataclasses.asdict(p) for p in layout],
        "compile_s": measure.compile_seconds(all_times[0], step_times) if watch is not None else None,
        "compile_graphs": compile_graphs,
    }
    extra_step = plan.total_steps
    routing_method = "forward pre-hook on the experts: top_k_index per expert over the measured steps, all ranks"
    if watch is not None and not stopped:  # the compute dtypes of a compiled plan: one eager step
        routing.counting = True
        with eager_blocks(), dtypes:
            train(batches(extra_step))
        routing.counting = False
        routing_method = "forward pre-hook on the experts: top_k_index per expert over one eager step, all ranks"
        extra_step += 1
    routing.remove()
    expert_tokens = routing.summed_over_ranks(world)  # every rank: a pipeline stage may hold no MoE layer
    if expert_tokens:
        out["expert_tokens"] = expert_tokens
        out["routing_method"] = routing_method
    if plan.profile_comm and world > 1 and not stopped:
        from torch.profiler import ProfilerActivity, profile

        micro = batches(extra_step)
        extra_step += 1
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync_device(device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            train(micro)
            sync_device(device)
            seconds = time.perf_counter() - t0
        events = measure.profile_events(prof)
        share = torch.tensor([measure.comm_share_from_events(events, seconds, device.type),
                              measure.all_to_all_share_from_events(events, seconds, device.type)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(share, op=dist.ReduceOp.SUM)
        out["comm_share"] = float(share[0]) / world
        out["all_to_all_share"] = float(share[1]) / world
        out["comm_method"] = "profiler: collectives in flight / step time (one extra step, rank mean)"
    if device.type == "cuda":
        peak, method = window.bytes or 0, window.method()
    elif stopped:
        peak, method = 0, "not measured (stopped early)"
    elif plan.track_memory and plan.pp > 1:
        # MemTracker breaks inside pipeline schedules (and a failure on one rank would leave the
        # others waiting in the schedule's p2p), so pipeline plans report the process RSS.
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        method = "process max RSS (pipeline plans: MemTracker cannot follow the schedule)"
    elif plan.track_memory:
        try:
            with eager_blocks() if watch is not None else contextlib.nullcontext():  # a dispatch mode too
                peak, method = tracked_peak_bytes(runner, batches(extra_step))
                ran += 1
        except Exception as err:  # the tracker cannot follow every framework's tensors
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            method = f"process max RSS (MemTracker failed: {type(err).__name__}: {str(err)[:300]})"
    else:
        peak, method = 0, "not measured"
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, int(peak))
    out["peak_memory_bytes"] = peaks
    held: list[Any] = [None] * world
    dist.all_gather_object(held, _local_parameter_count(runner))
    out["local_parameter_counts"] = held
    out["memory_method"] = method
    out["memory_window_steps"] = window.steps  # the steps the GPU allocator's peak covers
    out["steps_run"] = ran
    construction: list[Any] = [None] * world
    dist.all_gather_object(construction, meter.peak_bytes)
    out["construction_peak_bytes"] = construction
    out["construction_method"] = meter.method
    seconds = torch.tensor([meter.seconds or 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    out["construction_s"] = float(seconds)
    matmuls: list[Any] = [None] * world
    dist.all_gather_object(matmuls, dict(dtypes.counts))
    total: dict[str, int] = {}
    for counts in matmuls:
        for dtype, n in counts.items():
            total[dtype] = total.get(dtype, 0) + n
    out["linear_matmul_dtypes"] = total
    inner = getattr(runner.optimizer, "optimizer", runner.optimizer)  # DeepSpeed wraps the real one
    out["optimizer_class"] = type(inner).__name__
    out["model_init"] = model_init(plan.model)
    out["loss_form"] = runner.loss_form  # what ran (auto resolved), and why auto fell back (None: it did not)
    out["loss_form_fallback"] = runner.loss_fallback
    return out


def worker_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker: rank 0's return value reaches the driver."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    plan = load_plan_dict(config["plan"])
    device = ray.train.torch.get_device()
    rule = measure.TrialStopRule(**config["stop_rule"]) if config.get("stop_rule") else None
    return train_and_measure(plan, ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size(), device,
                             stop_rule=rule)


# --------------------------------------------------------------------------- driver side
# transformers imports its classes lazily, and two threads importing the same one at once can see
# a half-initialised module ("cannot import name 'AutoConfig' from 'transformers'"): seen in the
# sweep's worker-group pool, a threaded actor checking two concurrent trials' plans.
_MODEL_CHECK_LOCK = threading.RLock()


def check_before_launch(plan: Plan | dict[str, Any], ray_address: str | None = None) -> tuple[Plan, float] | TrialResult:
    """(the plan, its model FLOPs per token), or the failed result that means no worker should
    start: the plan's rules, the model's layout rules on the meta device, cp on CPU workers (a
    cp plan on device 'auto' asks the cluster, joining Ray first)."""
    if not isinstance(plan, Plan):
        try:
            plan = load_plan_dict(plan)
        except PlanError as err:
            return TrialResult.failed(plan, "invalid_config", str(err))
    from paratune.inputs import check_inputs
    from paratune.models import ModelError, build_config
    from paratune.preflight import check_plan_against_model

    try:
        with _MODEL_CHECK_LOCK:  # one thread at a time: see _MODEL_CHECK_LOCK
            check_inputs(plan)  # model, data and tokenizer files, where the command runs
            model_config = build_config(plan.model, plan.model_overrides)
            check_plan_against_model(plan, model_config)  # the family's layout rules, on the meta device
            flops_tok = measure.model_flops_per_token(model_config, plan.seq_len)  # builds it on meta
    except (ModelError, PlanError) as err:
        return TrialResult.failed(plan, "invalid_config", str(err))
    except Exception as err:  # noqa: BLE001 - a config transformers accepts but cannot build
        import traceback

        where = traceback.extract_tb(err.__traceback__)[-1]  # e.g. a file a library looked for
        return TrialResult.failed(plan, "invalid_config", f"model: '{plan.model}' cannot be built: "
                                  f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})")
    from paratune.user_loop import TRAIN_LOOP_ENV, refusal

    if TRAIN_LOOP_ENV in plan.env and (why := refusal(plan)) is not None:  # what the user's loop cannot take
        return TrialResult.failed(plan, "invalid_config", why)
    if plan.async_tp:  # device 'auto' on a cluster without GPUs (device 'cpu': the plan refuses)
        ensure_ray(ray_address)
        if not wants_gpu(plan):
            from paratune.levers import ASYNC_TP_CPU_REASON

            return TrialResult.failed(plan, "invalid_config", f"async_tp: true on CPU workers: {ASYNC_TP_CPU_REASON}; "
                                      "allowed: false on CPU")
    if plan.cp > 1:  # device 'auto' on a cluster without GPUs (device 'cpu': the plan refuses)
        ensure_ray(ray_address)
        if wants_gpu(plan):
            return plan, flops_tok
        from paratune.degrees import CP_CPU_REASON

        return TrialResult.failed(plan, "invalid_config", f"cp: {plan.cp} on CPU workers: {CP_CPU_REASON}; "
                                  "allowed: cp 1 on CPU")
    return plan, flops_tok


def run_trial(plan: Plan | dict[str, Any], *, storage_path: str | Path | None = None,
              ray_address: str | None = None, stop_rule: measure.TrialStopRule | None = None,
              nodes: list[str] | None = None) -> TrialResult:
    """Run one plan on Ray Train (its own worker group) and measure it. Never raises for a failing
    plan. With a stop rule, a trial that cannot reach the incumbent ends as stopped_early. With
    `nodes` (whole nodes a sweep leased to it: paratune.placement) its workers run there only."""
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
    its result, whichever worker group runs it (its own: run_trial; a reused one: paratune.pool)."""

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
    from paratune.placement import alive_nodes

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
