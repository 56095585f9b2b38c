"""The throughput levers of a plan and their static rules: checkpointing modes, compile, float8,
the loss's form, async TP.

Each lever is a plain plan field (paratune.plan), so a space sweeps it like a degree. The rules
here see only the plan (and the model's config numbers): what no device can run is refused before
any worker starts, with the reason. What depends on the cluster's devices (float8 on a GPU without
FP8, async TP or anything CUDA-only on CPU workers) is checked against the device by
`device_refusal`, where the cluster is known (the cost model, the launch).

The runtime side lives in paratune.parallel: recompute (checkpointing), compile, float8, loss.
"""

from __future__ import annotations

from typing import Any, Literal

# A paratune.plan.Plan; not imported, since the plan imports this module for its fields' types.
Plan = Any

# none: keep every activation. selective: per op, every block: save the outputs of the matmuls and
# attention (SAVED_OPS in paratune.parallel.recompute), recompute the cheap ops (norms, activations,
# rotary, residual adds). layers: recompute every `checkpoint_every`-th block whole (torchtitan's
# selective_ac_option "2"). full: recompute every block whole.
Checkpointing = Literal["none", "selective", "layers", "full"]
# torchao's float8 training recipes: tensorwise (one scale per tensor, torchtitan's default) and
# rowwise (one scale per row, more accurate, slower). none: matmuls in the plan's precision.
Float8Recipe = Literal["none", "tensorwise", "rowwise"]
# The loss's form. standard: the LM head's full logits, then cross-entropy (transformers' own).
# vocab_parallel: under tp, logits stay sharded over the vocabulary and the loss is computed by
# torch's loss_parallel. chunked: tp 1, head + cross-entropy over chunks of tokens, so the logits
# of the whole sequence never exist at once. auto: vocab_parallel when tp > 1 and the layout
# allows it, else standard.
LossForm = Literal["auto", "standard", "vocab_parallel", "chunked"]

FLOAT8_PRECISION_REASON = ("torchao's float8 recipes cast bf16 activations and weights to float8 per "
                           "matmul; an fp32 plan has no bf16 compute to replace")
FLOAT8_ALL_GATHER_ROWWISE_REASON = ("torchao 0.18: 'enable_fsdp_float8_all_gather only supports tensorwise "
                                    "scaling granularity' (torchao/float8/config.py)")
FLOAT8_ZERO_REASON = ("DeepSpeed ZeRO flattens and partitions the parameters itself; torchao's float8 "
                      "linears are wired for DDP and FSDP2 (and FSDP2's float8 all-gather)")
COMPILE_ZERO3_REASON = ("ZeRO-3 gathers each parameter in module hooks inside the blocks, which break "
                        "every compiled block's graph; DeepSpeed's own compile is not wired")
ASYNC_TP_CPU_REASON = ("async TP fuses the tp collectives into the matmuls with symmetric memory "
                       "(torch._inductor micro-pipeline TP over NCCL); CPU workers have neither")
VOCAB_PARALLEL_ZERO_REASON = ("ZeRO's tp is DeepSpeed's AutoTP, which keeps the LM head's output gathered; "
                              "vocab-parallel loss needs the head as a DTensor sharded over the vocabulary")
VOCAB_PARALLEL_PP_REASON = ("the pipeline schedule runs the last stage's backward outside the step's loss_parallel "
                            "context, so the sharded logits' gradient would be computed without it")
VOCAB_PARALLEL_CP_REASON = "context parallel's step computes its loss over sequence shards with its own scaling"
CHUNKED_TP_REASON = ("under tp the head's logits are already split over tp ranks: use 'vocab_parallel' "
                     "(or 'auto')")
FLOAT8_TOKENS_REASON = ("the weight gradient's float8 matmul reduces over a rank's tokens (torchao "
                        "float8_linear.py: grad_output.t() @ input) and CUDA's _scaled_mm needs that inner "
                        "dimension in multiples of 16")
FLOAT8_MULTIPLE = 16  # CUDA's _scaled_mm (torch/_meta_registrations.py _check_scaled_mm_sizes)
DEVICES_WITHOUT_FP8_REASON = "float8 matmuls need FP8 tensor cores (Hopper, Ada, Blackwell: sm_89+)"


def check_levers(plan: Plan) -> None:
    """The rules of the levers that hold on every device; raises ValueError(field, value, allowed)."""
    ac = plan.activation_checkpointing
    if plan.checkpoint_every != 2 and ac != "layers":
        raise ValueError(f"checkpoint_every: {plan.checkpoint_every} is used only with activation_checkpointing "
                         f"'layers', got '{ac}'; allowed: leave it out, or activation_checkpointing 'layers'")
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
    if plan.compile and plan.strategy == "zero" and plan.zero is not None and plan.zero.stage == 3:
        raise ValueError(f"compile: true with zero.stage 3: {COMPILE_ZERO3_REASON}; allowed: zero.stage 0-2 "
                         "with compile, or strategy 'fsdp'")
    if plan.compile and plan.warmup_steps < 1:
        raise ValueError("compile: true needs warmup_steps >= 1 (the first step compiles the blocks; it must "
                         "never be a measured step), got warmup_steps 0; allowed: warmup_steps 1 or more")
    if plan.loss == "vocab_parallel":
        if plan.tp == 1:
            raise ValueError("loss: 'vocab_parallel' needs tp > 1 (it keeps the head's logits sharded over the "
                             "tp ranks), got tp 1; allowed: 'standard', 'chunked' or 'auto' with tp 1")
        if plan.strategy == "zero":
            raise ValueError(f"loss: 'vocab_parallel' with strategy 'zero': {VOCAB_PARALLEL_ZERO_REASON}; "
                             "allowed: 'standard' or 'auto'")
        if plan.pp > 1:
            raise ValueError(f"loss: 'vocab_parallel' with pp {plan.pp}: {VOCAB_PARALLEL_PP_REASON}; allowed: "
                             "'standard' or 'auto' (standard under pp)")
        if plan.cp > 1:
            raise ValueError(f"loss: 'vocab_parallel' with cp {plan.cp}: {VOCAB_PARALLEL_CP_REASON}; allowed: "
                             "'standard' or 'auto' (standard under cp)")
    if plan.loss == "chunked" and plan.tp > 1:
        raise ValueError(f"loss: 'chunked' with tp {plan.tp}: {CHUNKED_TP_REASON}")
    if plan.async_tp:
        if plan.device == "cpu":
            raise ValueError(f"async_tp: true with device 'cpu': {ASYNC_TP_CPU_REASON}; allowed: false on CPU")
        needs = [what for what, ok in (("tp > 1", plan.tp > 1), ("compile: true", plan.compile),
                                       ("sequence_parallel: true", plan.sequence_parallel),
                                       ("strategy 'ddp' or 'fsdp'", plan.strategy != "zero")) if not ok]
        if needs:
            raise ValueError(f"async_tp: true needs {', '.join(needs)} (it fuses the sequence-parallel "
                             "all-gather / reduce-scatter into the compiled blocks' matmuls); allowed: false")


def float8_rank_tokens(plan: Plan) -> float:
    """Tokens a rank's float8 linears see per micro-batch: sequence parallelism gathers the
    sequence before the column-parallel matmuls, context parallelism keeps seq_len / cp of it."""
    return plan.micro_batch * plan.seq_len / plan.cp


def float8_allowed_micro_batches(plan: Plan) -> str:
    """What the token rule allows at the plan's sequence length, in words."""
    from math import gcd

    per_sequence = plan.seq_len // plan.cp if plan.seq_len % plan.cp == 0 else None
    if per_sequence is None:
        return f"seq_len a multiple of cp {plan.cp} x {FLOAT8_MULTIPLE}"
    step = FLOAT8_MULTIPLE // gcd(per_sequence, FLOAT8_MULTIPLE)
    return f"micro_batch a multiple of {step} at seq_len {plan.seq_len}" + (f" and cp {plan.cp}" if plan.cp > 1 else "")


def loss_form(plan: Plan) -> str:
    """What the plan's loss is, `auto` resolved: vocab_parallel under torch's tp without pp or cp, else
    standard. The model can still make auto fall back (a head tied to the embedding:
    paratune.parallel.loss.resolve_loss_form, which records why)."""
    if plan.loss != "auto":
        return plan.loss
    torch_tp = plan.tp > 1 and plan.strategy != "zero" and plan.pp == 1 and plan.cp == 1
    return "vocab_parallel" if torch_tp else "standard"


def device_refusal(plan: Plan, gpu: str | None, has_fp8: bool) -> str | None:
    """Why the plan cannot run on this device (None: it can). `gpu`: the GPU model the workers get,
    None for CPU workers; `has_fp8`: the device table's word on FP8 tensor cores."""
    if plan.async_tp and gpu is None:
        return f"async_tp: true on CPU workers: {ASYNC_TP_CPU_REASON}; allowed: false on CPU"
    if plan.float8 != "none" and gpu is not None and not has_fp8:
        return (f"float8: '{plan.float8}' on {gpu}: {DEVICES_WITHOUT_FP8_REASON}; allowed: float8 'none' "
                f"on {gpu}")
    return None
