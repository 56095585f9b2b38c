"""Your own training loop, tuned: a user's Ray Train loop measured like paratune's own trial.

The loop (`module:function`, taking one config dict as Ray Train's train_loop_per_worker does)
travels in the plan's env as PARATUNE_TRAIN_LOOP (and the directory it imports from as
PARATUNE_TRAIN_LOOP_PATH), so every path that runs a plan (its own worker group or a reused
one of the sweep's pool) runs it, and a group with a loop is never reused for another plan.
Inside it, the loop asks this module for the plan's strategy and timing:

    model, optimizer = user_loop.prepare(model, lambda params: torch.optim.AdamW(params))
    batches = user_loop.batches(vocab_size)
    for step in user_loop.steps():          # paratune decides warm-up, measured steps, stopping
        loss = ...; loss.backward(); optimizer.step(); optimizer.zero_grad()
        user_loop.log_loss(loss)

Each iteration of `steps()` is one timed optimizer step, clocked after a device sync at both
ends; warm-up steps are not measured and each measured step counts its slowest rank's time
(paratune.cluster.trial's rules). What the loop does not get from paratune is refused before any worker
starts (`refusal`): tp/pp/cp/ep, ZeRO, compile, float8, activation checkpointing, hybrid FSDP.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from paratune.costs import measure
from paratune.config.devices import sync_device
from paratune.levers import lever_fields
from paratune.config.plan import Plan
from paratune.config.train_loop import TRAIN_LOOP_ENV, TRAIN_LOOP_PATH_ENV
from paratune.trial.step_memory import MeasuredPeak


class UserLoopError(RuntimeError):
    """The user's loop broke the session's rules (no steps run, steps cut short, no session)."""


# --------------------------------------------------------------------------- worker side
@dataclass
class _Session:
    plan: Plan
    rank: int
    world: int
    device: torch.device
    stop_rule: measure.TrialStopRule | None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    slowest: list[float] = field(default_factory=list)
    steps_run: int = 0
    stopped: bool = False
    first_step_at: float | None = None
    model: torch.nn.Module | None = None
    optimizer: Any = None
    window: MeasuredPeak | None = None  # the allocator's peak over the measured steps, as the trial's

    def __post_init__(self) -> None:
        self.window = self.window or MeasuredPeak(self.device)


_SESSION: _Session | None = None


def _current() -> _Session:
    if _SESSION is None:
        raise UserLoopError("paratune.trial.user_loop: no trial is running here; call it from a loop that "
                            "`paratune tune --train-loop` (or a plan with env.PARATUNE_TRAIN_LOOP) runs")
    return _SESSION


def plan() -> Plan:
    """The trial's plan (model preset, batch sizes, strategy, precision, steps)."""
    return _current().plan


def device() -> torch.device:
    """The device Ray Train gave this worker."""
    return _current().device


def prepare(model: torch.nn.Module, optimizer_factory: Callable[[Any], Any]) -> tuple[torch.nn.Module, Any]:
    """The plan's strategy applied to the loop's model (on the worker's device), and its
    optimizer made from the parameters that result: DDP (the plan's bucket size), or FSDP2 with
    every decoder block and the root sharded (the plan's reshard, offload, bf16 policy)."""
    s = _current()
    p = s.plan
    if p.strategy == "fsdp":
        # Sharded from where the loop built it: fully_shard moves each unit's parameters and
        # buffers to the mesh's device as it shards them (torch/distributed/fsdp/_fully_shard/
        # _fsdp_init.py `_move_states_to_device`), so the device never holds the whole model at once
        # (moving it first put the unsharded model into the GPU peak, and could OOM where the
        # trial's plan fits).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from paratune.model.build import decoder_blocks
        from paratune.parallel.fsdp import fsdp_policies

        mp, offload = fsdp_policies(p, s.device)
        mesh = init_device_mesh(s.device.type, (s.world,))
        reshard = p.fsdp.reshards_after_forward
        try:
            blocks = decoder_blocks(model)
        except Exception:  # noqa: BLE001 - a plain torch module: the root is the one unit
            blocks = []
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    else:
        from paratune.parallel.ddp import wrap_ddp

        model = wrap_ddp(model.to(s.device), p, s.device)
    s.model, s.optimizer = model, optimizer_factory(model.parameters())
    return model, s.optimizer


def autocast() -> contextlib.AbstractContextManager:
    """bf16 autocast for a DDP plan with precision bf16 (FSDP2's policy casts by itself); else nothing."""
    s = _current()
    if s.plan.precision == "bf16" and s.plan.strategy == "ddp":
        return torch.autocast(s.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batches(vocab_size: int) -> Callable[[int], list[torch.Tensor]]:
    """step -> this rank's micro-batches of the plan's data (token ids, labels = inputs), on the device."""
    from paratune.config.data import TokenBatches

    s = _current()
    p = s.plan
    data = TokenBatches(p.data, vocab_size, p.seq_len, p.global_batch, p.seed)
    return lambda step: [m.to(s.device) for m in data.micro_batches(step, s.rank, s.world, p.micro_batch)]


def log_loss(loss: torch.Tensor | float) -> None:
    """This step's loss (reported as the mean over ranks, per step)."""
    s = _current()
    s.losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))


def steps() -> Iterator[int]:
    """The trial's optimizer steps: each body between two yields is one timed step (device synced
    before and after). Stops after warm-up + measured steps, or earlier when a stop rule says the
    trial cannot reach the incumbent (all ranks agree: one all-reduce per measured step)."""
    import torch.distributed as dist

    s = _current()
    p = s.plan
    for step in range(p.total_steps):
        if step == p.warmup_steps:
            s.window.open(step)  # reset as the trial's: after warm-up, not before the loop's set-up
        sync_device(s.device)
        t0 = time.perf_counter()
        s.first_step_at = s.first_step_at or time.time()
        yield step
        sync_device(s.device)
        s.times.append(time.perf_counter() - t0)
        s.steps_run = step + 1
        if len(s.losses) < s.steps_run:
            s.losses.append(float("nan"))  # the loop logged none this step
        if s.stop_rule is not None and step >= p.warmup_steps:
            agreed = torch.tensor([s.times[-1]], dtype=torch.float64, device=s.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            s.slowest.append(float(agreed))
            if step + 1 < p.total_steps and s.stop_rule.cannot_reach(p.tokens_per_step, s.slowest, s.world):
                s.stopped = True
                s.window.close(s.steps_run)
                return
    s.window.close(s.steps_run)  # before whatever the loop does after its last step


def import_loop(value: str, root: str | None) -> Callable[[dict[str, Any]], Any]:
    """The loop's function on a worker: its directory first on sys.path (Ray's workers start elsewhere)."""
    if root and root not in sys.path:
        sys.path.insert(0, root)
    module, _, name = value.partition(":")
    return getattr(importlib.import_module(module), name)


def run(plan_: Plan, rank: int, world: int, device_: torch.device,
        stop_rule: measure.TrialStopRule | None = None) -> dict[str, Any]:
    """Call the plan's loop in a session and return what paratune.cluster.trial.summarize needs."""
    import resource

    import torch.distributed as dist

    global _SESSION
    loop = import_loop(plan_.env[TRAIN_LOOP_ENV], plan_.env.get(TRAIN_LOOP_PATH_ENV))
    _SESSION = s = _Session(plan_, rank, world, device_, stop_rule)
    try:
        loop({"plan": plan_.to_dict(), "rank": rank, "world": world})
    finally:
        _SESSION = None
    if s.steps_run == 0:
        raise UserLoopError(f"{plan_.env[TRAIN_LOOP_ENV]}: ran no step of user_loop.steps(); a tuned loop "
                            "times its optimizer steps as `for step in paratune.trial.user_loop.steps():`")
    if s.steps_run < plan_.total_steps and not s.stopped:
        raise UserLoopError(f"{plan_.env[TRAIN_LOOP_ENV]}: left user_loop.steps() after {s.steps_run} of "
                            f"{plan_.total_steps} steps; allowed: run every step it yields")
    loss_t = torch.tensor(s.losses, dtype=torch.float64, device=device_)
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    time_t = torch.tensor(s.times, dtype=torch.float64, device=device_)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
    if device_.type == "cuda":
        peak, method = s.window.bytes or 0, s.window.method(" (user loop)")
    else:
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS (user loop)"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [int(peak), _local_params(s.model)])
    inner = getattr(s.optimizer, "optimizer", s.optimizer)
    return {
        "losses": (loss_t / world).tolist(), "step_times_s": time_t.tolist()[plan_.warmup_steps:],
        "data_wait_s": [], "first_step_epoch_s": s.first_step_at,
        "env_seen": {key: os.environ.get(key) for key in plan_.env}, "stopped_early": s.stopped,
        "device": torch.cuda.get_device_name(device_) if device_.type == "cuda" else "cpu",
        "peak_memory_bytes": [g[0] for g in gathered], "memory_method": method,
        "memory_window_steps": s.window.steps,
        "local_parameter_counts": [g[1] for g in gathered],
        "optimizer_class": type(inner).__name__ if inner is not None else None,
        "train_loop": plan_.env[TRAIN_LOOP_ENV],
    }


def _local_params(model: torch.nn.Module | None) -> int:
    """Parameter elements this rank holds (FSDP2: its shards); 0 when the loop prepared no model."""
    if model is None:
        return 0
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
