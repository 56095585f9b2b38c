"""DDP: every rank holds everything; gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratune.parallel import StepRunner, apply_activation_checkpointing, make_optimizer
from paratune.materialize import ModelInit, materialize
from paratune.plan import Plan


def parallelize_ddp(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device) -> StepRunner:
    opts = plan.ddp
    assert opts is not None
    apply_activation_checkpointing(model, plan)
    materialize(model, init, device)  # DDP replicates: every rank holds the whole model
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=opts.bucket_cap_mb,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
    )

    def sync_context(step: int, last_micro: bool):
        # Skip the all-reduce on all but the last micro-batch. With static_graph, DDP must see
        # one fully synchronised iteration to record the graph (no_sync() on the first step
        # fails), so step 0 syncs every micro-batch: same result, since averaging is linear.
        if last_micro or (opts.static_graph and step == 0):
            return contextlib.nullcontext()
        return ddp.no_sync()

    return StepRunner(ddp, make_optimizer(ddp.parameters(), plan), plan, device, sync_context,
                      autocast=plan.precision == "bf16")
