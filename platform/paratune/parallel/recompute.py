"""Activation checkpointing: none, selective (per op), every N-th layer, full (paratune.levers).

WIP: only `none` and `full` are wired yet; the other modes are being built (issue 28).
"""

from __future__ import annotations

import torch
from torch import nn

from paratune.plan import Plan

aten = torch.ops.aten
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


def apply_checkpointing(model: nn.Module, plan: Plan) -> None:
    """Set the plan's checkpointing on the model's decoder blocks (before any wrapper)."""
    if plan.activation_checkpointing == "none":
        return
    if plan.activation_checkpointing == "full":
        enable_full_recompute(model)
        return
    raise NotImplementedError(f"activation_checkpointing: '{plan.activation_checkpointing}' is not wired yet")


def enable_full_recompute(model: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
