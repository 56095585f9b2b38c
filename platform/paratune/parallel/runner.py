"""The step every strategy runs: StepRunner (accumulate, clip, step), the shared AdamW and recompute.

Strategy modules (ddp, fsdp, nd, cp, zero) subclass or build a StepRunner from here; the package
`__init__` only dispatches a plan to them, so nothing here imports a strategy module.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn

from paratune.levers import applied_at
from paratune.parallel.loss import local_loss, loss_context, recorded_loss_form
from paratune.config.plan import Plan


ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8


def make_optimizer(params, plan: Plan) -> torch.optim.Optimizer:
    """The same AdamW for every strategy (and the reference), so losses are comparable; it steps
    only the parameters that require gradients (LoRA: the adapters, not the frozen base)."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=plan.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=plan.weight_decay)


@dataclass(frozen=True)
class WorkerPlace:
    """Where a lever is applied: the rank's device and its tp group's name (async TP needs both)."""

    device: torch.device | None = None
    tp_group_name: str | None = None


def apply_levers(model: nn.Module, plan: Plan, stage: str, place: WorkerPlace = WorkerPlace()) -> None:
    """Every registered lever's runtime for one stage (paratune.levers.APPLY_STAGES: before_layout,
    before_shard, before_wrap), in registration order; each imported only here, on the workers."""
    for target in applied_at(stage):
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(model, plan, place)


def _no_sync_context(step: int, last_micro: bool) -> ContextManager:
    return contextlib.nullcontext()


def _no_forward_extra(ids: torch.Tensor) -> dict:
    return {}


class StepRunner:
    """The torch-native step (DDP, FSDP2, single process): accumulate, clip, step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: Plan,
        device: torch.device,
        sync_context: Callable[[int, bool], ContextManager] | None = None,
        autocast: bool = False,
        clip: Callable[[], object] | None = None,
        forward_extra: Callable[[torch.Tensor], dict] | None = None,
        before_step: Callable[[], None] | None = None,
    ):
        self.model, self.optimizer, self.plan, self.device = model, optimizer, plan, device
        self._sync_context = sync_context or _no_sync_context
        self._autocast = autocast
        # No default closure over self: a runner must not keep itself alive through a reference
        # cycle (a finished trial's model would then outlive it and inflate the next one's peak).
        self._clip = clip
        self._forward_extra = forward_extra or _no_forward_extra
        # Gradient work the wrapper does not do, after the last micro-batch (ep under DDP: the experts').
        self._before_step = before_step
        self.steps_done = 0
        # The loss's form that runs (paratune.parallel.loss records it on the model), and why `auto`
        # fell back to standard (None when it did not): reported with the trial's measurements.
        self.loss_form, self.loss_fallback = (recorded_loss_form(model) if isinstance(model, nn.Module)
                                              else ("standard", None))

    def clip_gradients(self) -> None:
        if self._clip is not None:
            self._clip()
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.plan.grad_clip)

    def micro_batch_roots(self) -> list[nn.Module]:
        """The modules each micro-batch enters through (for per-micro-batch instrumentation)."""
        return [self.model]

    def _autocast_ctx(self) -> ContextManager:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # Each rank's loss is multiplied by this before backward (context parallelism: DDP averages
    # over dp x cp ranks where the step needs the sum over cp).
    loss_scale: float = 1.0

    @contextlib.contextmanager
    def micro_batch_inputs(self, ids: torch.Tensor) -> Iterator[dict]:
        """The model's keyword arguments for one micro-batch; forward and backward run inside (and
        inside the loss form's context: loss_parallel for vocab_parallel, closed even on failure)."""
        with loss_context(self.loss_form):
            yield {"input_ids": ids, "labels": ids, **self._forward_extra(ids)}

    def step_loss(self, total: torch.Tensor) -> torch.Tensor:
        """The step's summed micro-batch losses as the reference computes them (hook: cp sums ranks)."""
        return total

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        """One optimizer step; the mean loss, or None on a rank that computes no loss (a PP stage)."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, ids in enumerate(micro_batches):
            with self._sync_context(self.steps_done, i == n - 1), self.micro_batch_inputs(ids) as inputs:
                with self._autocast_ctx():
                    loss = self.model(**inputs).loss
                (loss * self.loss_scale / n).backward()
            total += local_loss(loss.detach()).float()
        total = self.step_loss(total)
        self.optimizer_step()
        return total / n

    def optimizer_step(self) -> None:
        """Clip (when the plan does), step and zero the gradients: the end of every step."""
        if self._before_step is not None:
            self._before_step()
        if self.plan.grad_clip > 0:
            self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

    def save_state(self, path: str) -> None:
        """Model and optimizer state, sharded as the strategy holds it (torch.distributed.checkpoint:
        each rank writes its own shards, so a checkpoint never gathers the model on one rank;
        expert parallelism: each ep rank's experts under names of their own, paratune.parallel.ep)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        module = self._state_module()
        model_state, optim_state = get_state_dict(module, self.optimizer)
        dcp.save(_renamed({"model": model_state, "optim": optim_state}, _expert_renames(module)), checkpoint_id=path)

    def load_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        module = self._state_module()
        renames = _expert_renames(module)
        model_state, optim_state = get_state_dict(module, self.optimizer)
        state = _renamed({"model": model_state, "optim": optim_state}, renames)
        dcp.load(state, checkpoint_id=path)
        state = _renamed(state, {new: old for old, new in renames.items()})
        set_state_dict(module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _state_module(self) -> nn.Module:
        return self.model if isinstance(self.model, nn.Module) else nn.ModuleList(self.model)


def _expert_renames(module: nn.Module) -> dict[str, str]:
    from paratune.parallel.ep import checkpoint_renames

    return checkpoint_renames(module)


def _renamed(state: dict, renames: dict[str, str]) -> dict:
    """A {"model", "optim"} state with the model's keys and the optimizer's per-parameter state
    keys renamed (param_groups keep the plain names: they are the same on every rank)."""
    if not renames:
        return state
    optim = dict(state["optim"])
    optim["state"] = {renames.get(k, k): v for k, v in optim.get("state", {}).items()}
    return {"model": {renames.get(k, k): v for k, v in state["model"].items()}, "optim": optim}
