"""torch.compile of each decoder block: one graph, reused by every block (runtime:
paratune.parallel.compile)."""

from __future__ import annotations

from typing import Any

from paratune.levers.registry import Lever, LeverField, register

COMPILE_ZERO3_REASON = ("ZeRO-3 gathers each parameter in module hooks inside the blocks, which break "
                        "every compiled block's graph; DeepSpeed's own compile is not wired")
# torch.compile of each block on a device without kernel figures (the CPU entry; on a GPU with
# them compile's effect is paratune.costs.efficiency's fused memory traffic): an assumed share off the
# ideal compute time, until a profile or the sweep's refit measures it.
COMPILE_COMPUTE_SAVING = 0.10


def _rules(plan: Any) -> None:
    if plan.compile and plan.strategy == "zero" and plan.zero is not None and plan.zero.stage == 3:
        raise ValueError(f"compile: true with zero.stage 3: {COMPILE_ZERO3_REASON}; allowed: zero.stage 0-2 "
                         "with compile, or strategy 'fsdp'")
    if plan.compile and plan.warmup_steps < 1:
        raise ValueError("compile: true needs warmup_steps >= 1 (the first step compiles the blocks; it must "
                         "never be a measured step), got warmup_steps 0; allowed: warmup_steps 1 or more")


def _compute_time_factor(plan: Any) -> float:
    return 1 - COMPILE_COMPUTE_SAVING if plan.compile else 1.0


COMPILE = register(Lever(
    name="compile",
    doc="torch.compile of each decoder block (one graph, reused by every block)",
    fields=(LeverField("compile", bool, False, "torch.compile each decoder block", after="checkpoint_every"),),
    rules=_rules,
    label=lambda plan: "compiled" if plan.get("compile") else None,
    label_rank=100,
    compute_time_factor=_compute_time_factor,
    apply=(("before_wrap", "paratune.parallel.compile:apply_lever"),),
))
