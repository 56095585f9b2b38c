"""Model-parallel plans: tensor or pipeline degrees composed with DDP or FSDP2 on the dp axis."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratune.materialize import ModelInit, materialize, move_buffers
from paratune.models import decoder_blocks
from paratune.parallel import StepRunner, apply_activation_checkpointing, make_optimizer
from paratune.parallel.dims import ParallelDims
from paratune.parallel.tp import apply_tp, clip_grad_norm
from paratune.plan import Plan


def _shard_dp(module: nn.Module, blocks: list[nn.Module], plan: Plan, dims: ParallelDims) -> bool:
    """FSDP2 over the dp axis of the mesh, applied on the meta device; True when applied.

    Nothing to do for DDP (it wraps the materialized module, `_replicate_dp`) or when dp is 1."""
    if dims.dp == 1 or plan.strategy != "fsdp":
        return False
    from torch.distributed.fsdp import fully_shard

    from paratune.parallel.fsdp import fsdp_policies

    dp_mesh = dims.mesh["dp"]
    mp, offload = fsdp_policies(plan, torch.device(dp_mesh.device_type))
    kwargs = {"reshard_after_forward": plan.fsdp.reshards_after_forward, "mp_policy": mp, "offload_policy": offload}
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(module, mesh=dp_mesh, **kwargs)
    return True


def _replicate_dp(module: nn.Module, plan: Plan, dims: ParallelDims) -> nn.Module:
    """DDP over the dp axis of a materialized module (nothing to do when dp is 1 or under FSDP).

    DDP over dp > 1 is only reached without pipeline stages (the plan rejects ddp with pp when
    dp > 1)."""
    if dims.dp == 1 or plan.strategy != "ddp":
        return module
    if dims.tp > 1:  # DDP over DTensor weights: torch turns them into local shards around forward
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(module)
    opts = plan.ddp
    assert opts is not None
    return DistributedDataParallel(module, process_group=dims.mesh["dp"].get_group(), bucket_cap_mb=opts.bucket_cap_mb,
                                   gradient_as_bucket_view=opts.gradient_as_bucket_view, static_graph=opts.static_graph)


def _sync_context(module: nn.Module, plan: Plan):
    def context(step: int, last_micro: bool):
        if isinstance(module, DistributedDataParallel) and not last_micro and not (plan.ddp.static_graph and step == 0):
            return module.no_sync()
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    return context


def _materialize_device(plan: Plan, device: torch.device, fsdp_applied: bool) -> torch.device:
    """The host only where FSDP2 was applied with CPU offload (it then moves each block's
    parameters to the device around its compute); anything else must live on the device."""
    from paratune.parallel.fsdp import shard_device

    return shard_device(plan, device) if fsdp_applied else device


def parallelize_model_parallel(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device) -> StepRunner:
    dims = ParallelDims.from_plan(plan, device.type)
    apply_activation_checkpointing(model, plan)
    if dims.pp > 1:
        return _parallelize_pipeline(model, init, plan, device, dims)
    apply_tp(model, dims.mesh["tp"], plan.sequence_parallel)  # on the meta device: shards, no memory
    fsdp_applied = _shard_dp(model, decoder_blocks(model), plan, dims)
    materialize(model, init, _materialize_device(plan, device, fsdp_applied))
    move_buffers(model, device)
    wrapped = _replicate_dp(model, plan, dims)
    params = list(wrapped.parameters())

    def forward_extra(ids: torch.Tensor) -> dict:
        # With sequence parallelism the model sees a sequence shard; positions must be the full ones.
        return {"position_ids": torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)}

    # bf16 compute: FSDP2's MixedPrecisionPolicy where FSDP2 wraps the model (dp > 1), else autocast.
    return StepRunner(wrapped, make_optimizer(params, plan), plan, device, _sync_context(wrapped, plan),
                      autocast=plan.precision == "bf16" and not fsdp_applied,
                      clip=partial(clip_grad_norm, params, plan.grad_clip, tp_group=dims.mesh["tp"].get_group()),
                      forward_extra=forward_extra if plan.sequence_parallel else None)


class PipelineRunner(StepRunner):
    """A step is one pipeline schedule over the step's micro-batches, then clip and optimizer step."""

    def __init__(self, stages, schedule, has_first: bool, has_last: bool, pp_group, **kw):
        super().__init__(**kw)
        self.stages, self.schedule, self.has_first, self.has_last = stages, schedule, has_first, has_last
        self.pp_group = pp_group

    def micro_batch_roots(self) -> list[nn.Module]:
        return list(self.model)  # each stage module is entered once per micro-batch

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        batch = torch.cat(micro_batches)
        losses: list[torch.Tensor] = []
        args = (batch,) if self.has_first else ()
        kwargs = {"target": batch, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        if self.plan.grad_clip > 0:
            clip_grad_norm(list(self.model.parameters()), self.plan.grad_clip, pp_group=self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return torch.stack([loss.detach().float() for loss in losses]).mean() if self.has_last else None


def _parallelize_pipeline(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device,
                          dims: ParallelDims) -> StepRunner:
    from torch.distributed.pipelining import PipelineStage

    from paratune.parallel.pp import build_stages, make_schedule

    pp_mesh = dims.mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    owned = build_stages(model, dims.pp, pp_rank, plan.pp_schedule)
    num_stages = dims.pp * (2 if plan.pp_schedule == "interleaved_1f1b" else 1)
    # Drop the original model's hold on what other stages own, so this rank keeps only its part.
    model.model.layers, model.model.embed_tokens, model.model.norm, model.lm_head = (
        nn.ModuleList(), None, None, None)
    fsdp_applied = False
    for _, module in owned:
        fsdp_applied = _shard_dp(module, list(module.layers), plan, dims)
    # Only this rank's stages are allocated and filled; the rest of the model never exists here.
    materialize(model, init, _materialize_device(plan, device, fsdp_applied), modules=[module for _, module in owned])
    for _, module in owned:
        move_buffers(module, device)
    # bf16 compute: FSDP2's MixedPrecisionPolicy where FSDP2 wraps the stages, else autocast in
    # each stage's forward (the schedule calls the stages itself, outside the runner's autocast).
    for _, module in owned:
        module.autocast = plan.precision == "bf16" and not fsdp_applied
    modules, stages = [], []
    for index, module in owned:
        wrapped = _replicate_dp(module, plan, dims)
        modules.append(wrapped)
        stages.append(PipelineStage(wrapped, index, num_stages, device, group=pp_mesh.get_group()))
    schedule = make_schedule(stages, plan.grad_accum, plan.pp_schedule)
    container = nn.ModuleList(modules)
    return PipelineRunner(stages, schedule, has_first=any(i == 0 for i, _ in owned),
                          has_last=any(i == num_stages - 1 for i, _ in owned), pp_group=pp_mesh.get_group(),
                          model=container, optimizer=make_optimizer(container.parameters(), plan), plan=plan,
                          device=device)
