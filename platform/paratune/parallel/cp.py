"""Context parallelism: every sequence split over the cp ranks, attention as a ring over them.

torch's `context_parallel` (torch.distributed.tensor.experimental) shards the step's buffers
along the sequence and replaces SDPA by ring attention over the cp mesh while its context is
open (forward and backward). What a trainer must add around it, and what this module does:

* Buffers: the input ids, the labels shifted *before* sharding (label t is token t + 1, the
  last position ignored: after sharding a rank no longer holds its neighbour's next token) and
  the position ids (a rank holds a head and a tail chunk of every sequence, load balanced for
  causal attention, so its positions are not 0..S/cp). The model also gets a local all-ones
  2-D attention mask (without one transformers reads the non-contiguous positions as packed
  sequences and builds a mask on some ranks only: the ring then waits forever) and no cache.
* Loss: a rank's loss is its tokens' summed cross entropy over the micro-batch's token count
  (counted before sharding), so the cp ranks' losses add up to the micro-batch's mean loss,
  exactly what the single-process reference computes. The logged loss is that sum (one
  all-reduce over cp per step).
* Gradients: a rank's gradient is its share of the micro-batch's; the micro-batch's gradient is
  their sum over cp, then averaged over dp like every data-parallel gradient. The cp ranks hold
  the same parameters as dp ranks do, so the data-parallel layer reduces over dp x cp
  (ParallelDims.dp_mesh): DDP averages over its dp x cp ranks, so each rank's loss is scaled by
  cp before backward; FSDP2 (sharded or replicate) sums over dp x cp and divides by dp (its
  gradient divide factor, set on every FSDP unit; gloo has no PREMUL_SUM, so on CPU FSDP2 sums
  and divides after the reduction).

Only CUDA's SDPA kernels are ringed by torch 2.13 (flash, efficient, cudnn): a CPU worker is
refused unless a handler for the CPU kernel is in CP's handler table (tests install one to prove
this recipe on gloo). GQA runs on CUDA's flash kernel only, so bf16 compute; fp32 GQA would take
the math kernel, which the ring cannot replace.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paratune.config.sizes import config_sizes
from paratune.parallel.runner import StepRunner
from paratune.config.degrees import CP_CPU_REASON
from paratune.config.plan import Plan

IGNORE_INDEX = -100
# "alltoall" passes each rank's key/value chunk to its neighbour step by step (memory of one chunk);
# "allgather" gathers every chunk at once (cp chunks held). Both are exact.
ROTATE_METHOD = "alltoall"


def _cp_handler_table() -> dict:
    """The op -> handler table torch's CP dispatcher installs while its context is open."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention.custom_ops


def cpu_ring_attention_available() -> bool:
    """Whether CP can ring the CPU SDPA kernel: both its forward and backward ops have a handler
    in CP's table (torch 2.13 has none; a test shim adds them)."""
    aten = torch.ops.aten
    try:
        table = _cp_handler_table()
    except ImportError:
        return False
    return all(op in table for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
                                      aten._scaled_dot_product_flash_attention_for_cpu_backward.default))


def check_cp_supported(config, plan: Plan, device: torch.device) -> None:
    """What the plan rules cannot see before the workers start: the device, and the attention
    the built model really uses. Raises ValueError saying why and what is allowed."""
    cp = plan.cp
    if device.type == "cpu" and not cpu_ring_attention_available():
        raise ValueError(f"cp: {cp} on a CPU device: {CP_CPU_REASON}; allowed: cp 1 on CPU")
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        raise ValueError(f"cp: {cp} needs the model's attention to run through torch's SDPA (what the ring "
                         f"replaces), the model uses '{attn}'; allowed: attn_implementation 'sdpa'")
    sizes = config_sizes(config)
    heads, kv_heads = sizes.heads, sizes.kv_heads
    if device.type == "cuda" and plan.precision == "fp32" and kv_heads != heads:
        raise ValueError(f"cp: {cp} with precision 'fp32' and grouped-query attention ({heads} heads, {kv_heads} "
                         "KV heads): CUDA runs fp32 GQA on SDPA's math kernel only, which context parallel cannot "
                         "ring; allowed: precision 'bf16' (flash attention)")


def _fsdp_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def configure_gradient_reduction(module: nn.Module, layout_kind: str, dp: int, cp: int,
                                 device: torch.device) -> float:
    """Make the data-parallel layer's reduction over dp x cp ranks sum over cp and average over
    dp. Returns the factor each rank's loss is scaled by before backward.

    DDP divides the sum of dp x cp gradients by dp x cp: scaling every rank's loss by cp leaves
    (sum over dp and cp) / dp. FSDP2 (fully_shard and replicate) divides by a settable factor:
    dp, per FSDP unit (the setting is not recursive)."""
    if layout_kind == "ddp":
        return float(cp)
    if layout_kind not in ("fsdp", "replicate"):
        raise ValueError(f"cp: {cp} needs a data-parallel layer over the dp x cp ranks, got layout '{layout_kind}'")
    for unit in _fsdp_units(module):
        unit.set_gradient_divide_factor(float(dp))
        if device.type == "cpu":
            # A divide factor other than the group size makes FSDP2 reduce with NCCL's PREMUL_SUM,
            # which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): sum, then divide.
            unit.set_force_sum_reduction_for_comms(True)
    return 1.0


def shift_labels(ids: torch.Tensor) -> torch.Tensor:
    """Label t = token t + 1; the last position has none (what the model's own shift does)."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)


@contextlib.contextmanager
def sequence_shard(ids: torch.Tensor, cp_mesh, tp_seq_shards: int = 1) -> Iterator[dict]:
    """Open torch's context_parallel over this micro-batch and yield the model's keyword arguments
    for this rank's shard (forward and backward must both run inside).

    `tp_seq_shards`: how many parts sequence parallelism splits the rank's shard into before
    transformers sizes its mask (tp with sequence_parallel, else 1). The all-ones mask must have the
    length transformers sees, or it builds a mask instead of leaving SDPA causal."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    batch, seq = ids.shape
    ids = ids.clone()  # sharded in place (resized): never the caller's tensor
    labels = shift_labels(ids)
    positions = torch.arange(seq, device=ids.device).repeat(batch, 1)  # a real tensor: CP resizes it
    tokens = (labels != IGNORE_INDEX).sum()  # the whole micro-batch's, before sharding
    _cp_options.enable_load_balance = True  # head-tail chunks (plan rule: seq_len divisible by 2 x cp)
    set_rotate_method(ROTATE_METHOD)
    buffers = [ids, labels, positions]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        mask = torch.ones(batch, ids.shape[1] // tp_seq_shards, dtype=ids.dtype, device=ids.device)
        yield {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
               "labels": labels, "shift_labels": labels, "num_items_in_batch": tokens, "use_cache": False}


class CPStepRunner(StepRunner):
    """The torch-native step with every micro-batch sharded over the cp ranks. Returns the step's
    mean loss (the same on every cp rank, the reference's)."""

    def __init__(self, *args, cp_mesh, loss_scale: float, tp_seq_shards: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp_mesh, self.loss_scale, self.tp_seq_shards = cp_mesh, loss_scale, tp_seq_shards

    def micro_batch_inputs(self, ids: torch.Tensor):
        # Backward runs inside too: the ring runs there as well.
        return sequence_shard(ids, self.cp_mesh, self.tp_seq_shards)

    def step_loss(self, total: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(total, group=self.cp_mesh.get_group())  # this rank's shares -> the micro-batch means
        return total
