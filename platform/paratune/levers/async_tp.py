"""Async tensor parallelism: the tp collectives micro-pipelined into the compiled blocks' matmuls
(CUDA only; runtime: paratune.parallel.compile, which turns it on while compiling the blocks)."""

from __future__ import annotations

from typing import Any

from paratune.levers.registry import Lever, LeverField, register

ASYNC_TP_CPU_REASON = ("async TP fuses the tp collectives into the matmuls with symmetric memory "
                       "(torch._inductor micro-pipeline TP over NCCL); CPU workers have neither")


def _rules(plan: Any) -> None:
    if plan.async_tp:
        if plan.device == "cpu":
            raise ValueError(f"async_tp: true with device 'cpu': {ASYNC_TP_CPU_REASON}; allowed: false on CPU")
        needs = [what for what, ok in (("tp > 1", plan.tp > 1), ("compile: true", plan.compile),
                                       ("sequence_parallel: true", plan.sequence_parallel),
                                       ("strategy 'ddp' or 'fsdp'", plan.strategy != "zero")) if not ok]
        if needs:
            raise ValueError(f"async_tp: true needs {', '.join(needs)} (it fuses the sequence-parallel "
                             "all-gather / reduce-scatter into the compiled blocks' matmuls); allowed: false")


def _device_refusal(plan: Any, gpu: str | None, has_fp8: bool) -> str | None:
    if plan.async_tp and gpu is None:
        return f"async_tp: true on CPU workers: {ASYNC_TP_CPU_REASON}; allowed: false on CPU"
    return None


def async_tp_hidden(plan: Any) -> float:
    """The share of the tp collectives async TP hides: the forward's. torch's micro-pipelining
    (Inductor's pass over the compiled blocks) fuses the forward's all-gather -> matmul and
    matmul -> reduce-scatter; the PyTorch team measured up to 29% (8B) / 20% (70B) faster
    forwards but ~8% end to end ("Introducing Async Tensor Parallelism in PyTorch",
    discuss.pytorch.org/t/209487). Forward collectives: 2 a block a pass (the recomputed forward
    of full checkpointing is another pass), backward's 2: (1 + again) / (2 + again)."""
    if not plan.async_tp:
        return 0.0
    again = 1.0 if plan.activation_checkpointing == "full" else 0.0
    return (1 + again) / (2 + again)


ASYNC_TP = register(Lever(
    name="async_tp",
    doc="tp collectives fused into the compiled blocks' matmuls (CUDA only)",
    fields=(LeverField("async_tp", bool, False, "CUDA only: tp collectives fused into the compiled matmuls"),),
    rules=_rules,
    device_refusal=_device_refusal,
    label=lambda plan: "async-tp" if plan.get("async_tp") else None,
    label_rank=120,
    tp_comm_hidden=async_tp_hidden,
))
