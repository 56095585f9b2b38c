"""A small training loop of your own, tuned by paratune.

    paratune tune examples/user_loop/space.yaml --train-loop examples.user_loop.train:loop

paratune runs `loop` on every worker of each trial (as Ray Train's train_loop_per_worker: one
config dict), applies the trial's plan to the model and optimizer (`user_loop.prepare`), and
times each iteration of `user_loop.steps()` as one optimizer step: warm-up, measured steps and
stopping are paratune's, the model, loss and optimizer are yours.
"""

from __future__ import annotations

from typing import Any

import torch
from paratune.trial import user_loop
from paratune.model.build import build_config, build_model


def loop(config: dict[str, Any]) -> None:
    """Train the plan's model (a transformers causal LM from its preset) with AdamW, clipped.

    It trains what paratune's own trial trains (the preset's seeded weights, AdamW, clipping at
    the plan's grad_clip), so the sweep's loss-parity check of the winner holds for it too."""
    plan = user_loop.plan()
    config = build_config(plan.model, plan.model_overrides)
    model = build_model(config, seed=plan.seed)  # the same initial weights on every rank
    model, optimizer = user_loop.prepare(model, lambda params: torch.optim.AdamW(
        params, lr=plan.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=plan.weight_decay))
    batches = user_loop.batches(config.vocab_size)
    for step in user_loop.steps():
        micro = batches(step)
        total = 0.0
        for ids in micro:  # gradient accumulation over the plan's micro-batches
            with user_loop.autocast():
                loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        if plan.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        user_loop.log_loss(total)


def failing_loop(config: dict[str, Any]) -> None:
    """A loop that breaks in its second step: what a failed trial looks like (used by the tests)."""
    for step in user_loop.steps():
        if step == 1:
            raise RuntimeError("user loop failed at step 1")
        user_loop.log_loss(0.0)
