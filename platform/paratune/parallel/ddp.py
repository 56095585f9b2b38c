"""DDP: every rank holds everything; gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratune.parallel.runner import StepRunner, apply_levers, make_optimizer
from paratune.model.adapters import store_frozen_base
from paratune.model.materialize import ModelInit, materialize
from paratune.config.plan import Plan


BUCKETS_ATTR = "paratune_bucket_buffers"  # {bucket index: its flat buffer} on a CPU DDP module


def keep_bucket_buffers(ddp: DistributedDataParallel) -> None:
    """Remember DDP's bucket buffers, so the CPU memory tracker can count them.

    On CPU a trial's peak memory is MemTracker's, which counts a tensor from the moment an op it
    sees touches it (or it is handed over with `track_external`). DDP's reducer allocates its
    buckets in C++ (4 bytes a parameter in fp32; the gradients live in them as views), and
    zero_grad(set_to_none=True) drops the views, so the tracker first met a bucket when the
    backward copied the first gradient into it: at the activation peak, before that, the buckets
    were memory the process held and the figure left out (~14% for DDP with grad_accum > 1).
    torch's own `allreduce_hook` (DDP's documented drop-in for its built-in all-reduce: the same
    division by the world size, the same in-place all-reduce of the bucket) is registered,
    wrapped to keep each bucket's buffer (the latest, after DDP's first-iteration rebuild). GPU
    trials read the allocator (max_memory_allocated), which counts the buckets anyway: they keep
    DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffers: dict[int, torch.Tensor] = {}
    setattr(ddp, BUCKETS_ATTR, buffers)

    def allreduce_keeping_the_buffer(state, bucket):  # noqa: ANN001 - DDP's comm hook signature
        buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, allreduce_keeping_the_buffer)


def wrap_ddp(model: nn.Module, plan: Plan, device: torch.device) -> DistributedDataParallel:
    """The plan's DDP around a materialized model (its bucket, view and static-graph knobs): paratune's
    own ddp layout and a user's loop (paratune.trial.user_loop) wrap the same way."""
    opts = plan.ddp
    assert opts is not None, "a ddp plan always has its ddp options (Plan fills the defaults)"
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=opts.bucket_cap_mb,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
        find_unused_parameters=opts.find_unused_parameters,
    )


def unreached_parameters_check(ddp: DistributedDataParallel, plan: Plan) -> Callable[[], None] | None:
    """A check after the first step's backward that every trainable parameter got a gradient, unless
    the plan lets DDP find the unused ones: torch's own error comes a step later and names indices."""
    if plan.ddp is None or plan.ddp.find_unused_parameters:
        return None
    ignored = set(getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ()))
    checked = [False]

    def check() -> None:
        if checked[0]:
            return
        checked[0] = True
        missing = [n for n, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None and n not in ignored]
        if missing:
            raise RuntimeError(f"ddp: {len(missing)} parameters get no gradient from a training step "
                               f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): the model holds "
                               "parts a text-only step does not reach; allowed: ddp.find_unused_parameters: true "
                               "(DDP skips them each step), or strategy fsdp / zero")
    return check


def _chain(*hooks: Callable[[], None] | None) -> Callable[[], None] | None:
    """The hooks that are set, run in order, as one before_step hook (None: none is set)."""
    present = [h for h in hooks if h is not None]
    if not present:
        return None

    def run_all() -> None:
        for hook in present:
            hook()
    return run_all


def parallelize_ddp(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device) -> StepRunner:
    opts = plan.ddp
    assert opts is not None
    apply_levers(model, plan, "before_layout")
    apply_levers(model, plan, "before_shard")
    apply_levers(model, plan, "before_wrap")
    experts = meshes = None
    if plan.ep > 1:  # each rank holds E / ep of every layer's experts (paratune.parallel.ep)
        from paratune.parallel.ep import expert_meshes, expert_param_names, mark_expert_params, shard_experts

        meshes = expert_meshes(plan, device.type)
        experts = shard_experts(model, meshes)
    store_frozen_base(model, plan)  # LoRA under autocast: the frozen linears in bf16, as each matmul sees them
    materialize(model, init, device)  # DDP replicates: every rank holds the whole model (ep: its experts)
    if experts is not None:
        mark_expert_params(experts)
        # DDP would average the experts over all ranks, which hold different ones: theirs is their own step
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
    ddp = wrap_ddp(model, plan, device)
    if device.type == "cpu" and plan.track_memory:
        keep_bucket_buffers(ddp)

    def sync_context(step: int, last_micro: bool):
        # Skip the all-reduce on all but the last micro-batch. With static_graph, DDP must see
        # one fully synchronised iteration to record the graph (no_sync() on the first step
        # fails), so step 0 syncs every micro-batch: same result, since averaging is linear.
        if last_micro or (opts.static_graph and step == 0):
            return contextlib.nullcontext()
        return ddp.no_sync()

    if meshes is not None:
        from paratune.parallel.ep import reduce_expert_gradients
        from paratune.parallel.tp import clip_grad_norm

        return StepRunner(ddp, make_optimizer(ddp.parameters(), plan), plan, device, sync_context,
                          autocast=plan.precision == "bf16",
                          before_step=_chain(unreached_parameters_check(ddp, plan),
                                             partial(reduce_expert_gradients, model, meshes)),
                          clip=partial(clip_grad_norm, list(ddp.parameters()), plan.grad_clip, ep_group=meshes.ep_group))
    return StepRunner(ddp, make_optimizer(ddp.parameters(), plan), plan, device, sync_context,
                      autocast=plan.precision == "bf16", before_step=unreached_parameters_check(ddp, plan))
