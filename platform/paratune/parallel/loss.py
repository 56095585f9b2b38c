"""The loss's form (paratune.levers: standard, vocab_parallel, chunked): WIP, being built (issue 28)."""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch import nn

from paratune.plan import Plan


def apply_loss_form(model: nn.Module, plan: Plan) -> None:
    """Set the model's head and loss for the plan's form (tp 1: chunked; under tp see paratune.parallel.tp)."""
    if plan.loss == "chunked":
        raise NotImplementedError("loss: 'chunked' is not wired yet")


def loss_context(plan: Plan) -> ContextManager:
    """What forward and backward of one micro-batch run inside (vocab_parallel: torch's loss_parallel)."""
    if plan.loss == "vocab_parallel":
        raise NotImplementedError("loss: 'vocab_parallel' is not wired yet")
    return contextlib.nullcontext()
