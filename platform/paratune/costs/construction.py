"""Device bytes per rank while the model is built, before any optimizer exists (`construction_bytes`).

Apart from paratune.costs.memory's moments of a step: a plan that cannot even be built is rejected like
one that cannot train (paratune.costs.estimate).
"""

from __future__ import annotations

from paratune.model.adapters import adapted_params, frozen_base_saving
from paratune.costs.moe import held_with_experts, shard_params
from paratune.config.plan import Plan
from paratune.model.shapes import BYTES, ModelShape, fsdp_shard_degree, local_params, model_shape


def construction_bytes(plan: Plan, shape: ModelShape | None = None) -> float:
    """Device bytes per rank while the model is built, before the optimizer exists: the model is
    built on the meta device and each rank materializes in fp32 only what it holds.

    - ddp, fsdp no_shard, ZeRO 0-2: every rank holds the whole model (its tp/pp slice), 4 bytes
      a parameter (DeepSpeed's bf16 cast then happens in place, one tensor at a time);
    - fsdp full/grad_op/hybrid: its shard of that slice (values are made on the host, only the
      shard is kept on the device);
    - plus, without pipeline stages and with more than one rank, one module's full fp32 values
      on the device for a moment (ranks take turns computing modules and broadcast them);
    - ZeRO-3: under `deepspeed.zero.Init` each module's parameters are partitioned as soon as the
      module is built, in the dtype of the DeepSpeed config (bf16 with bf16 enabled), so: the
      partition (params/dp) in that dtype, plus the largest single module built whole on the
      device. Its tensors are created in fp32 and then cast (zero_wrapper_for_fp_tensor_constructor
      in deepspeed/runtime/zero/partition_parameters.py), so for a moment both copies exist:
      4 + 2 bytes a parameter in bf16, 4 in fp32. Under parameter offload the partitions go to
      the host (zero.Init's remote_device) and only that module is on the device.
    - ZeRO with tp (DeepSpeed's AutoTP): AutoTP shards inside `deepspeed.initialize`, after the
      model exists: at ZeRO 0-2 every rank first builds the whole model in fp32 (4 bytes x all
      parameters); at ZeRO-3 zero.Init partitions the whole model over every rank, and AutoTP
      gathers one module whole (fp32) at a time to cut its slice.
    """
    shape = shape or model_shape(plan)
    local, _ = local_params(plan, shape)
    if plan.strategy == "zero" and plan.zero is not None and plan.zero.stage == 3:
        pb = BYTES[plan.precision]
        if plan.tp > 1:
            partition = 0.0 if plan.zero.offload_param else pb * shape.total / plan.num_workers
            return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf + 4 * shape.largest_leaf
        partition = 0.0 if plan.zero.offload_param else pb * local / plan.dp_degree
        return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf
    if plan.strategy == "zero" and plan.tp > 1:
        return 4 * shape.total + (4 * shape.largest_leaf if plan.num_workers > 1 else 0.0)
    # Without pipeline stages every rank fills every module, one module's fp32 values broadcast
    # at a time through the device (paratune.model.materialize.ModelInit.shared_values).
    # Under ep a rank builds only its E / ep experts (paratune.parallel.ep), FSDP2 keeps their
    # expert_dp shard.
    held, share = held_with_experts(plan, shape)
    largest = held.largest if share is not None else shape.largest_leaf
    exchange = 4 * largest if plan.num_workers > 1 and plan.pp == 1 else 0.0
    if plan.strategy == "fsdp":
        return 4 * shard_params(held.local, share.local if share else 0.0, fsdp_shard_degree(plan), share) + exchange
    held, _ = adapted_params(plan, held, shape.layers)  # DDP: LoRA's adapters too, its frozen linears maybe bf16
    return 4 * held.local - frozen_base_saving(plan, shape.layers) + exchange
