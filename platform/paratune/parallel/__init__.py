"""Dispatch a plan to its strategy: `build_runner` and `parallelize` turn a model into a StepRunner.

A StepRunner (paratune.parallel.runner) runs one whole optimizer step over this rank's
micro-batches and returns the mean loss. Strategy modules differ only in how they wrap the model,
suppress gradient sync between micro-batches, and step the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paratune.model.adapters import add_adapters, prepare_init
from paratune.model.checkpoints import checkpoint_sources
from paratune.model.materialize import ConstructionMeter, ModelInit, build_meta
from paratune.parallel.zero import restore_torch_linear
from paratune.config.plan import Plan

if TYPE_CHECKING:  # the runner is built by the strategy modules; this package only dispatches
    from paratune.parallel.runner import StepRunner


def use_comm_timeout(seconds: float) -> None:
    """Every process group this process creates from now on times out after `seconds`.

    The world group gets the plan's timeout from whoever starts it (Ray Train's TorchConfig, a
    reused group's own init), but the sub-groups are created later without one: DeviceMesh's tp,
    cp, pp, dp x cp and hybrid-shard groups (`new_group` / `split_group` with timeout=None) and
    DeepSpeed's AutoTP mesh (deepspeed.comm's `new_group(ranks)`). c10d then takes its library
    default, read at creation time from these two module globals (`_get_default_timeout`): 10 min
    for NCCL, 30 min for gloo, so a hang inside a tp group was seen late and ended as `hang`
    instead of `comm_timeout`. Setting the globals reaches every creator, paratune's and the
    libraries'. They stay set until the next plan of the process sets its own (groups created
    lazily, during the steps, get the timeout too)."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):  # None in builds without NCCL
        c10d.default_pg_nccl_timeout = timeout


def build_runner(config, plan: Plan, device: torch.device, local_world_size: int,
                 meter: ConstructionMeter | None = None) -> StepRunner:
    """The model of `config`, laid out by the plan, with only this rank's part materialized.

    Built on the meta device, then `parallelize` applies the plan and allocates what this rank
    holds, with the reference's values (the same seed gives the same weights on every rank and
    every device; a `model` folder with safetensors gives its pretrained weights). `meter` (started by the caller) is stopped once the model exists. Every
    process group the layout creates takes the plan's comm_timeout_s (`use_comm_timeout`)."""
    use_comm_timeout(plan.comm_timeout_s)
    restore_torch_linear()  # an earlier ZeRO-3 plan in this process left DeepSpeed's linear in torch
    model = add_adapters(build_meta(config), plan)  # LoRA (plan.peft) before any layout: every layout sees it
    model.train()
    init = ModelInit(model, config, plan.seed)
    init.sources += checkpoint_sources(plan.model, config)  # a folder with weights: pretrained values
    prepare_init(init, plan)  # the adapters' structure and seeded values
    init.meter = meter
    init.comm_device = device
    names = {id(module): name for name, module in model.named_modules()}  # before pp takes stages out of it
    runner = parallelize(model, init, plan, device, local_world_size)
    runner.hf_model, runner.hf_module_names = model, names  # the layout was applied in place: its names are the checkpoint's (paratune.train.hf_export)
    if meter is not None:
        meter.stop()
    return runner


def parallelize(model: nn.Module, init: ModelInit, plan: Plan, device: torch.device,
                local_world_size: int) -> StepRunner:
    """Dispatch to the plan's strategy (and its tensor/pipeline degrees).

    `model` is built on the meta device; each strategy applies its layout first and then
    materializes only what this rank holds (`init` fills the values), before its optimizer."""
    if (plan.tp > 1 or plan.pp > 1 or plan.cp > 1) and plan.strategy != "zero":  # ZeRO: DeepSpeed's own AutoTP
        from paratune.parallel.nd import parallelize_model_parallel

        return parallelize_model_parallel(model, init, plan, device, local_world_size)
    if plan.strategy == "ddp":
        from paratune.parallel.ddp import parallelize_ddp

        return parallelize_ddp(model, init, plan, device)
    if plan.strategy == "fsdp":
        from paratune.parallel.fsdp import parallelize_fsdp

        return parallelize_fsdp(model, init, plan, device, local_world_size)
    if plan.strategy == "zero":
        from paratune.parallel.zero import parallelize_zero

        return parallelize_zero(model, init, plan, device)
    raise ValueError(f"strategy: got '{plan.strategy}'; allowed: ddp, fsdp, zero")
