"""Expert parallelism: each routed-experts layer's experts split over `ep` of the data-parallel ranks.

The layout is torchtitan's: EP borrows dp ranks. The dp ranks are laid out as expert_dp x ep
(ep innermost: an expert group is ep consecutive dp ranks, the GPUs of one node first); every
rank keeps its own tokens, sends each (token, expert) pair to the rank that holds the expert and
gets the result back (two all-to-alls per layer and direction, dropless: every routed pair is
computed, so the training is the reference's), and holds E / ep of the experts. The dense part
(attention, norms, router, shared experts, embedding, head) is laid out by the strategy over all dp
ranks as without ep; the experts' gradients are averaged over the expert_dp ranks that hold the
same experts (FSDP2 shards them over those ranks; DDP leaves them to `reduce_expert_gradients`).

Which modules are experts comes from the family's own `base_model_ep_plan` (transformers 5.2x:
"layers.*.mlp.experts": "ep_dispatch_experts", its packed weights "grouped_gemm"), as paratune's
tensor parallelism follows `base_model_tp_plan`; the dispatch is transformers' own `AllToAllEP`
(transformers/distributed/expert_parallel.py) on paratune's meshes.

Gradient scale: the all-to-all's backward brings every token's gradient to its expert's owner, so
after backward an expert's gradient is the sum over the ep ranks' losses; summed over the
expert_dp copies it covers all dp ranks' losses, and dividing by dp gives what DDP's average gives
a dense weight (the reference's gradient).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratune.config.plan import Plan

DISPATCH_STYLE, PACKED_STYLE = "ep_dispatch_experts", "grouped_gemm"
# Marks an expert parameter (a local [E / ep, ...] slice): clipping sums its squared norm over the
# ep group, DDP ignores it, the memory check counts it as this rank's experts.
EXPERT_PARAM_MARK = "_paratune_expert"


class ExpertPlanError(ValueError):
    """A model whose experts paratune cannot split (no EP plan, a plan entry it does not implement)."""


@dataclass(frozen=True)
class ExpertEntry:
    """One routed-experts module of the model and its packed parameters."""

    name: str  # path under the model (model.layers.0.mlp.experts)
    module: nn.Module
    packed: tuple[str, ...]  # its parameters split along the expert axis (gate_up_proj, down_proj)
    experts: int  # experts in the module (the whole model's count, before the split)


def _expand(pattern: str, names: list[str]) -> list[str]:
    """The module / parameter names a transformers plan pattern ("layers.*.mlp.experts") matches."""
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
    return [n for n in names if regex.match(n)]


def expert_entries(model: nn.Module) -> list[ExpertEntry]:
    """The experts modules the family's `base_model_ep_plan` names, with their packed parameters.

    ExpertPlanError when the family has no EP plan, or its plan names a style paratune does not
    implement, a module the model lacks, or a packed parameter not split along its experts."""
    config = model.config
    family = getattr(config, "model_type", type(model).__name__)
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    if not ep_plan:
        raise ExpertPlanError(f"model_type '{family}' has no expert-parallel plan in transformers "
                              "(base_model_ep_plan)")
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    modules = dict(base.named_modules())
    params = dict(base.named_parameters())
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for pattern, style in ep_plan.items():
        if style == DISPATCH_STYLE:
            for name in _expand(pattern, list(modules)):
                found.setdefault(name, (modules[name], []))
        elif style != PACKED_STYLE:
            raise ExpertPlanError(f"model_type '{family}': transformers' EP plan entry '{pattern}': '{style}' is "
                                  f"not implemented by paratune, which dispatches tokens by all-to-all "
                                  f"('{DISPATCH_STYLE}' with '{PACKED_STYLE}' weights, transformers >= 5.2x; 5.17's "
                                  "'ep_router' / 'moe_tp_experts' plans all-reduce a batch every rank shares, an "
                                  "inference layout)")
    for pattern, style in ep_plan.items():
        if style != PACKED_STYLE:
            continue
        for name in _expand(pattern, list(params)):
            owner, _, attr = name.rpartition(".")
            if owner not in found:
                raise ExpertPlanError(f"model_type '{family}': '{name}' is split along its experts but its module is "
                                      f"not an '{DISPATCH_STYLE}' entry of the plan")
            found[owner][1].append(attr)
    entries = []
    for name, (module, packed) in found.items():
        count = getattr(module, "num_experts", None)
        if not packed or not isinstance(count, int):
            raise ExpertPlanError(f"model_type '{family}': experts module '{name}' ({type(module).__name__}) has no "
                                  "packed expert weights or no num_experts")
        for attr in packed:
            shape = getattr(module, attr).shape
            if shape[0] != count:
                raise ExpertPlanError(f"model_type '{family}': {name}.{attr} has shape {tuple(shape)}, not "
                                      f"{count} experts first")
        entries.append(ExpertEntry(f"{prefix}.{name}" if prefix else name, module, tuple(packed), count))
    if not entries:
        raise ExpertPlanError(f"model_type '{family}': its EP plan matches no module of {type(model).__name__}")
    return entries


def expert_module_patterns(config) -> list[str]:
    """The EP plan's experts-module patterns ("layers.*.mlp.experts"): under ep, tensor parallelism
    leaves these modules (and their weights) to expert parallelism."""
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    return [pattern for pattern, style in ep_plan.items() if style == DISPATCH_STYLE]


def under_experts(pattern: str, experts: list[str]) -> bool:
    """Whether a tp-plan pattern names an experts module or something inside one."""
    return any(pattern == e or pattern.startswith(e + ".") for e in experts)


def ep_unavailable() -> str | None:
    """Why this transformers cannot dispatch experts across ranks (None: it can): ep runs
    transformers' AllToAllEP (transformers/distributed/expert_parallel.py, 5.2x); 5.17, the GPU
    image's, has no such module."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("transformers.distributed.expert_parallel") is None:
        return (f"transformers {transformers.__version__} has no transformers.distributed.expert_parallel "
                "(AllToAllEP, the dispatch ep runs; in transformers 5.2x)")
    return None


def ep_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why the plan's ep cannot split this model's experts (None: it can); for the preflight."""
    if plan.ep == 1:
        return None
    missing = ep_unavailable()
    if missing is not None:
        return f"ep: {plan.ep}: {missing}; allowed: ep 1, or transformers >= 5.20"
    from paratune.model.build import routed_experts

    if not routed_experts(model):
        return (f"ep: {plan.ep} with model '{plan.model}' ({type(model).__name__}), which has no routed experts "
                "to split; allowed: ep 1")
    try:
        entries = expert_entries(model)
    except ExpertPlanError as err:
        return f"ep: {plan.ep}: {err}; allowed: ep 1"
    for entry in entries:
        if entry.experts % plan.ep:
            return (f"ep: {plan.ep} must divide the {entry.experts} experts of {entry.name}; allowed ep: "
                    f"{[d for d in range(1, entry.experts + 1) if entry.experts % d == 0 and plan.dp_degree % d == 0]}")
    return None


@dataclass(frozen=True)
class ExpertMeshes:
    """The expert layout's device mesh: pp x expert_dp x ep x etp, over the same ranks as the
    strategy's pp x dp x tp mesh (cp 1; dp = expert_dp x ep). etp is the plan's tp group: its
    ranks hold the same tokens, and each dispatches its own slice of them (transformers'
    AllToAllEP slices by rank and gathers back), so each of them also holds a copy of its ep
    rank's experts: the copies of an expert are its expert_dp x tp ranks (`expert_dp`)."""

    mesh: DeviceMesh
    dp: int  # all data-parallel ranks (the gradient's divisor)
    expert_dp: DeviceMesh  # the ranks holding the same experts: edp x etp, flattened

    @property
    def ep(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def ep_group(self):
        return self.ep.get_group()

    @property
    def expert_dp_group(self):
        return self.expert_dp.get_group()


def expert_meshes(plan: Plan, device_type: str) -> ExpertMeshes:
    """The mesh the experts are laid out on (every rank calls it, in the same order)."""
    assert plan.cp == 1, "ep with cp is refused by the plan"
    mesh = init_device_mesh(device_type, (plan.pp, plan.expert_dp_degree, plan.ep, plan.tp),
                            mesh_dim_names=("pp", "edp", "ep", "etp"))
    copies = mesh["edp"] if plan.tp == 1 else mesh["edp", "etp"]._flatten("edp_etp")
    return ExpertMeshes(mesh, plan.dp_degree, copies)


def shard_experts(model: nn.Module, meshes: ExpertMeshes) -> list[ExpertEntry]:
    """On the meta device: each experts module keeps its ep rank's E / ep experts (plain
    parameters of the local shape; `_ep_rows` tells materialize which rows of the full value they
    take) and reaches the others through transformers' AllToAllEP. Once materialized (and
    wrapped), `mark_expert_params` marks the parameter objects that then exist."""
    from transformers.distributed.expert_parallel import AllToAllEP

    entries = expert_entries(model)
    ep, rank = meshes.ep.size(), meshes.ep.get_local_rank()
    for entry in entries:
        module, local = entry.module, entry.experts // ep
        rows = slice(rank * local, (rank + 1) * local)
        module._ep_rows = {}
        for attr in entry.packed:
            full = module._parameters[attr]
            part = nn.Parameter(torch.empty((local, *full.shape[1:]), dtype=full.dtype, device=full.device),
                                requires_grad=full.requires_grad)
            module._parameters[attr] = part
            module._ep_rows[attr] = rows
        module.num_experts = local  # the experts' own forward runs local ids 0 .. E/ep - 1
        module._ep_checkpoint_suffix = f"@ep{rank}of{ep}"  # see checkpoint_renames
        _install_dispatch(module, AllToAllEP(module, meshes.ep, meshes.mesh["etp"]))
    return entries


def _install_dispatch(module: nn.Module, dispatch) -> None:
    """The experts module's forward becomes the dispatch (its own forward runs inside, on the
    tokens its experts receive); module hooks (routing counts, recompute) still run around it."""

    def ep_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return dispatch(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)

    module.forward = ep_forward


def mark_expert_params(entries: list[ExpertEntry]) -> None:
    """Mark the experts' parameters as they are now registered: materializing (`to_empty`) and
    FSDP2 replace parameter objects, so this runs last, before the optimizer takes them."""
    for entry in entries:
        for attr in entry.packed:
            setattr(entry.module._parameters[attr], EXPERT_PARAM_MARK, True)


def checkpoint_renames(module: nn.Module) -> dict[str, str]:
    """State-dict keys of this rank's experts -> keys of their own (`@ep<rank>of<ep>` appended).

    Every ep rank holds different experts under the same names; a torch.distributed.checkpoint
    save would take one rank's tensor for all (plain tensors of one name are replicas to it, and
    FSDP2's shards span the expert-dp ranks only), so the others' experts would be lost. Under
    their own names each ep rank's experts (and their optimizer states) are saved and loaded back
    as its own; a resume needs the same ep. Empty for a model without ep."""
    from torch.nn.parallel import DistributedDataParallel

    root = module.module if isinstance(module, DistributedDataParallel) else module
    renames = {}
    for name, sub in root.named_modules():
        suffix = getattr(sub, "_ep_checkpoint_suffix", None)
        for attr in getattr(sub, "_ep_rows", {}) if suffix else ():
            key = f"{name}.{attr}" if name else attr
            renames[key] = key + suffix
    return renames


def is_expert_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, EXPERT_PARAM_MARK, False))


def expert_param_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the expert parameters (what DDP must leave alone)."""
    return [name for name, p in model.named_parameters() if is_expert_param(p)]


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, meshes: ExpertMeshes) -> None:
    """DDP's share for the experts it ignores: sum each expert gradient over its copies (expert_dp,
    x tp: each tp rank dispatched a slice of the tokens) and divide by dp (see the module
    docstring), once per step, after the last micro-batch."""
    grads = [p.grad for p in model.parameters() if is_expert_param(p) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if meshes.expert_dp.size() > 1:
        dist.all_reduce(flat, group=meshes.expert_dp_group)
    flat.div_(meshes.dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def shard_experts_fsdp(entries: list[ExpertEntry], meshes: ExpertMeshes, replicated: bool = False,
                       **fsdp_kwargs) -> None:
    """FSDP2 on each experts module over the expert_dp ranks (torchtitan's and transformers' way):
    its reduce-scatter sums the copies (x tp: each tp rank dispatched a slice of the tokens); the
    divide factor dp makes it the reference's gradient.
    `replicated`: FSDP2's replicate instead (DDP semantics under a pipeline schedule). Non-NCCL
    backends reject FSDP2's PREMUL_SUM for a custom factor: sum, then divide locally."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    for entry in entries:
        if replicated:
            replicate(entry.module, mesh=meshes.expert_dp, **fsdp_kwargs)
        else:
            fully_shard(entry.module, mesh=meshes.expert_dp, **fsdp_kwargs)
        entry.module.set_gradient_divide_factor(float(meshes.dp))
        if meshes.expert_dp.size() > 1:
            entry.module.set_force_sum_reduction_for_comms(True)
