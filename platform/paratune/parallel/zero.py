"""DeepSpeed ZeRO stages 0-3, with optional optimizer/parameter offload, and with tensor
parallelism by DeepSpeed's own AutoTP training (`tensor_parallel.autotp_size`).

AutoTP (DeepSpeed 0.19.8) shards the model inside `deepspeed.initialize`: it follows the
transformers model's tp_plan (Llama: q/k/v/gate/up column-, o/down row-parallel, the LM head
column-parallel with its logits gathered; a tied embedding and head become vocab-parallel with a
distributed loss), builds a (dp, tp) device mesh with tp innermost (deepspeed/utils/groups.py
`_init_tp_mesh_device`: the same layout as paratune's ParallelDims), and hands ZeRO the dp group:
ZeRO partitions and averages over the dp ranks only. Every ZeRO stage composes with it (ZeRO-3:
the model is built under zero.Init, partitioned over all ranks; AutoTP gathers each layer it
shards, one at a time, and partitions its tp shard over dp; replicated parameters such as norms
and an untied embedding stay partitioned over all ranks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from paratune.model.adapters import add_adapters
from paratune.model.materialize import ModelInit, attn_implementation, materialize
from paratune.levers import APPLY_STAGES
from paratune.parallel.runner import ADAM_BETAS, ADAM_EPS, StepRunner, apply_levers, make_optimizer
from paratune.config.plan import Plan



def restore_torch_linear() -> bool:
    """Put torch's own `torch.nn.functional.linear` back if DeepSpeed's zero.Init replaced it.

    zero.Init swaps in its memory-efficient linear (an autograd function that saves the input and
    the weight of every linear, frozen or not) and leaves it there ("This will persist unless
    manually reset", partition_parameters.py): every later plan a reused worker process runs would
    be timed and measured under DeepSpeed's linear (seen: a LoRA DDP step 8% above its own peak
    after a ZeRO-3 trial). Each build puts it back; a ZeRO-3 build's zero.Init swaps it in again.
    True if it was replaced."""
    import sys

    patched = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(patched, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is None or torch.nn.functional.linear is original:
        return False
    torch.nn.functional.linear = original
    return True

def uses_deepspeed_optimizer(plan: Plan, on_gpu: bool) -> bool:
    """Whether DeepSpeed builds the optimizer from its config's `optimizer` block, as a DeepSpeed
    user's run does (DeepSpeedCPUAdam under optimizer offload, AdamW on the GPU otherwise), or is
    handed paratune's torch AdamW (`optimizer: torch`; `auto` on CPU, where the parity tests run)."""
    return plan.strategy == "zero" and (plan.optimizer == "deepspeed" or (plan.optimizer == "auto" and on_gpu))


def optimizer_block(plan: Plan, on_gpu: bool) -> dict[str, Any]:
    """DeepSpeed's `optimizer` section for the plan's AdamW (the same hyper-parameters as
    paratune's torch AdamW). Under optimizer offload DeepSpeed picks its CPU Adam (multi-threaded,
    SIMD); on the GPU it runs torch's fused AdamW (`torch_adam`), which needs no JIT-compiled op."""
    params: dict[str, Any] = {"lr": plan.lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                              "weight_decay": plan.weight_decay}
    offload = plan.zero is not None and plan.zero.offload_optimizer
    if not offload:
        params.update({"torch_adam": True, "fused": on_gpu})
    return {"type": "AdamW", "params": params}


def deepspeed_config(plan: Plan, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed JSON a plan implies (also what the winner exports: always with the optimizer
    block, so a plain `deepspeed.initialize(config=...)` trains what was tuned)."""
    z = plan.zero
    assert z is not None
    zero: dict[str, Any] = {
        "stage": z.stage,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
        "overlap_comm": z.overlap_comm,
    }
    if z.stage == 3:
        zero["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if z.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config: dict[str, Any] = {
        # DeepSpeed checks train_batch = micro x accum x world, its world being every rank when
        # AutoTP is set from the config (runtime/config.py: no mpu yet when the config is read):
        # the tp ranks count as if they were data ranks. The samples of a step stay global_batch
        # (a tp group trains on the same micro-batches; gradients are averaged over dp only).
        "train_batch_size": plan.global_batch * plan.tp,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        # Always explicit: a DeepSpeed default here would silently change the training.
        "gradient_clipping": plan.grad_clip,
        "bf16": {"enabled": plan.precision == "bf16"},
        "zero_optimization": zero,
        "optimizer": optimizer_block(plan, on_gpu),
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    if not uses_deepspeed_optimizer(plan, on_gpu):
        # Measured with paratune's own torch AdamW (the CPU parity path): DeepSpeed must accept it
        # with ZeRO and with offload instead of forcing its CPU Adam. The block above is unused then.
        config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        del config["optimizer"]
    return config


class DeepSpeedRunner(StepRunner):
    """DeepSpeed owns accumulation (scales the loss by 1/grad_accum), clipping and the step."""

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        engine = self.model
        total = torch.zeros((), device=self.device)
        for ids in micro_batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()  # applies the optimizer only at the accumulation boundary
            total += loss.detach().float()
        self.steps_done += 1
        return total / len(micro_batches)

    def save_state(self, path: str) -> None:
        """DeepSpeed's own checkpoint (its ZeRO partitions per rank, fp32 master weights included)."""
        self.model.save_checkpoint(path, tag="state")

    def load_state(self, path: str) -> None:
        load_path, _ = self.model.load_checkpoint(path, tag="state")
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path}")


def build_zero3(init: ModelInit, ds_config: dict[str, Any], device: torch.device, plan: Plan) -> nn.Module:
    """ZeRO-3 construction as DeepSpeed does it: under `zero.Init` each module's parameters are
    partitioned as soon as the module is built (to the host under parameter offload), so a rank
    never holds more than one whole module. Values are then written one module at a time through
    `GatheredParameters` (the copy of the rank that made them is broadcast; ranks take turns):
    the same values as the reference's. LoRA adapters (plan.peft) are added after zero.Init, as a
    Hugging Face LoRA run under ZeRO-3 adds them: whole on every rank (a rank-sized few MB), each
    rank writes peft's seeded values itself, and deepspeed.initialize partitions them."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    offload = ds_config["zero_optimization"].get("offload_param")
    # zero.Init needs the partitioning and precision settings only (its own batch-size check
    # would run against a world size it has not learned yet).
    init_config = {"train_micro_batch_size_per_gpu": ds_config["train_micro_batch_size_per_gpu"],
                   "zero_optimization": ds_config["zero_optimization"], "bf16": ds_config["bf16"]}
    with deepspeed.zero.Init(config_dict_or_path=init_config, remote_device="cpu" if offload else None,
                             pin_memory=bool(offload and offload.get("pin_memory"))), no_init_weights():
        model = AutoModelForCausalLM.from_config(init.config, attn_implementation=attn_implementation(init.config))
    if getattr(init.config, "tie_word_embeddings", False):
        model.tie_weights()  # no_init_weights also skipped the tying
    add_adapters(model, plan, device)
    model_init = ModelInit(model, init.config, init.seed, init.dtype)
    model_init.sources = list(init.sources)  # pretrained weights: read by the rank that makes a module
    model_init.template_hooks = list(init.template_hooks)  # the adapters' structure on the host template
    by_owner = model_init.targets_by_owner()
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for i, (owner, targets) in enumerate(by_owner.items()):
            src = i % world  # module i's values are made by one rank (round-robin), then broadcast
            values = model_init.host_values(owner) if rank == src else None
            params = [t.module._parameters[t.attr] for t in targets if t.kind == "param"]
            if params and not any(hasattr(p, "ds_id") for p in params):  # adapters, not yet partitioned
                own = values if values is not None else model_init.host_values(owner)
                for target in targets:
                    if target.kind == "param":
                        target.module._parameters[target.attr].data.copy_(own[target.owner_attr])
                continue
            with deepspeed.zero.GatheredParameters(params, modifier_rank=src):
                for target in targets:
                    if target.kind == "param" and rank == src:
                        target.module._parameters[target.attr].data.copy_(values[target.owner_attr])
            for target in targets:  # buffers are not partitioned: every rank sets its own
                if target.kind == "buffer":
                    buf_values = values if values is not None else model_init.host_values(owner)
                    # Replaced, not copied into: zero.Init creates floating tensors (torch.arange
                    # too) in the training dtype, so a rotary `inv_freq` made under it is bf16,
                    # off by ~0.4%; the reference's is fp32, and so must this one be.
                    current = target.module._buffers[target.attr]
                    target.module._buffers[target.attr] = buf_values[target.owner_attr].to(current.device)
    return model  # buffers (rotary tables) were created on the device: zero.Init places them there


def forget_deepspeed_groups() -> None:
    """Start an engine from no DeepSpeed process groups, as in a fresh process.

    DeepSpeed keeps the tensor/data-parallel groups and the `mpu` an AutoTP engine installs in
    module globals (deepspeed/utils/groups.py) and every later engine of the process reuses them
    (`_init_tp_mesh_device` returns early once a tp group exists): a tp 1 engine after a tp 2 one
    would take the old groups' sizes (engine.py then fails on `self.mpu` None), a tp 4 one would
    keep tp 2's groups. Only DeepSpeed's own destroy_process_group clears them; this does the same
    (the groups themselves stay valid for whoever still holds them)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def check_tp_layout(plan: Plan, device: torch.device) -> None:
    """AutoTP's groups must be paratune's: the data a rank trains on is chosen by its dp rank in
    ParallelDims (pp x dp x tp, tp innermost), and a tp group must see the same micro-batches."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from paratune.parallel.dims import ParallelDims

    dims = ParallelDims.from_plan(plan, device.type)
    _, dp_idx, tp_idx = dims.coords(dist.get_rank())
    want = {"tensor": [dp_idx * dims.tp + t for t in range(dims.tp)],
            "data": [d * dims.tp + tp_idx for d in range(dims.dp)]}
    got = {"tensor": dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
           "data": dist.get_process_group_ranks(groups.get_data_parallel_group())}
    if got != want:
        raise RuntimeError(f"DeepSpeed AutoTP groups {got} of rank {dist.get_rank()} are not paratune's "
                           f"(dp {dims.dp} x tp {dims.tp}, tp innermost): {want}")


def skip_shm_allreduce_on_cpu(device: torch.device) -> None:
    """On the CPU accelerator, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op
    (deepspeed_shm_comm) the first time it starts: 30-80 s of C++ on 2 cores, again whenever the
    venv's path changes, charged to a trial's launch. Only `inference_all_reduce` uses it; training
    collectives (ZeRO's, AutoTP's RowParallel in training mode) go through torch.distributed, gloo
    here as for DDP and FSDP. Marked incompatible, it is never built. GPU accelerators have no such
    op: nothing changes there."""
    if device.type != "cpu":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False  # a module-level dict DeepSpeed reads


def align_local_rank_with_device(device: torch.device) -> None:
    """Make LOCAL_RANK name the GPU this worker was given, before DeepSpeed reads it.

    DeepSpeed takes its device from LOCAL_RANK (engine `_set_distributed_vars`, zero.Init's
    `local_device`, zero/utils.py: `device_name(os.environ["LOCAL_RANK"])`), while Ray Train gives
    a worker the device at the index of its GPU id in CUDA_VISIBLE_DEVICES, which Ray builds from
    ids sorted as strings ("0,1,10,11,...,2,3"), and numbers local ranks by ids sorted as integers
    (ray.train.v2 callbacks/accelerators.py, worker_group.py). On a node with more than 10 GPUs
    they differ: on 16 GPUs the worker of GPU 2 has local rank 2 and device cuda:8, and DeepSpeed would put
    it on cuda:2, the GPU of another worker. The device paratune was handed (Ray's) wins."""
    if device.type != "cuda" or device.index is None:
        return
    os.environ["LOCAL_RANK"] = str(device.index)
    torch.cuda.set_device(device)


def parallelize_zero(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device) -> StepRunner:
    from functools import partial

    import deepspeed

    align_local_rank_with_device(device)  # before zero.Init and initialize read LOCAL_RANK
    skip_shm_allreduce_on_cpu(device)  # before zero.Init / initialize start DeepSpeed's comm backend
    forget_deepspeed_groups()  # before zero.Init too: it partitions over DeepSpeed's dp group
    on_gpu = device.type == "cuda"
    config = deepspeed_config(plan, on_gpu)
    if plan.zero.stage == 3:
        model = build_zero3(init, config, device, plan)
    else:  # ZeRO 0-2 replicate the weights: every rank holds the whole model (AutoTP shards it next)
        materialize(model, init, device)
    if init.meter is not None:
        init.meter.stop()
    # On the built model (ZeRO-3's is built anew under zero.Init): the loss form (float8 is refused
    # with ZeRO), checkpointing, compile (ZeRO 0-2: the plan refuses compile with ZeRO-3).
    for stage in APPLY_STAGES:
        apply_levers(model, plan, stage)
    # The optimizer is made by DeepSpeed from the module's parameters once AutoTP has replaced the
    # layers it shards (DeepSpeed's own AdamW from the config, or paratune's torch AdamW).
    optimizer = None if uses_deepspeed_optimizer(plan, on_gpu) else partial(make_optimizer, plan=plan)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                      dist_init_required=False)
    if plan.tp > 1:
        check_tp_layout(plan, device)
    return DeepSpeedRunner(engine, ds_optimizer, plan, device)
