"""TEST-ONLY: lets torch's own context-parallel ring attention run on CPU/gloo.

This patches PRIVATE torch internals (torch 2.13) so that paratune's context-parallel recipe
(paratune.parallel.cp: sequence buffers, shifted labels, positions, mask, loss and gradient
scaling, FSDP2's divide factors) can be proven exact against the single-process reference on
CPU. It is never installed by paratune itself: production CPU runs of cp > 1 are refused (the
plan rule and paratune.parallel.cp.check_cp_supported, which probes the same handler table this
shim fills, so the refusal tells the truth about the running torch).

Why it is needed: on CPU, F.scaled_dot_product_attention lowers to
aten._scaled_dot_product_flash_attention_for_cpu, which is missing from CP's handler table
(torch/distributed/tensor/experimental/_context_parallel/_attention.py `custom_ops`, read when the
CP dispatcher is enabled) and has no DTensor sharding strategy, so torch raises
NotImplementedError. The handler below unwraps the Shard(2) DTensors CP makes of q/k/v and calls
torch's own ring (`_templated_ring_attention[_backward]`) with the CPU kernel as the per-chunk
op: the ring algorithm, load balancing and rotation are torch's, only the kernel differs.
"""

from __future__ import annotations

import torch
import torch.distributed.tensor.experimental._context_parallel._attention as cpa
from torch.distributed.tensor import DTensor, Shard

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # q/k/v/out are [batch, heads, seq, head_dim], logsumexp [batch, heads, seq]


def _unwrap(args, kwargs):
    """Local tensors of the sequence-sharded DTensor arguments, and their mesh."""
    mesh = None

    def local(x):
        nonlocal mesh
        if isinstance(x, DTensor):
            if x.placements != (Shard(SEQ_DIM),):
                raise AssertionError(f"cp_cpu_shim expects Shard({SEQ_DIM}), got {x.placements}")
            mesh = x.device_mesh
            return x.to_local()
        return x

    local_args, local_kwargs = [local(a) for a in args], {k: local(v) for k, v in kwargs.items()}
    return mesh, local_args, local_kwargs


def _wrap(local: torch.Tensor, mesh) -> DTensor:
    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    return DTensor.from_local(local, mesh, [Shard(SEQ_DIM)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _cpu_sdpa_handler(op_call, args, kwargs):
    mesh, args, kwargs = _unwrap(args, kwargs)
    group = mesh.get_group()
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallel supports no attention mask (causal only)")
    if op_call is FORWARD:
        query, key, value = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        out, logsumexp = cpa._templated_ring_attention(
            group, SEQ_DIM, FORWARD, query=query, key=key, value=value, is_causal=is_causal,
            dropout_p=dropout_p, scale=kwargs.get("scale"))
        return _wrap(out, mesh), _wrap(logsumexp, mesh)
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    grads = cpa._templated_ring_attention_backward(
        group, SEQ_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return tuple(_wrap(g, mesh) for g in grads[:3])  # grad q, k, v (the CPU kernel returns no more)


def install() -> None:
    """Register the CPU kernel's forward and backward in CP's handler table."""
    cpa.custom_ops[FORWARD] = _cpu_sdpa_handler
    cpa.custom_ops[BACKWARD] = _cpu_sdpa_handler


def uninstall() -> None:
    cpa.custom_ops.pop(FORWARD, None)
    cpa.custom_ops.pop(BACKWARD, None)
