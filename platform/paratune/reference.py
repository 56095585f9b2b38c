"""The single-process reference: the same model, data, optimizer and global batch on one process.

A distributed configuration is only correct if its first steps' losses match this one's.
"""

from __future__ import annotations

import torch

from paratune.data import TokenBatches
from paratune.models import build_config, build_model
from paratune.parallel import StepRunner, apply_activation_checkpointing, make_optimizer
from paratune.plan import Plan


def reference_losses(plan: Plan, steps: int | None = None) -> list[float]:
    """Per-step mean loss of the plan's training run on one CPU process (fp32, no sharding)."""
    steps = plan.total_steps if steps is None else steps
    config = build_config(plan.model, plan.model_overrides)
    model = build_model(config, seed=plan.seed)
    apply_activation_checkpointing(model, plan)
    model.train()
    device = torch.device("cpu")
    runner = StepRunner(model, make_optimizer(model.parameters(), plan), plan, device,
                        autocast=plan.precision == "bf16")
    data = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed)
    torch.manual_seed(plan.seed + 1)
    losses = []
    for step in range(steps):
        micro = data.micro_batches(step, dp_rank=0, dp_degree=1, micro_batch=plan.micro_batch)
        losses.append(float(runner.train_step(micro)))
    return losses


def max_loss_difference(losses: list[float], reference: list[float]) -> float:
    n = min(len(losses), len(reference))
    if n == 0:
        raise ValueError("losses: nothing to compare")
    return max(abs(a - b) for a, b in zip(losses[:n], reference[:n]))
