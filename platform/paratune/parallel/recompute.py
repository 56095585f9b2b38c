"""Activation checkpointing: none, selective (per op), every N-th layer, full (paratune.levers).

Every mode goes through transformers' own hook (`activation_checkpointing_enable`): it wraps each
decoder block's class `forward` (transformers/modeling_layers.py GradientCheckpointingLayer), so
module hooks (FSDP2's, DDP's) stay outside the recomputed region and any caller of the block
(the model's forward, a pipeline stage's loop, a compiled `__call__`) gets the same checkpoint.
The blocks checkpoint only in training mode (`self.training`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paratune.plan import Plan

aten = torch.ops.aten
c10d_functional = torch.ops._c10d_functional
# Selective (per-op) checkpointing saves the outputs of these ops and recomputes everything else
# in a block (norms, activations, rotary, residual adds, softmax-free elementwise work): the
# matmuls and the attention kernel are the expensive part of a block's forward, their outputs
# the activations worth keeping. The SDPA names are what each device dispatches: CPU's
# (measured, bench/results/levers_cpu_probe.md), CUDA's flash, mem-efficient and cuDNN kernels.
SAVED_OPS: frozenset = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})
# Under tp, DTensor's redistributions inside a block are functional collectives
# (torch/distributed/_functional_collectives.py: ops of the `_c10d_functional` namespace; what
# DTensor dispatches on gloo as on NCCL): RowwiseParallel's all_reduce (reduce_scatter_tensor
# with sequence parallelism), the sequence-parallel all_gather_into_tensor before the
# column-parallel projections. Saved, the backward's recompute never runs a collective again
# (a recomputed collective costs the communication twice and must be matched by every tp rank).
# wait_tensor only completes an async result (no communication): recomputing it is free.
SAVED_COLLECTIVES: frozenset = frozenset({
    c10d_functional.all_reduce.default,
    c10d_functional.reduce_scatter_tensor.default,
    c10d_functional.all_gather_into_tensor.default,
    c10d_functional.all_to_all_single.default,
})


def saved_ops(tp: bool) -> frozenset:
    """The ops whose outputs selective checkpointing keeps: SAVED_OPS, and the collectives under tp."""
    return SAVED_OPS | SAVED_COLLECTIVES if tp else SAVED_OPS


def selective_policy(tp: bool) -> Callable[..., CheckpointPolicy]:
    """The per-op policy of selective checkpointing, as torch.utils.checkpoint's
    `create_selective_checkpoint_contexts` takes it: `policy(ctx, func, *args, **kwargs)` ->
    MUST_SAVE for `saved_ops(tp)`, PREFER_RECOMPUTE for every other op. A pure function of the op
    (it reads neither ctx nor the arguments), so a memory model can run a block's forward under
    fake tensors with it and sum the bytes of the outputs of the ops it saves."""
    keep = saved_ops(tp)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(tp: bool) -> Callable[[], tuple]:
    """torch.utils.checkpoint's `context_fn` for selective checkpointing (a fresh pair of contexts
    per checkpointed call, as the function must give)."""
    return partial(create_selective_checkpoint_contexts, selective_policy(tp))


def checkpoint_settings(plan: Plan) -> tuple[dict[str, Any], int] | None:
    """(torch.utils.checkpoint kwargs, transformers' every_n_layers) for the plan's mode; None: off.

    transformers checkpoints block i when i % every_n_layers == 0 (modeling_utils.py
    `_set_gradient_checkpointing`, counting GradientCheckpointingLayer blocks only): blocks
    0, N, 2N, ... are recomputed whole, the others keep their activations. `layers` with
    checkpoint_every N is exactly that; `full` and `selective` are N = 1 (every block)."""
    mode = plan.activation_checkpointing
    if mode == "none":
        return None
    kwargs: dict[str, Any] = {"use_reentrant": False}  # the reentrant form cannot run a policy
    if mode == "full":
        return kwargs, 1
    if mode == "layers":
        return kwargs, plan.checkpoint_every
    if mode == "selective":
        return {**kwargs, "context_fn": selective_context_fn(tp=plan.tp > 1)}, 1
    raise ValueError(f"activation_checkpointing: '{mode}' is not a mode; allowed: none, selective, layers, full")


def apply_checkpointing(model: nn.Module, plan: Plan) -> None:
    """Set the plan's checkpointing on the model's decoder blocks (before any wrapper)."""
    settings = checkpoint_settings(plan)
    if settings is None:
        return
    kwargs, every_n_layers = settings
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)


def enable_full_recompute(model: nn.Module) -> None:
    """Every block recomputed whole (profiling and the activation estimate use it outside a plan)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointed_blocks(model: nn.Module) -> list[bool]:
    """Per decoder block, whether it is set to recompute (what `apply_checkpointing` did)."""
    from paratune.models import decoder_blocks

    return [bool(getattr(block, "gradient_checkpointing", False)) for block in decoder_blocks(model)]
