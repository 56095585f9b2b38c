"""DeepSpeed ZeRO stages 0-3, with optional optimizer/parameter offload."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratune.parallel import StepRunner, apply_activation_checkpointing, make_optimizer
from paratune.plan import Plan


def deepspeed_config(plan: Plan, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed JSON a plan implies (also what the winner exports)."""
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
    return {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        # Always explicit: a DeepSpeed default here would silently change the training.
        "gradient_clipping": plan.grad_clip,
        "bf16": {"enabled": plan.precision == "bf16"},
        "zero_optimization": zero,
        # The optimizer is paratune's own AdamW (same as every other strategy); allow it with
        # ZeRO and with offload instead of forcing DeepSpeed's JIT-compiled CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


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


def parallelize_zero(model: nn.Module, plan: Plan, device: torch.device) -> StepRunner:
    import deepspeed

    apply_activation_checkpointing(model, plan)
    optimizer = make_optimizer(model.parameters(), plan)
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(plan, device.type == "cuda"),
        dist_init_required=False,
    )
    return DeepSpeedRunner(engine, ds_optimizer, plan, device)
