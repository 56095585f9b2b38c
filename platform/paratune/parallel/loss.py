"""The loss's form (paratune.levers: standard, vocab_parallel, chunked), decided per model and applied.

* standard: transformers' own loss on the head's full (gathered) logits.
* vocab_parallel (tp > 1): the LM head's logits stay a DTensor sharded over the vocabulary
  (paratune.parallel.tp lays the head out so) and transformers' loss runs on it inside torch's
  `loss_parallel()` (forward and backward): no all-gather of the logits, their gradient stays
  sharded. torch's context has no try/finally (torch/distributed/tensor/parallel/loss.py: after
  an exception its DTensor op overrides stay installed in the process); a reused worker group
  would carry them into the next plan, so paratune's `loss_context` always closes it.
* chunked (tp 1): the head and the cross-entropy run over chunks of tokens, each chunk's logits
  recomputed in backward (torch.utils.checkpoint), so the fp32 logits of the whole micro-batch
  never exist at once. The head module is swapped for `ChunkedLossHead` (same parameters, same
  names): called from the model's forward it passes the hidden states through; the model's
  `loss_function` (transformers' setter) calls it again with the labels, so every chunk runs
  inside the head module's own call (ZeRO-3 gathers the weight in the head's hooks) and inside
  the model's forward (FSDP2's root holds the head's weight unsharded only there). On CUDA with
  liger-kernel importable, its fused linear cross-entropy replaces the torch chunks.

`resolve_loss_form` says which form a plan gets on a model, and why `auto` fell back;
preflight refuses an explicit form that cannot apply (`loss_form_refusal`), before any worker.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratune.levers.loss import chunk_tokens
from paratune.model.build import decoder_parts
from paratune.config.plan import Plan

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default
FORM_ATTR = "paratune_loss_form"  # on the model (and pipeline stages): the form that runs
FALLBACK_ATTR = "paratune_loss_fallback"  # why `auto` did not get vocab_parallel (None: it did, or not asked)

# Config fields with which a family's *ForCausalLM changes the logits between the head and the loss
# (Gemma-2/3's final-logit soft-capping, Cohere's logit_scale, Granite's logits_scaling): the
# chunked head would skip that step (refused). All are pointwise, so vocab-sharded logits take them.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
TIED_REASON = ("the LM head is tied to the input embedding (tie_word_embeddings true): paratune keeps a tied "
               "head's logits gathered")
PIPELINE_REASON = ("under pp the last stage's loss runs inside the pipeline schedule, which paratune does not "
                   "run inside loss_parallel (its backward is the schedule's, outside any context of the step)")
CP_REASON = ("under cp the sequence is sharded by context_parallel; paratune's cp loss (paratune.parallel.cp) "
             "runs on gathered logits")


# A MoE family adds its routers' load-balancing loss (a plain tensor) to the cross-entropy inside
# its forward; under loss_parallel that cross-entropy is a DTensor, and the sum's backward mixes them
# ("aten.mul.Tensor got mixed torch.Tensor and DTensor", measured on gloo with tiny-mixtral, tp 2).
AUX_LOSS_REASON = ("output_router_logits true: the family adds the routers' load-balancing loss to the loss "
                   "inside its forward, a plain tensor beside loss_parallel's DTensor loss, and the backward "
                   "cannot mix them")


def logit_transform(config) -> str | None:
    """The config field (and value) with which the family transforms its logits after the head, or None."""
    for field in LOGIT_TRANSFORM_FIELDS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0) and not isinstance(value, bool):
            return f"{field} {value}"
    return None


def _vocab_parallel_obstacle(plan: Plan, config) -> str | None:
    if plan.pp > 1:
        return f"pp {plan.pp}: {PIPELINE_REASON}"
    if getattr(plan, "cp", 1) > 1:
        return f"cp {plan.cp}: {CP_REASON}"
    if getattr(config, "tie_word_embeddings", False):
        return TIED_REASON
    from paratune.model.build import adds_router_aux_loss

    if adds_router_aux_loss(config):
        return AUX_LOSS_REASON
    # A family's logit transform (LOGIT_TRANSFORM_FIELDS) is pointwise: it keeps the vocab sharding
    # (Gemma-2's tanh soft-cap on a Shard(-1) DTensor under loss_parallel: exact, measured).
    return None


def resolve_loss_form(plan: Plan, config) -> tuple[str, str | None]:
    """(the form this plan's model trains with, why `auto` fell back to standard or None).
    Raises ValueError for an explicit form the model cannot take (preflight says it first)."""
    from paratune.levers import loss_form

    form = loss_form(plan)
    # auto under torch's tp that levers.loss_form already resolved to standard (pp, cp) still says why.
    if form == "vocab_parallel" or (plan.loss == "auto" and plan.tp > 1 and plan.strategy != "zero"):
        obstacle = _vocab_parallel_obstacle(plan, config)
        if obstacle is not None:
            if plan.loss == "auto":
                return "standard", obstacle
            raise ValueError(f"loss: 'vocab_parallel' with {obstacle}; allowed: 'standard' or 'auto'")
    if form == "chunked":
        transform = logit_transform(config)
        if transform is not None:
            raise ValueError(f"loss: 'chunked' with {type(config).__name__} ({transform}): the family transforms "
                             "its logits after the head, which the chunked loss does not; allowed: 'standard'")
    return form, None


def loss_form_refusal(plan: Plan, config) -> str | None:
    """Why an explicit loss form cannot run on this model (preflight's rule), or None."""
    try:
        resolve_loss_form(plan, config)
    except ValueError as err:
        return str(err)
    return None


def recorded_loss_form(module: nn.Module) -> tuple[str, str | None]:
    """(form, fallback reason) recorded on the model by `apply_loss_form`, found under any wrapper
    (DDP's .module, DeepSpeed's engine, a pipeline's container of stages); standard if none."""
    for sub in module.modules():
        if hasattr(sub, FORM_ATTR):
            return getattr(sub, FORM_ATTR), getattr(sub, FALLBACK_ATTR, None)
    return "standard", None


def apply_lever(model: nn.Module, plan: Plan, place) -> None:  # noqa: ANN001 - a runner.WorkerPlace
    """The loss lever's runtime (paratune.levers.loss: stage before_layout)."""
    apply_loss_form(model, plan)


def apply_loss_form(model: nn.Module, plan: Plan) -> str:
    """Decide the plan's form for this model, record it on the model, and set the head for chunked
    (vocab_parallel's head layout is paratune.parallel.tp's, which reads the record). Runs on the
    meta device before any layout (nothing is allocated) or on a built model (ZeRO)."""
    form, fallback = resolve_loss_form(plan, model.config)
    setattr(model, FORM_ATTR, form)
    setattr(model, FALLBACK_ATTR, fallback)
    if form == "chunked":
        use_chunked_head(model)
    return form


@contextlib.contextmanager
def vocab_parallel_context() -> Iterator[None]:
    """torch's loss_parallel(), closed even when the forward or backward inside raises."""
    from torch.distributed.tensor.parallel import loss_parallel

    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        # torch's generator has no try/finally: resuming it as on success removes its op handlers.
        context.__exit__(None, None, None)


def loss_context(form: str) -> contextlib.AbstractContextManager:
    """What forward and backward of one micro-batch run inside (vocab_parallel: loss_parallel)."""
    return vocab_parallel_context() if form == "vocab_parallel" else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the loss's value (under loss_parallel transformers returns a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


# ---- chunked ----

def liger_available(device: torch.device) -> bool:
    """Whether liger-kernel's fused linear cross-entropy can run here: CUDA and the package importable."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # upcast as transformers' ForCausalLMLoss does
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed cross-entropy of head(hidden) against labels (flat), `chunk` tokens at a time; each
    chunk's logits are recomputed in backward instead of saved."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_chunk_loss_sum, hidden[start:start + chunk], labels[start:start + chunk],
                                   weight, bias, use_reentrant=False)
    return total


def _liger_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")(weight, hidden, labels, bias)


class ChunkedLossHead(nn.Linear):
    """The LM head of a chunked-loss model (its class swapped in place: same parameters and names).
    Without labels it returns the hidden states (the model's forward calls it so); with labels, the
    loss (the model's loss_function calls it so), computed inside this module's own call."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if labels is None:
            return hidden
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1).to(flat.device)
        if liger_available(flat.device):
            total = _liger_loss_sum(flat, self.weight, self.bias, labels)
        else:
            total = chunked_cross_entropy(flat, self.weight, self.bias, labels,
                                          chunk_tokens(flat.shape[0], self.out_features, self.in_features))
        # transformers: mean over the labelled tokens, or the sum over num_items_in_batch when given
        count = (labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
        if torch.is_tensor(count):
            count = count.to(total.device)
        return total / count


def shifted_labels(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' next-token labels: label t is token t + 1, the last position ignored."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class ChunkedCausalLMLoss:
    """The model's `loss_function` for the chunked form: transformers' ForCausalLMLoss signature,
    `logits` being the hidden states the ChunkedLossHead passed through."""

    def __init__(self, head: ChunkedLossHead):
        self.head = head

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if ignore_index != IGNORE_INDEX:
            raise ValueError(f"loss: 'chunked' supports ignore_index {IGNORE_INDEX}, got {ignore_index}")
        return self.head(logits, labels=shifted_labels(labels, shift_labels), num_items_in_batch=num_items_in_batch)


def use_chunked_head(model: nn.Module) -> ChunkedLossHead:
    """Swap the model's LM head to ChunkedLossHead and its loss_function to the chunked loss."""
    head = decoder_parts(model).head
    if type(head) is not nn.Linear and not isinstance(head, ChunkedLossHead):
        raise ValueError(f"loss: 'chunked' needs the LM head to be an nn.Linear, {type(model).__name__}'s is a "
                         f"{type(head).__name__}; allowed: 'standard'")
    head.__class__ = ChunkedLossHead
    model.loss_function = ChunkedCausalLMLoss(head)  # PreTrainedModel's setter: `_loss_function`
    return head


def stage_loss(head: nn.Module | None, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A pipeline's last-stage loss (mean over shifted tokens): chunked through the head when it is a
    ChunkedLossHead (the stage returned the hidden states), else cross-entropy on the logits."""
    if isinstance(head, ChunkedLossHead):
        return head(logits, labels=shifted_labels(labels))
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
