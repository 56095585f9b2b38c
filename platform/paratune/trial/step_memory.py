"""A trial's peak memory: the device allocator's over the measured steps (GPU), or one tracked step's
by PyTorch's MemTracker (CPU).

Kept apart from paratune.cluster.trial: the window the allocator's counter covers (`MeasuredPeak`, the
trial and a user's loop alike), and what the tracker must be told of that it cannot see by
itself (DeepSpeed's own buffers, DDP's buckets, frozen parameters it would try to hook).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MeasuredPeak:
    """The device allocator's peak over the measured steps, and only those: its counter is reset
    as the first measured step starts (warm-up's compile, lazy communicator and cuBLAS set-up left
    out) and read as the last one ends, before any extra step (a compiled plan's eager dtype step,
    the profiled step, the tracked step) can raise it. `steps`: [first, last] step run in the
    window, counted by the caller across every step it runs, extra ones too, so the window is
    visible on a CPU too, where no allocator counter exists. `bytes` is None off CUDA."""

    device: torch.device
    first: int | None = None
    last: int | None = None
    bytes: int | None = None

    def open(self, steps_run: int) -> None:
        """Before the first measured step (`steps_run` steps done so far)."""
        self.first = steps_run
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def close(self, steps_run: int) -> None:
        """After the last measured step; a window never opened (no measured step) stays empty."""
        if self.first is None or self.last is not None:
            return
        self.last = steps_run - 1
        if self.device.type == "cuda":
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))

    @property
    def steps(self) -> list[int] | None:
        return None if self.first is None or self.last is None else [self.first, self.last]

    def method(self, what: str = "") -> str:
        """How the GPU figure was read, for the trial result."""
        return f"torch.cuda.max_memory_allocated over the measured steps {self.steps}{what}"


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        return None


_NO_HOOK = _NoHook()


def tracked_peak_bytes(runner, micro) -> tuple[int, str]:
    """Peak tensor memory of one step on CPU, by PyTorch's MemTracker (a dispatch-level tracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    optimizer = runner.optimizer
    held: list[torch.Tensor] = []
    if not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed wraps the torch optimizer
        # ...and keeps persistent buffers of its own (flat partitions, gradient partitions, the
        # reduce bucket) allocated before this step: without them the peak would be too low.
        held = _tensors_held_by(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    from paratune.parallel.ddp import BUCKETS_ATTR

    held += list(getattr(runner.model, BUCKETS_ATTR, {}).values())  # DDP's buckets (parallel.ddp)
    tracker.track_external(*(x for x in (runner.model, optimizer) if x is not None), *held)
    # MemTracker puts a gradient hook on every parameter it meets, and torch refuses one on a frozen
    # parameter (LoRA's base): a no-op handle in its table marks those as done (it removes them at
    # exit). Marked as each module enters: FSDP2 swaps in unsharded parameters (new tensors) in its
    # groups' pre-forward, which the submodules then show the tracker.
    def mark_frozen(module: torch.nn.Module) -> None:
        for param in module.parameters():
            if not param.requires_grad and param not in tracker._param_to_grad_hook_handles:
                tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)

    models = runner.model if isinstance(runner.model, (list, tuple)) else [runner.model]
    for model in models:
        if isinstance(model, torch.nn.Module):
            mark_frozen(model)
    # MemTracker refuses a module called twice in one context, and every micro-batch calls the
    # model again: reset its per-module stats as each micro-batch enters (its peak is kept). A
    # global hook registered before the tracker's own runs first.
    roots = {id(m) for m in runner.micro_batch_roots()}

    def reset_per_micro_batch(module, args):
        if id(module) in roots:  # roots are never recomputed by activation checkpointing
            tracker.reset_mod_stats()
        mark_frozen(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(reset_per_micro_batch)
    try:
        with tracker:
            runner.train_step(micro)
    finally:
        handle.remove()
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(v.get("Total", 0) for v in peak.values())
    return int(total), "torch MemTracker (tensor storage, one extra step)"


def _tensors_held_by(obj: object) -> list[torch.Tensor]:
    """Tensors an object holds in its attributes, directly or in lists/tuples/dicts (one level)."""
    found: dict[int, torch.Tensor] = {}

    def add(value: object) -> None:
        if isinstance(value, torch.Tensor) and not value.is_meta:
            found.setdefault(id(value), value)

    # ZeRO-3's reduce bucket sits one object deeper: optimizer.ipg_buckets[dtype].buffer, allocated
    # with the optimizer and kept (reduce_bucket_size elements).
    for bucket in (getattr(obj, "ipg_buckets", None) or {}).values():
        buffer = getattr(bucket, "buffer", None)
        for t in buffer if isinstance(buffer, (list, tuple)) else [buffer]:
            add(t)
    for value in vars(obj).values():
        add(value)
        if isinstance(value, (list, tuple)):
            for item in value:
                add(item)
                if isinstance(item, (list, tuple)):
                    for inner in item:
                        add(inner)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)
    return list(found.values())
