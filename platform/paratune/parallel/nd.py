"""Model-parallel plans: tp x pp x dp composed as torchtitan composes them.

Tensor parallelism innermost (inside a node), then data parallelism on the dp axis of every
pipeline stage (FSDP2, hybrid FSDP2, FSDP2's `replicate` or DDP), pipeline stages outermost.
Context parallelism (without pipeline stages) splits every sequence over the cp ranks, which
hold the parameters as dp ranks do: the data-parallel layer spans dp x cp (paratune.parallel.cp).
Everything is applied on the meta device; each rank then allocates and fills only its part.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratune.model.materialize import ModelInit, materialize, move_buffers
from paratune.model.build import decoder_blocks, decoder_parts
from paratune.parallel.runner import StepRunner, WorkerPlace, apply_levers, make_optimizer
from paratune.parallel.dims import ParallelDims
from paratune.parallel.tp import apply_tp, clip_grad_norm
from paratune.config.plan import Plan


@dataclass(frozen=True)
class DataParallelLayout:
    """What the dp axis does: `fsdp` (sharded), `replicate` (FSDP2's replicate: DDP semantics
    that pipeline schedules can drive), `ddp` (torch DDP, wrapped after materializing) or `none`."""

    kind: str
    mixed_precision: bool  # bf16 compute through FSDP2's MixedPrecisionPolicy (else autocast)
    offload: bool  # parameters kept on the host (FSDP2 CPU offload)

    @classmethod
    def for_plan(cls, plan: Plan, dims: ParallelDims) -> "DataParallelLayout":
        if dims.dp * dims.cp == 1:  # cp ranks hold the same parameters: reduced like dp ranks
            return cls("none", False, False)
        bf16 = plan.precision == "bf16"
        if plan.strategy == "fsdp":
            assert plan.fsdp is not None
            kind = "replicate" if plan.fsdp.sharding == "no_shard" else "fsdp"
            return cls(kind, bf16, plan.fsdp.cpu_offload)
        # DDP's reducer cannot follow a pipeline schedule's backward; FSDP2's replicate can, with
        # the same semantics (every rank holds everything, gradients all-reduced once per step).
        return cls("replicate" if dims.pp > 1 else "ddp", False, False)


def _apply_dp_on_meta(module: nn.Module, blocks: list[nn.Module], plan: Plan, dims: ParallelDims,
                      layout: DataParallelLayout) -> None:
    """FSDP2's `fully_shard` or `replicate` per block and then the root, on the meta device."""
    if layout.kind not in ("fsdp", "replicate"):
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    if plan.fsdp is not None:
        from paratune.parallel.fsdp import fsdp_policies

        mp, offload = fsdp_policies(plan, torch.device(dims.device_type))
    else:
        mp, offload = MixedPrecisionPolicy(), OffloadPolicy()
    if layout.kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        apply = partial(replicate, mesh=dims.dp_mesh, mp_policy=mp, offload_policy=offload)
    else:
        from torch.distributed.fsdp import fully_shard

        assert plan.fsdp is not None
        apply = partial(fully_shard, mesh=dims.fsdp_mesh(), reshard_after_forward=plan.fsdp.reshards_after_forward,
                        mp_policy=mp, offload_policy=offload)
    for block in blocks:
        apply(block)
    apply(module)


def _wrap_ddp(module: nn.Module, plan: Plan, dims: ParallelDims, layout: DataParallelLayout) -> nn.Module:
    """Torch DDP over the dp axis of a materialized module (only without pipeline stages)."""
    if layout.kind != "ddp":
        return module
    if dims.tp > 1:  # DDP over DTensor weights: torch turns them into local shards around forward
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(module)
    opts = plan.ddp
    assert opts is not None
    return DistributedDataParallel(module, process_group=dims.dp_mesh.get_group(), bucket_cap_mb=opts.bucket_cap_mb,
                                   gradient_as_bucket_view=opts.gradient_as_bucket_view, static_graph=opts.static_graph,
                                   find_unused_parameters=opts.find_unused_parameters)


def _sync_context(module: nn.Module, plan: Plan, layout: DataParallelLayout):
    """Gradient sync between micro-batches: replicated layouts reduce after the last one only;
    sharded FSDP2 reduce-scatters after every one (only gradient shards accumulate)."""
    def context(step: int, last_micro: bool):
        if isinstance(module, DistributedDataParallel) and not last_micro and not (plan.ddp.static_graph and step == 0):
            return module.no_sync()
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(last_micro or layout.kind == "fsdp")
        return contextlib.nullcontext()

    return context


def _materialize_device(device: torch.device, layout: DataParallelLayout) -> torch.device:
    """The host only where FSDP2 wraps with CPU offload (it moves each block's parameters to the
    device around its compute); anything else must live on the device."""
    return torch.device("cpu") if layout.offload else device


def parallelize_model_parallel(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device,
                               local_world_size: int | None = None) -> StepRunner:
    dims = ParallelDims.from_plan(plan, device.type, local_world_size)
    if dims.cp > 1:
        from paratune.parallel.cp import check_cp_supported

        check_cp_supported(model.config, plan, device)  # before anything is allocated
    layout = DataParallelLayout.for_plan(plan, dims)
    apply_levers(model, plan, "before_layout")
    apply_levers(model, plan, "before_shard")
    experts = meshes = None
    if plan.ep > 1:  # the experts split over ep of the dp ranks (paratune.parallel.ep), on meta, before tp
        from paratune.parallel.ep import expert_meshes, shard_experts

        meshes = expert_meshes(plan, dims.device_type)
        experts = shard_experts(model, meshes)
    if dims.tp > 1:  # on the meta device: shards, no memory (under ep: all but the routed experts)
        apply_tp(model, dims.mesh["tp"], plan.sequence_parallel, expert_parallel=experts is not None)
    apply_levers(model, plan, "before_wrap",
                 WorkerPlace(device, dims.mesh["tp"].get_group().group_name if dims.tp > 1 else None))
    if dims.pp > 1:
        return _parallelize_pipeline(model, init, plan, device, dims, layout, experts, meshes)
    if experts is not None:
        experts = _wrap_stage_experts(experts, [model], plan, dims, layout, meshes)
    _apply_dp_on_meta(model, decoder_blocks(model), plan, dims, layout)
    materialize(model, init, _materialize_device(device, layout))
    move_buffers(model, device)
    before_step = None
    if experts is not None:
        from paratune.parallel.ep import expert_param_names, mark_expert_params, reduce_expert_gradients

        mark_expert_params(experts)
        if layout.kind == "ddp":  # DDP would average experts that differ: theirs is their own step
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
            before_step = partial(reduce_expert_gradients, model, meshes)
    wrapped = _wrap_ddp(model, plan, dims, layout)
    params = list(wrapped.parameters())

    def forward_extra(ids: torch.Tensor) -> dict:
        # With sequence parallelism the model sees a sequence shard; positions must be the full ones.
        return {"position_ids": torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)}

    runner_args = (wrapped, make_optimizer(params, plan), plan, device, _sync_context(wrapped, plan, layout))
    runner_kwargs = dict(autocast=plan.precision == "bf16" and not layout.mixed_precision, before_step=before_step,
                         clip=partial(clip_grad_norm, params, plan.grad_clip, tp_group=dims.mesh["tp"].get_group(),
                                      ep_group=meshes.ep_group if meshes is not None else None))
    if dims.cp > 1:  # positions come with the sequence shard (sequence parallelism included)
        from paratune.parallel.cp import CPStepRunner, configure_gradient_reduction

        scale = configure_gradient_reduction(wrapped, layout.kind, dims.dp, dims.cp, device)
        return CPStepRunner(*runner_args, cp_mesh=dims.cp_mesh, loss_scale=scale,
                            tp_seq_shards=dims.tp if plan.sequence_parallel else 1, **runner_kwargs)
    return StepRunner(*runner_args, **runner_kwargs, forward_extra=forward_extra if plan.sequence_parallel else None)


class PipelineRunner(StepRunner):
    """A step is one pipeline schedule over the step's micro-batches, then clip and optimizer step."""

    def __init__(self, stages, schedule, has_first: bool, has_last: bool, pp_group, tp_group, ep_group=None, **kw):
        super().__init__(**kw)
        self.stages, self.schedule, self.has_first, self.has_last = stages, schedule, has_first, has_last
        self.pp_group, self.tp_group, self.ep_group = pp_group, tp_group, ep_group

    def micro_batch_roots(self) -> list[nn.Module]:
        return list(self.model)  # each stage module is entered once per micro-batch

    def clip_gradients(self) -> None:
        clip_grad_norm(list(self.model.parameters()), self.plan.grad_clip, pp_group=self.pp_group,
                       tp_group=self.tp_group, ep_group=self.ep_group)

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        batch = torch.cat(micro_batches)
        losses: list[torch.Tensor] = []
        args = (batch,) if self.has_first else ()
        kwargs = {"target": batch, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer_step()
        return torch.stack([loss.detach().float() for loss in losses]).mean() if self.has_last else None


def _wrap_stage_experts(experts: list, stage_modules: list[nn.Module], plan: Plan, dims: ParallelDims,
                        layout: DataParallelLayout, meshes) -> list:
    """Before FSDP2 wraps the blocks, on the meta device: the experts of this rank's modules (its
    stages) wrapped over their copies (sharded, or replicated where the dp axis replicates)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from paratune.parallel.ep import shard_experts_fsdp

    inside = {id(m) for root in stage_modules for m in root.modules()}
    experts = [entry for entry in experts if id(entry.module) in inside]
    if layout.kind == "ddp":  # torch DDP, wrapped later, ignores them (reduce_expert_gradients)
        return experts
    if plan.fsdp is not None:
        from paratune.parallel.fsdp import fsdp_policies

        mp, offload = fsdp_policies(plan, torch.device(dims.device_type))
    else:
        mp, offload = MixedPrecisionPolicy(), OffloadPolicy()
    kwargs = dict(mp_policy=mp, offload_policy=offload)
    if layout.kind == "fsdp":
        kwargs["reshard_after_forward"] = plan.fsdp.reshards_after_forward
    shard_experts_fsdp(experts, meshes, replicated=layout.kind == "replicate", **kwargs)
    return experts


def _parallelize_pipeline(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device,
                          dims: ParallelDims, layout: DataParallelLayout, experts: list | None = None,
                          meshes=None) -> StepRunner:
    from torch.distributed.pipelining import PipelineStage

    from paratune.parallel.pp import build_stages, make_schedule

    pp_mesh = dims.mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    owned = build_stages(model, dims.pp, pp_rank, plan.pp_schedule,
                         seq_shards=dims.tp if plan.sequence_parallel else 1)
    num_stages = dims.pp * (2 if plan.pp_schedule == "interleaved_1f1b" else 1)
    # Drop the original model's hold on what other stages own, so this rank keeps only its part.
    for key, (parent, attr) in decoder_parts(model).slots(model).items():
        setattr(parent, attr, nn.ModuleList() if key == "blocks" else None)
    if experts is not None:  # this rank's stages' experts, over their expert_dp ranks
        experts = _wrap_stage_experts(experts, [module for _, module in owned], plan, dims, layout, meshes)
    for _, module in owned:
        _apply_dp_on_meta(module, list(module.layers), plan, dims, layout)
    # Only this rank's stages are allocated and filled; the rest of the model never exists here.
    materialize(model, init, _materialize_device(device, layout), modules=[module for _, module in owned])
    for _, module in owned:
        move_buffers(module, device)
        # bf16 compute: FSDP2's MixedPrecisionPolicy where it wraps the stages, else autocast in
        # each stage's forward (the schedule calls the stages itself, outside the runner's autocast).
        module.autocast = plan.precision == "bf16" and not layout.mixed_precision
    modules = [module for _, module in owned]
    if experts is not None:
        from paratune.parallel.ep import mark_expert_params

        mark_expert_params(experts)
    stages = [PipelineStage(module, index, num_stages, device, group=pp_mesh.get_group()) for index, module in owned]
    schedule = make_schedule(stages, plan.grad_accum, plan.pp_schedule)
    container = nn.ModuleList(modules)
    return PipelineRunner(stages, schedule, has_first=any(i == 0 for i, _ in owned),
                          has_last=any(i == num_stages - 1 for i, _ in owned), pp_group=pp_mesh.get_group(),
                          tp_group=dims.mesh["tp"].get_group(), ep_group=meshes.ep_group if meshes else None,
                          model=container,
                          optimizer=make_optimizer(container.parameters(), plan), plan=plan, device=device)
