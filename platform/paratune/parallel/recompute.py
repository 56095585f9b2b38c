"""Activation checkpointing: none, selective (per op), selective_op (torchtitan's per-op policy),
every N-th layer, full (paratune.levers).

Each checkpointed decoder block's class `forward` is recomputed (`checkpoint_blocks`: the block
takes a subclass of its own class, made once per class and mode, whose forward runs the family's
inside torch.utils.checkpoint). Module hooks (FSDP2's, DDP's) run in `__call__`, so they stay
outside the recomputed region, and any caller of the block (the model's forward, a pipeline
stage's loop, a compiled `__call__`) gets the same checkpoint; a compiled block traces it inside
its graph (Dynamo starts its frame at the forward), so selective checkpointing's policy is
applied by the compiler. paratune does this itself rather than through transformers' hook
(`activation_checkpointing_enable`), because that hook differs by release: 5.2x wraps the
class `forward` (modeling_layers.py GradientCheckpointingLayer), but 5.17, the GPU image's,
wraps `__call__`, which puts FSDP2's hooks inside the recompute and the checkpoint outside a
compiled block's graph, where selective checkpointing's dispatch modes cannot see Inductor's
kernels. The blocks checkpoint only in training mode (`self.training`).
"""

from __future__ import annotations

from functools import lru_cache, partial, wraps
from typing import Any, Callable, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paratune.config.plan import Plan
from paratune.levers.checkpointing import Checkpointing

aten = torch.ops.aten
c10d_functional = torch.ops._c10d_functional
# Selective (per-op) checkpointing saves the outputs of these ops and recomputes everything else
# in a block (norms, activations, rotary, residual adds, softmax-free elementwise work): the
# matmuls and the attention kernel are the expensive part of a block's forward, their outputs
# the activations worth keeping. The SDPA names are what each device dispatches: CPU's
# (measured, bench/results/levers_cpu_probe.md), CUDA's flash, mem-efficient and cuDNN kernels.
SAVED_OPS: frozenset = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})
# Under tp, DTensor's redistributions inside a block are functional collectives
# (torch/distributed/_functional_collectives.py: ops of the `_c10d_functional` namespace; what
# DTensor dispatches on gloo as on NCCL): RowwiseParallel's all_reduce (reduce_scatter_tensor
# with sequence parallelism), the sequence-parallel all_gather_into_tensor before the
# column-parallel projections. Saved, the backward's recompute never runs a collective again
# (a recomputed collective costs the communication twice and must be matched by every tp rank).
# wait_tensor only completes an async result (no communication): recomputing it is free.
SAVED_COLLECTIVES: frozenset = frozenset({
    c10d_functional.all_reduce.default,
    c10d_functional.reduce_scatter_tensor.default,
    c10d_functional.all_gather_into_tensor.default,
    c10d_functional.all_to_all_single.default,
})


def saved_ops(tp: bool) -> frozenset:
    """The ops whose outputs selective checkpointing keeps: SAVED_OPS, and the collectives under tp."""
    return SAVED_OPS | SAVED_COLLECTIVES if tp else SAVED_OPS


def selective_policy(tp: bool) -> Callable[..., CheckpointPolicy]:
    """The per-op policy of selective checkpointing, as torch.utils.checkpoint's
    `create_selective_checkpoint_contexts` takes it: `policy(ctx, func, *args, **kwargs)` ->
    MUST_SAVE for `saved_ops(tp)`, PREFER_RECOMPUTE for every other op. A pure function of the op
    (it reads neither ctx nor the arguments), so a memory model can run a block's forward under
    fake tensors with it and sum the bytes of the outputs of the ops it saves."""
    keep = saved_ops(tp)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# torchtitan's op-level selective checkpointing (selective_ac_option "op"; torchtitan
# distributed/activation_checkpoint.py `_apply_op_sac`, the save list of models/llama3 and llama4's
# parallelize.py): every matmul's output is kept except every second one of a block's forward
# (counted in dispatch order, the 2nd, 4th, ... recomputed), the attention kernels' outputs and
# these ops' are kept, everything else is recomputed. torchtitan's models have no biases, so its
# matmuls are all aten.mm; a biased linear (qwen2's q/k/v) dispatches aten.addmm, counted here as
# a matmul too so "every second matmul" holds on every family. reduce_scatter and all_to_all (its
# tp + sequence-parallel and expert-parallel lists) are kept; the other collectives (SP's
# all-gather, tp's all-reduce) are recomputed as torchtitan does: every tp rank recomputes the same
# block in the same backward, so they stay matched, at the cost of running them again. aten.max:
# kept for low-precision scaling (torchtitan's note: float8's amax).
OP_POLICY_MATMULS: frozenset = frozenset({aten.mm.default, aten.addmm.default})
OP_POLICY_SAVED: frozenset = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.max.default,
    c10d_functional.reduce_scatter_tensor.default,
    c10d_functional.all_to_all_single.default,
})


def op_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh torchtitan op-level policy (one per checkpointed call: it counts that call's
    matmuls): the 1st, 3rd, 5th, ... matmul of the block's forward MUST_SAVE, the 2nd, 4th, ...
    PREFER_RECOMPUTE; OP_POLICY_SAVED MUST_SAVE; every other op PREFER_RECOMPUTE. torch 2.13 calls
    the policy in the forward only (the recompute replays the decisions by op index), so one
    count per forward suffices; a memory model running a block's forward under fake tensors with
    it sees the same decisions as the run."""
    matmuls = 0

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        nonlocal matmuls
        if func in OP_POLICY_MATMULS:
            matmuls += 1
            return CheckpointPolicy.MUST_SAVE if matmuls % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_POLICY_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts() -> tuple:
    return create_selective_checkpoint_contexts(op_policy())


def op_context_fn() -> Callable[[], tuple]:
    """torch.utils.checkpoint's `context_fn` for `selective_op`: a fresh policy (a fresh matmul
    count) per checkpointed call, from one function object for the process (a compiled block's
    guards check its identity)."""
    return _op_contexts


@lru_cache(maxsize=None)
def selective_context_fn(tp: bool) -> Callable[[], tuple]:
    """torch.utils.checkpoint's `context_fn` for selective checkpointing (a fresh pair of contexts
    per checkpointed call, as the function must give). One object per tp flag for the process:
    a compiled block's guards check its identity, so every block and plan shares it."""
    return partial(create_selective_checkpoint_contexts, selective_policy(tp))


FULL_KWARGS: dict[str, Any] = {"use_reentrant": False}  # the reentrant form cannot run a policy


@lru_cache(maxsize=None)
def _checkpointed_class(cls: type, mode: str, tp: bool) -> type:
    """`cls` whose forward runs inside torch.utils.checkpoint (training mode only), with the mode's
    kwargs: one class per (block class, mode), so blocks of a class share the forward's code and
    closure (one compiled graph serves them all). Same name as `cls`: code that finds blocks or
    layers by class name (transformers' `_no_split_modules`, DeepSpeed's AutoTP) still does."""
    from torch.utils.checkpoint import checkpoint

    original = cls.forward
    context_fn = {"selective": lambda: selective_context_fn(tp), "selective_op": op_context_fn}.get(mode)
    kwargs = {**FULL_KWARGS, "context_fn": context_fn()} if context_fn else FULL_KWARGS

    @wraps(original)  # the family's signature stays visible (pipeline stages read it)
    def forward(self, *args, **call_kwargs):
        if not self.training:
            return original(self, *args, **call_kwargs)
        return checkpoint(partial(original, self, **call_kwargs), *args, **kwargs)
    return type(cls.__name__, (cls,), {"forward": forward, "__qualname__": cls.__qualname__,
                                       "__module__": cls.__module__, "_paratune_checkpointed": mode})


def checkpoint_blocks(model: nn.Module, mode: str, every_n_layers: int = 1, tp: bool = False) -> None:
    """Blocks 0, N, 2N, ... of the model's decoder (N = every_n_layers) recomputed in backward:
    `mode` "full" (the whole block), "selective" (SAVED_OPS kept, under tp the collectives too) or
    "selective_op" (torchtitan's op-level policy, `op_policy`).
    In place, on the meta or a real model, before any wrapper (FSDP2 subclasses the block's class
    again and keeps this forward)."""
    from paratune.model.build import decoder_blocks

    for i, block in enumerate(decoder_blocks(model)):
        if i % every_n_layers:
            continue
        base = type(block)
        while getattr(base, "_paratune_checkpointed", None) is not None:  # set again: from the original
            base = base.__mro__[1]
        block.__class__ = _checkpointed_class(base, mode, tp)


def checkpoint_settings(plan: Plan) -> tuple[str, int] | None:
    """(mode, every_n_layers) for the plan's checkpointing; None: off. `layers` with checkpoint_every
    N recomputes blocks 0, N, 2N, ... whole (transformers' every_n_layers); `full` and `selective`
    are N = 1 (every block)."""
    mode = plan.activation_checkpointing
    if mode == "none":
        return None
    if mode == "full":
        return "full", 1
    if mode == "layers":
        return "full", plan.checkpoint_every
    if mode in ("selective", "selective_op"):
        return mode, 1
    raise ValueError(f"activation_checkpointing: '{mode}' is not a mode; allowed: "
                     f"{', '.join(get_args(Checkpointing))}")


def apply_lever(model: nn.Module, plan: Plan, place) -> None:  # noqa: ANN001 - a runner.WorkerPlace
    """The checkpointing lever's runtime (paratune.levers.checkpointing: stage before_shard)."""
    apply_checkpointing(model, plan)


def apply_checkpointing(model: nn.Module, plan: Plan) -> None:
    """Set the plan's checkpointing on the model's decoder blocks (before any wrapper)."""
    settings = checkpoint_settings(plan)
    if settings is None:
        return
    mode, every_n_layers = settings
    checkpoint_blocks(model, mode, every_n_layers, tp=plan.tp > 1)


def enable_full_recompute(model: nn.Module) -> None:
    """Every block recomputed whole (profiling and the activation estimate use it outside a plan)."""
    checkpoint_blocks(model, "full")


def checkpointed_blocks(model: nn.Module) -> list[bool]:
    """Per decoder block, whether it is set to recompute (what `apply_checkpointing` did)."""
    from paratune.model.build import decoder_blocks

    return [getattr(type(block), "_paratune_checkpointed", None) is not None for block in decoder_blocks(model)]


def policy_key(checkpointing: str) -> str:
    """What a checkpointing mode's policy keeps, as text (the traced memory model's store key:
    paratune.costs.activations): `selective`'s SAVED_OPS; `selective_op`'s ops and its policy's
    code (which of the matmuls it keeps); "" for the others (no per-op policy)."""
    import hashlib
    import inspect

    if checkpointing == "selective":
        return ",".join(sorted(str(op) for op in SAVED_OPS))
    if checkpointing == "selective_op":
        return (",".join(sorted(str(op) for op in OP_POLICY_SAVED)) + ";" + ",".join(sorted(str(op) for op in OP_POLICY_MATMULS))
                + ";" + hashlib.sha256(inspect.getsource(op_policy).encode()).hexdigest())
    return ""

