"""Activation checkpointing: none, selective (per op), every N-th layer, full (paratune.levers).

WIP: only `none` and `full` are wired yet; the other modes are being built (issue 28).
"""

from __future__ import annotations

from torch import nn

from paratune.plan import Plan


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
