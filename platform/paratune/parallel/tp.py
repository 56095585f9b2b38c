"""Tensor parallelism with DTensor, from the model family's own TP plan in transformers.

Each block follows the config's `base_model_tp_plan` (where transformers ships none, the plan
paratune.parallel.tp_derive derives from the blocks' linears, in the same style names), with transformers' meaning of each style
(transformers/distributed/tensor_parallel.py): `colwise` shards a linear's outputs and keeps the
output sharded (q/k/v, gate/up), `rowwise` shards its inputs and all-reduces the output (o,
down); `colwise_gather_output` / `rowwise_split_input` are the same shardings with the output
gathered and the next input split locally: what families with fused projections use (Phi-3's
qkv_proj and gate_up_proj: the gather reassembles q|k|v before the attention splits it, so a
naive column split is right; the attention itself then runs on every head on every tp rank);
`replicated_with_grad_allreduce` keeps a parameter whole on every rank and sums its gradient over
the tp group (Qwen3's per-head q/k norms only see this rank's heads). Any other style is refused
before launch (paratune.checks.preflight). The plan's keys name modules under the base model
("layers.*.self_attn.q_proj"; GPT-NeoX "layers.*.attention.query_key_value"): the blocks' stack
is found generically (models.decoder_parts), as are the input embedding and the head, whatever
the family calls them (embed_tokens, GPT-NeoX's embed_in, GPT-2's wte). The embedding is sharded
over the vocabulary (row-wise) and the LM head column-wise: its logits gathered for the ordinary
loss, or kept sharded over the vocabulary for the vocab-parallel loss (paratune.parallel.loss:
the default under tp where the model allows it); a tied head stays tied to the sharded embedding
(and gathered). With sequence parallelism
the norms and the residual stream are sharded along the sequence between the attention/MLP
blocks.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from paratune.model.build import decoder_blocks, decoder_parts
from paratune.parallel.loss import recorded_loss_form
from paratune.parallel.tp_derive import family_tp_plan

# The transformers styles implemented here (name -> what it does). paratune.checks.preflight refuses a
# plan whose family uses any other style, before a worker starts.
SUPPORTED_STYLES: dict[str, str] = {
    "colwise": "output features sharded, output stays sharded",
    "colwise_gather_output": "output features sharded, output gathered (fused projections)",
    "rowwise": "input features sharded, output all-reduced",
    "rowwise_split_input": "input features sharded from a replicated input, output all-reduced",
    "replicated_with_grad_allreduce": "parameter replicated, gradient summed over the tp group",
}
LINEAR_STYLES = {name for name in SUPPORTED_STYLES if name.startswith(("colwise", "rowwise"))}


def _all_reduce_grad(grad: torch.Tensor, group) -> torch.Tensor:
    out = grad.clone()
    dist.all_reduce(out, group=group)
    return out


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module whose parameters stay whole on every tp rank while its input is sharded (a norm
    over each head, between a colwise and a rowwise projection): each rank's gradient covers only
    its own heads, so the gradients are summed over the tp group.

    The sum is taken per backward, on the gradient before it is accumulated (a tensor hook on the
    parameter), so gradient accumulation over micro-batches adds already-reduced gradients
    (transformers' own hook all-reduces `param.grad` after accumulation, which would sum earlier
    micro-batches again). Hooks are attached at forward time: materialization, FSDP2 and DDP
    replace parameter objects after the plan is applied."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()

        def hook_parameters(mod: nn.Module, args) -> None:
            if not torch.is_grad_enabled():
                return
            for param in mod.parameters(recurse=False):
                if param.requires_grad and not getattr(param, "_paratune_tp_grad_sum", False):
                    param.register_hook(lambda grad: _all_reduce_grad(grad, group))
                    param._paratune_tp_grad_sum = True

        module.register_forward_pre_hook(hook_parameters)
        return module


def _style(name: str, pattern: str, sequence_parallel: bool) -> ParallelStyle:
    """torch's ParallelStyle for one transformers style name (see SUPPORTED_STYLES)."""
    out = Shard(1) if sequence_parallel else Replicate()  # rowwise: reduce-scatter under SP
    if name == "colwise":
        return ColwiseParallel()
    if name == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel(output_layouts=out)
    if name == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if name == "replicated_with_grad_allreduce":
        return ReplicatedWithGradAllReduce()
    raise ValueError(f"tp: transformers plan style '{name}' for {pattern} is not supported; "
                     f"allowed: {', '.join(SUPPORTED_STYLES)}")


def block_prefix(model: nn.Module, plan: dict | None = None) -> str:
    """How transformers' TP plan keys of the family start for a block's module: the blocks'
    stack under the base model, then '*' ('layers.*.' for Llama and GPT-NeoX, 'h.*.' for GPT-2).
    Where the plan's keys are relative to an inner text model (Llama-4's `layers.*.` under
    `model.layers`), the shortest tail of the stack's path that the plan's keys start with."""
    path = decoder_parts(model).stack_path.split(".")
    for start in range(len(path)):
        prefix = ".".join(path[start:]) + ".*."
        if not plan or any(key.startswith(prefix) for key in plan):
            return prefix
    return f"{'.'.join(path)}.*."


def block_plan(model: nn.Module, sequence_parallel: bool, expert_parallel: bool = False) -> dict:
    """Per-block plan from transformers' `base_model_tp_plan`, or the one paratune derives where the
    family has none (paratune.parallel.tp_derive), the blocks' prefix stripped.
    `expert_parallel`: the routed experts are expert parallelism's (paratune.parallel.ep), not tp's."""
    from paratune.parallel.ep import expert_module_patterns, under_experts

    hf_plan, _ = family_tp_plan(model)
    prefix = block_prefix(model, hf_plan)
    experts = expert_module_patterns(model.config) if expert_parallel else []
    plan: dict = {}
    for pattern, style in hf_plan.items():
        if not pattern.startswith(prefix) or under_experts(pattern, experts):
            continue
        plan[pattern.removeprefix(prefix)] = _style(style, pattern, sequence_parallel)
    if not plan:
        raise ValueError(f"tp: {type(model).__name__} has no tensor-parallel plan in transformers")
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                               desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def linear_splits(model: nn.Module, expert_parallel: bool = False) -> dict[int, str]:
    """Which dimension tp splits of each block linear (by module id): "out" for a column-parallel
    one (its out_features / tp on each rank), "in" for a row-parallel one (in_features / tp): what
    a rank's matmuls see after `apply_tp`, from the same per-block plan."""
    plan = block_plan(model, sequence_parallel=False, expert_parallel=expert_parallel)
    splits: dict[int, str] = {}
    for block in decoder_blocks(model):
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            for key, style in plan.items():
                if fnmatch(name, key):
                    if isinstance(style, ColwiseParallel):
                        splits[id(module)] = "out"
                    elif isinstance(style, RowwiseParallel):
                        splits[id(module)] = "in"
                    break
    return splits


def adapted_plan(block: nn.Module, plan: dict, sequence_parallel: bool = False) -> dict:
    """A block's plan with each LoRA-wrapped linear (paratune.model.adapters) laid out as peft lays LoRA
    under transformers' tp (peft tuners/lora/model.py): the base layer keeps the style; beside a
    column-parallel base, lora_B is column-parallel the same way (its r inputs whole) and lora_A
    stays whole, its gradient summed by lora_B's input; beside a row-parallel base, lora_A is
    row-parallel (its partial r outputs reduced to whole, or reduce-scattered along the sequence
    under sequence parallelism) and lora_B stays whole, its gradient summed over the tp group
    when each rank saw only its part of the sequence. Under sequence parallelism a column-parallel
    wrapper's input arrives as a replicated DTensor (the attention's / MLP's PrepareModuleInput):
    made local first, as without it, for the whole lora_A."""
    from paratune.model.adapters import ADAPTER_NAME, is_lora_layer

    out: dict = {}
    for key, style in plan.items():
        module = block.get_submodule(key) if "*" not in key else None
        if module is None or not is_lora_layer(module):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        a, b = f"{key}.lora_A.{ADAPTER_NAME}", f"{key}.lora_B.{ADAPTER_NAME}"
        if isinstance(style, ColwiseParallel):
            out[b] = ColwiseParallel(output_layouts=style.output_layouts[0], use_local_output=style.use_local_output)
            if sequence_parallel:
                out[key] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
        elif isinstance(style, RowwiseParallel):
            out[a] = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0])
            if style.output_layouts[0] != Replicate():
                out[b] = ReplicatedWithGradAllReduce()
        else:
            raise ValueError(f"peft: LoRA on {key} under tp style {type(style).__name__}: not supported; "
                             "allowed: column- or row-parallel linears")
    return out


def head_style(model: nn.Module, input_layout) -> ColwiseParallel:
    """The LM head's layout: column-parallel (sharded over the vocabulary). With the vocab-parallel
    loss (paratune.parallel.loss, recorded on the model) its logits stay a DTensor sharded over the
    vocabulary for loss_parallel; otherwise they are gathered for the ordinary loss."""
    if recorded_loss_form(model)[0] == "vocab_parallel":
        return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate(), use_local_output=True)


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False, expert_parallel: bool = False) -> None:
    """The model's tp layout, in place (the blocks' from transformers' plan, the adapters beside
    their base layers). Frozen parameters stay frozen: torch's SequenceParallel makes the norms'
    parameters anew without their requires_grad (style.py `_replicate_module_fn`), which under
    LoRA trained the frozen norms (seen: losses 1e-4 off the reference after one step)."""
    frozen = [(module, name) for module in model.modules() for name, p in module._parameters.items()
              if p is not None and not p.requires_grad]
    _apply_tp(model, tp_mesh, sequence_parallel, expert_parallel)
    for module, name in frozen:
        module._parameters[name].requires_grad_(False)


def _owned_output(module: nn.Module, args, output):
    """A row-parallel module's output as a tensor of its own: RowwiseParallel hands back a view made
    inside _ToTorchTensor (an AsyncCollectiveTensor when the redistribution is async), and a family
    that changes it in place (CTRL scales its embeddings: `inputs_embeds *= sqrt(d_model)`; Falcon
    adds the attention's output to the MLP's: `mlp_output += attention_output`) is refused by
    autograd on such a view; a compiled first block needs the wait resolved too
    (paratune.parallel.compile). One copy of batch x sequence x hidden a micro-batch: on the
    embedding under every plan, on the row-parallel projections under a derived plan (the shipped
    plans' families add out of place)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, torch.Tensor) and (isinstance(output, AsyncCollectiveTensor) or output._is_view()):
        return output.clone()
    return output


def own_embedding_output(embedding: nn.Module) -> None:
    """`_owned_output` as a forward hook of the embedding, once (registered after tp's own output
    hook, so it runs after it)."""
    if not getattr(embedding, "_paratune_owned_output", False):
        embedding.register_forward_hook(_owned_output)
        embedding._paratune_owned_output = True


def _apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool, expert_parallel: bool) -> None:
    parts = decoder_parts(model)
    embedding, head = parts.embedding, parts.head
    tied = head.weight is embedding.weight
    sp_out = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=sp_out))
    own_embedding_output(embedding)
    if sequence_parallel:
        parallelize_module(parts.norm, tp_mesh, SequenceParallel())
    parallelize_module(head, tp_mesh, head_style(model, sp_out))
    if tied:  # both are sharded over the vocabulary (Shard(0)): one parameter again, as in the reference
        head.weight = embedding.weight
    plan = block_plan(model, sequence_parallel, expert_parallel)
    derived = family_tp_plan(model)[1] == "derived"
    for block in decoder_blocks(model):
        parallelize_module(block, tp_mesh, adapted_plan(block, plan, sequence_parallel))
        if derived:  # families without a shipped plan may add to a projection's output in place (Falcon)
            for name, module in block.named_modules():
                if any(fnmatch(name, key) and isinstance(style, RowwiseParallel) for key, style in plan.items()):
                    module.register_forward_hook(_owned_output)


def _norm_groups(grad: torch.Tensor, p: torch.Tensor, tp_group, ep_group) -> tuple | None:
    """The process groups over which a gradient's local squared norm is summed into the global one
    (None: its placements are partial sums, whose squared norms do not add): a DTensor's sharded
    mesh dims; the tp group for DDP's local shards of a tp weight (`_st_info`); the ep group for
    expert parameters (each ep rank holds other experts)."""
    groups: tuple = ()
    if isinstance(grad, DTensor):
        if any(pl.is_partial() for pl in grad.placements):
            return None
        # Any shard kind (FSDP2 over tp shards a DTensor's dim strided: `_StridedShard`, which is not
        # `is_shard()` in torch 2.13): a placement neither replicated nor partial splits the tensor.
        groups = tuple(grad.device_mesh.get_group(d) for d, pl in enumerate(grad.placements) if not pl.is_replicate())
    if getattr(p, "_paratune_expert", False):
        groups += (ep_group,) if ep_group is not None else ()
    elif hasattr(p, "_st_info") and tp_group is not None:
        groups += (tp_group,)
    return groups


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, pp_group=None, tp_group=None, ep_group=None) -> torch.Tensor:
    """Global-norm clipping over plain and DTensor gradients alike (same formula as torch's).

    torch.nn.utils.clip_grad_norm_ cannot mix tensors of different meshes; with pipeline
    stages the squared norms are summed across stages too. Each gradient's local squared norm is
    summed over the groups its shards span (`_norm_groups`): gradients of the same groups are
    summed locally first (torch's `_foreach_norm`), so a step runs one all-reduce per distinct
    group set (a handful), not one per parameter; the clip coefficient stays on the device
    (`_foreach_mul_` by a clamped tensor, as torch's clip does), so no step waits for the host.
    """
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    local_grads: list[torch.Tensor] = []
    for p in params:
        groups = _norm_groups(p.grad, p, tp_group, ep_group)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local_grads.append(local)
        if groups is None:  # partial sums: the DTensor's own norm, gathered (rare: not seen in paratune's layouts)
            norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32).full_tensor()
            total_sq += norm.to(device) ** 2
            continue
        by_groups.setdefault(groups, []).append(local)
    for groups, grads in by_groups.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        sq = torch.stack([n.to(device) for n in norms]).pow(2).sum()
        for group in groups:
            dist.all_reduce(sq, group=group)
        total_sq += sq
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad_device in {g.device for g in local_grads}:
        same = [g for g in local_grads if g.device == grad_device]
        torch._foreach_mul_(same, coef.to(grad_device))
    return total
