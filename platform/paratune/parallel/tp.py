"""Tensor parallelism with DTensor, from the model family's own TP plan in transformers.

q/k/v and gate/up are column-wise, o and down row-wise (the config's `base_model_tp_plan`);
the embedding is sharded over the vocabulary (row-wise) and the LM head column-wise with the
logits gathered, so the loss is the ordinary one. With sequence parallelism the norms and the
residual stream are sharded along the sequence between the attention/MLP blocks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from paratune.models import decoder_blocks

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def block_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """Per-block plan from transformers' `base_model_tp_plan` ('layers.*.' stripped)."""
    hf_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    plan: dict = {}
    for pattern, style in hf_plan.items():
        if not pattern.startswith("layers.*."):
            continue
        name = pattern.removeprefix("layers.*.")
        kind = style.split("_")[0]  # e.g. "colwise_rep" -> colwise
        if kind not in _STYLES:
            raise ValueError(f"tp: transformers plan style '{style}' for {name} is not supported")
        if kind == "rowwise" and sequence_parallel:
            plan[name] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan[name] = _STYLES[kind]()
    if not plan:
        raise ValueError(f"tp: {type(model).__name__} has no tensor-parallel plan in transformers")
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                               desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    base = model.model
    sp_out = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(base.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=sp_out))
    if sequence_parallel:
        parallelize_module(base.norm, tp_mesh, SequenceParallel())
    parallelize_module(model.lm_head, tp_mesh,
                       ColwiseParallel(input_layouts=sp_out, output_layouts=Replicate(), use_local_output=True))
    plan = block_plan(model, sequence_parallel)
    for block in decoder_blocks(model):
        parallelize_module(block, tp_mesh, plan)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, pp_group=None, tp_group=None) -> torch.Tensor:
    """Global-norm clipping over plain and DTensor gradients alike (same formula as torch's).

    torch.nn.utils.clip_grad_norm_ cannot mix tensors of different meshes; with pipeline
    stages the squared norms are summed across stages too. Parameters that DDP holds as local
    shards of a tensor-parallel weight (marked `_st_info` by torch's DDP transform) contribute
    their squared norms summed over the tp group.
    """
    import torch.distributed as dist

    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    shard_sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if hasattr(p, "_st_info"):
            shard_sq += norm.to(device) ** 2
        else:
            total_sq += norm.to(device) ** 2
    if tp_group is not None:
        dist.all_reduce(shard_sq, group=tp_group)
    total_sq += shard_sq
    grads = [p.grad for p in params]
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
