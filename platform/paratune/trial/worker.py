"""The measured trial's worker side: one plan's workers timed.

`train_and_measure` builds the model identically on every rank, applies the plan's strategy, runs
warm-up then measured whole optimizer steps timed after device synchronisation, then one profiled
step (communication share) and one memory-tracked step; `worker_loop` is it as Ray Train's
train_loop_per_worker. The driver side (run_trial, the launch flow) is paratune.cluster.trial.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from typing import Any

import torch

from paratune.config import devices
from paratune.costs import measure
from paratune.config.sizes import config_sizes
from paratune.config.devices import sync_device
from paratune.config.plan import Plan, load_plan_dict
from paratune.trial.routing import RoutingCounter
from paratune.trial.step_memory import MeasuredPeak, tracked_peak_bytes

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

    from paratune.trial.failures import Diverged

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

    from paratune.trial import user_loop

    if user_loop.TRAIN_LOOP_ENV in plan.env:  # the user's own loop, timed by paratune.trial.user_loop's rules
        return user_loop.run(plan, rank, world, device, stop_rule=stop_rule)
    from paratune.config.data import TokenBatches, step_loader
    from paratune.model.materialize import ConstructionMeter
    from paratune.model.build import build_config
    from paratune.config.model_config import model_init
    from paratune.parallel import build_runner
    from paratune.parallel.compile import eager_blocks, on_every_rank, watch_compiled
    from paratune.parallel.dims import ParallelDims
    from paratune.config.quiet import quiet_torchao_import
    from paratune.trial.precision import LinearMatmulDtypes

    from paratune.trial.placement import place_and_check

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
