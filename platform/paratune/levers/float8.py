"""float8 training: torchao's float8 linears in the decoder blocks, and FSDP2's all-gather of float8
weights (runtime: paratune.parallel.float8)."""

from __future__ import annotations

from math import gcd
from typing import Any, Literal

from paratune.levers.registry import Lever, LeverField, register

# torchao's float8 training recipes: tensorwise (one scale per tensor, torchtitan's default) and
# rowwise (one scale per row, more accurate, slower). none: matmuls in the plan's precision.
Float8Recipe = Literal["none", "tensorwise", "rowwise"]

FLOAT8_PRECISION_REASON = ("torchao's float8 recipes cast bf16 activations and weights to float8 per "
                           "matmul; an fp32 plan has no bf16 compute to replace")
FLOAT8_ALL_GATHER_ROWWISE_REASON = ("torchao 0.18: 'enable_fsdp_float8_all_gather only supports tensorwise "
                                    "scaling granularity' (torchao/float8/config.py)")
FLOAT8_ZERO_REASON = ("DeepSpeed ZeRO flattens and partitions the parameters itself; torchao's float8 "
                      "linears are wired for DDP and FSDP2 (and FSDP2's float8 all-gather)")
FLOAT8_TOKENS_REASON = ("the weight gradient's float8 matmul reduces over a rank's tokens (torchao "
                        "float8_linear.py: grad_output.t() @ input) and CUDA's _scaled_mm needs that inner "
                        "dimension in multiples of 16")
FLOAT8_MULTIPLE = 16  # CUDA's _scaled_mm (torch/_meta_registrations.py _check_scaled_mm_sizes)
DEVICES_WITHOUT_FP8_REASON = "float8 matmuls need FP8 tensor cores (Hopper, Ada, Blackwell: sm_89+)"


def float8_rank_tokens(plan: Any) -> float:
    """Tokens a rank's float8 linears see per micro-batch: sequence parallelism gathers the
    sequence before the column-parallel matmuls, context parallelism keeps seq_len / cp of it."""
    return plan.micro_batch * plan.seq_len / plan.cp


def float8_allowed_micro_batches(plan: Any) -> str:
    """What the token rule allows at the plan's sequence length, in words."""
    per_sequence = plan.seq_len // plan.cp if plan.seq_len % plan.cp == 0 else None
    if per_sequence is None:
        return f"seq_len a multiple of cp {plan.cp} x {FLOAT8_MULTIPLE}"
    step = FLOAT8_MULTIPLE // gcd(per_sequence, FLOAT8_MULTIPLE)
    return f"micro_batch a multiple of {step} at seq_len {plan.seq_len}" + (f" and cp {plan.cp}" if plan.cp > 1 else "")


def _rules(plan: Any) -> None:
    if plan.float8 != "none":
        if plan.precision != "bf16":
            raise ValueError(f"float8: '{plan.float8}' needs precision 'bf16', got '{plan.precision}' "
                             f"({FLOAT8_PRECISION_REASON}); allowed: float8 'none' with fp32")
        if plan.strategy == "zero":
            raise ValueError(f"float8: '{plan.float8}' with strategy 'zero': {FLOAT8_ZERO_REASON}; "
                             "allowed: strategy 'ddp' or 'fsdp' with float8")
        tokens = float8_rank_tokens(plan)
        if tokens % FLOAT8_MULTIPLE:
            raise ValueError(f"float8: '{plan.float8}' with micro_batch {plan.micro_batch} x seq_len {plan.seq_len}"
                             f"{f' / cp {plan.cp}' if plan.cp > 1 else ''} = {tokens:g} tokens a rank: "
                             f"{FLOAT8_TOKENS_REASON}; allowed: {float8_allowed_micro_batches(plan)}, "
                             "or float8 'none'")
    if plan.float8_all_gather:
        if plan.strategy != "fsdp":
            raise ValueError(f"float8_all_gather: true needs strategy 'fsdp' (it is FSDP2's all-gather of "
                             f"float8 weights), got '{plan.strategy}'; allowed: false")
        if plan.fsdp is not None and plan.fsdp.sharding == "no_shard":
            raise ValueError("float8_all_gather: true with fsdp.sharding 'no_shard': replicated weights are never "
                             "all-gathered; allowed: false, or sharding 'full' / 'grad_op' / 'hybrid'")
        if plan.float8 != "tensorwise":
            reason = FLOAT8_ALL_GATHER_ROWWISE_REASON if plan.float8 == "rowwise" else "no float8 weights to gather"
            raise ValueError(f"float8_all_gather: true with float8 '{plan.float8}': {reason}; "
                             "allowed: float8 'tensorwise' with it")


def _device_refusal(plan: Any, gpu: str | None, has_fp8: bool) -> str | None:
    if plan.float8 != "none" and gpu is not None and not has_fp8:
        return (f"float8: '{plan.float8}' on {gpu}: {DEVICES_WITHOUT_FP8_REASON}; allowed: float8 'none' "
                f"on {gpu}")
    return None


def _label(plan: dict) -> str | None:
    """'fp8:tensorwise' ('+ag': the float8 all-gather). paratune.out.tables.strategy_label adds
    '(partial NN%)' where the plan converts under half of its linear FLOPs (it builds the model's
    meta copy: a lever does not reach into the runtime)."""
    if plan.get("float8", "none") == "none":
        return None
    return f"fp8:{plan['float8']}" + ("+ag" if plan.get("float8_all_gather") else "")


def _export_notes(plan: Any, tool: str) -> list[str]:
    return [f"{tool}: float8 recipe '{plan.float8}' (torchao) not expressed here"] if plan.float8 != "none" else []


FLOAT8 = register(Lever(
    name="float8",
    doc="torchao's float8 linears in the blocks (bf16 plans), and FSDP2's float8 all-gather",
    fields=(
        LeverField("float8", Float8Recipe, "none", "torchao float8 linears (bf16 plans): tensorwise | rowwise"),
        LeverField("float8_all_gather", bool, False, "FSDP2 all-gathers float8 weights (tensorwise only)"),
    ),
    rules=_rules,
    device_refusal=_device_refusal,
    label=_label,
    label_rank=90,
    export_notes=_export_notes,
    apply=(("before_layout", "paratune.parallel.float8:apply_lever"),),
    extra="float8",
))
