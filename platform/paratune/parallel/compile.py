"""torch.compile of each decoder block (paratune.levers): WIP, being built (issue 28)."""

from __future__ import annotations

from torch import nn

from paratune.plan import Plan


def compile_blocks(model: nn.Module, plan: Plan) -> None:
    """Compile every decoder block (after tp and checkpointing, before DDP / FSDP2 wrap them)."""
    if plan.compile:
        raise NotImplementedError("compile: true is not wired yet")
