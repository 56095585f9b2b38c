"""The loss's form: the LM head's full logits then cross-entropy, vocabulary-parallel under tp, or
chunked over tokens (runtime: paratune.parallel.loss)."""

from __future__ import annotations

import math
from typing import Any, Literal

from paratune.levers.registry import Lever, LeverField, register

# The loss's form. standard: the LM head's full logits, then cross-entropy (transformers' own).
# vocab_parallel: under tp, logits stay sharded over the vocabulary and the loss is computed by
# torch's loss_parallel. chunked: tp 1, head + cross-entropy over chunks of tokens, so the logits
# of the whole sequence never exist at once. auto: vocab_parallel when tp > 1 and the layout
# allows it, else standard.
LossForm = Literal["auto", "standard", "vocab_parallel", "chunked"]

VOCAB_PARALLEL_ZERO_REASON = ("ZeRO's tp is DeepSpeed's AutoTP, which keeps the LM head's output gathered; "
                              "vocab-parallel loss needs the head as a DTensor sharded over the vocabulary")
VOCAB_PARALLEL_PP_REASON = ("the pipeline schedule runs the last stage's backward outside the step's loss_parallel "
                            "context, so the sharded logits' gradient would be computed without it")
VOCAB_PARALLEL_CP_REASON = "context parallel's step computes its loss over sequence shards with its own scaling"
CHUNKED_TP_REASON = ("under tp the head's logits are already split over tp ranks: use 'vocab_parallel' "
                     "(or 'auto')")


def loss_form(plan: Any) -> str:
    """What the plan's loss is, `auto` resolved: vocab_parallel under torch's tp without pp or cp, else
    standard. The model can still make auto fall back (a head tied to the embedding:
    paratune.parallel.loss.resolve_loss_form, which records why)."""
    if plan.loss != "auto":
        return plan.loss
    torch_tp = plan.tp > 1 and plan.strategy != "zero" and plan.pp == 1 and plan.cp == 1
    return "vocab_parallel" if torch_tp else "standard"


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: liger-kernel's rule (fused_linear_cross_entropy.py), a power of two near
    tokens / ceil(vocab / hidden), so a chunk's logits take about as much memory as the hidden
    states of the whole micro-batch (Llama-3-8B, 8192 tokens: 256-token chunks, 131 MB of fp32
    logits instead of 4.2 GB). The same rule as the CUDA kernel's, so CPU and GPU trials chunk alike."""
    chunks = max(1, math.ceil(vocab / hidden))
    return max(1, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / chunks))))))


def _rules(plan: Any) -> None:
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


def _label(plan: dict) -> str | None:
    if plan.get("loss", "auto") in ("auto", "standard"):
        return None
    return {"vocab_parallel": "vp-loss", "chunked": "chunked-loss"}.get(plan["loss"], plan["loss"])


LOSS = register(Lever(
    name="loss",
    doc="the loss's form: standard, vocab-parallel (tp) or chunked (tp 1)",
    fields=(LeverField("loss", LossForm, "auto", "auto | standard | vocab_parallel (tp) | chunked (tp 1)"),),
    rules=_rules,
    label=_label,
    label_rank=110,
    apply=(("before_layout", "paratune.parallel.loss:apply_lever"),),
))
