"""float8 training through torchao (paratune.levers): WIP, being built (issue 28)."""

from __future__ import annotations

from torch import nn

from paratune.plan import Plan


def convert_to_float8(model: nn.Module, plan: Plan) -> None:
    """Swap the model's eligible linears for torchao's float8 ones (on the meta device, first)."""
    if plan.float8 != "none":
        raise NotImplementedError(f"float8: '{plan.float8}' is not wired yet")
