"""PyTorch FSDP2: `fully_shard` per decoder block, then the root (torchtitan's order).

full ~ ZeRO-3, grad_op ~ ZeRO-2 (no reshard after forward), hybrid = shard inside a group of
ranks (a node), replicate across groups; no_shard = FSDP2's `replicate` (DDP semantics).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from paratune.model.build import decoder_blocks
from paratune.parallel.runner import StepRunner, apply_levers, make_optimizer
from paratune.model.materialize import ModelInit, materialize, move_buffers
from paratune.config.plan import Plan


def fsdp_policies(plan: Plan, device: torch.device) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """FSDP2's mixed-precision and offload policies for a plan (shared with tp/pp plans)."""
    assert plan.fsdp is not None
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if plan.precision == "bf16" else MixedPrecisionPolicy())
    # Pinned host memory needs an accelerator; on CPU-only workers offload must not pin.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.fsdp.cpu_offload else OffloadPolicy()
    return mp, offload


def shard_device(plan: Plan, device: torch.device) -> torch.device:
    """Where FSDP2 keeps the sharded parameters: the host under CPU offload, else the device."""
    return torch.device("cpu") if plan.fsdp is not None and plan.fsdp.cpu_offload else device


def parallelize_fsdp(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device,
                     local_world_size: int) -> StepRunner:
    opts = plan.fsdp
    assert opts is not None
    world = plan.num_workers
    apply_levers(model, plan, "before_layout")
    apply_levers(model, plan, "before_shard")
    apply_levers(model, plan, "before_wrap")
    mp, offload = fsdp_policies(plan, device)

    if opts.sharding == "no_shard":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("replicate",))
        for block in decoder_blocks(model):
            replicate(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        replicate(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    else:
        if opts.sharding == "hybrid":
            shard = opts.shard_group_size or local_world_size
            if world % shard or shard < 2:
                raise ValueError(
                    f"fsdp.shard_group_size: {shard} (ranks per node) must divide num_workers {world} "
                    "and be >= 2 for hybrid sharding"
                )
            mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        reshard = opts.reshards_after_forward
        if plan.ep > 1:  # the experts first, over the ranks holding the same ones (paratune.parallel.ep)
            from paratune.parallel.ep import expert_meshes, shard_experts, shard_experts_fsdp

            meshes = expert_meshes(plan, device.type)
            experts = shard_experts(model, meshes)
            shard_experts_fsdp(experts, meshes, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        blocks = decoder_blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        if opts.prefetch > 0:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + opts.prefetch])
                block.set_modules_to_backward_prefetch(blocks[max(0, i - opts.prefetch) : i][::-1])
    # Sharded on the meta device: now each rank allocates and fills only its shards.
    materialize(model, init, shard_device(plan, device))
    move_buffers(model, device)  # under CPU offload to_empty put the buffers on the host too

    sharded = opts.sharding != "no_shard"

    def sync_context(step: int, last_micro: bool):
        # Sharded: reduce-scatter after every micro-batch, so only gradient shards accumulate
        # (skipping it would hold the whole model's unsharded gradients on every rank, which is
        # what sharding is for avoiding). Replicated: all-reduce after the last micro-batch only.
        model.set_requires_gradient_sync(last_micro or sharded)
        return contextlib.nullcontext()

    clip = None
    if plan.ep > 1:
        from paratune.parallel.ep import mark_expert_params
        from paratune.parallel.tp import clip_grad_norm

        mark_expert_params(experts)
        # torch's clip cannot mix the experts' mesh with the rest's; each ep rank's experts add their norm
        clip = partial(clip_grad_norm, list(model.parameters()), plan.grad_clip, ep_group=meshes.ep_group)
    optimizer = make_optimizer(model.parameters(), plan)
    if plan.float8_all_gather:  # every float8 weight's scale after each step, in one all-reduce
        from paratune.parallel.float8 import precompute_scales_after_step

        precompute_scales_after_step(model, optimizer, plan)
    return StepRunner(model, optimizer, plan, device, sync_context, clip=clip)
