"""What a GPU rank holds beyond the tensors the memory model counts: named CUDA-only terms.

paratune.costs.memory predicts the peak of the tensors a step allocates (what PyTorch's MemTracker
measures in the CPU trials, and `torch.cuda.max_memory_allocated` on a GPU). A GPU's memory also
holds, per process:

- inside PyTorch's caching allocator (`torch.cuda.max_memory_reserved` counts them): cuBLAS's
  workspace, one per (handle, stream) that runs a matmul (CUBLAS_WORKSPACE_BYTES);
- outside it (only `nvidia-smi` / `torch.cuda.mem_get_info` see them): the CUDA context
  (CUDA_CONTEXT_BYTES) and NCCL's buffers, per communicator (NCCL_BYTES_PER_GROUP; an
  all-to-all adds its direct connections to each peer: NCCL_ALL_TO_ALL_BYTES_PER_PEER).

Each figure names its public source. They are point terms, not a margin: the band a plan's memory
carries (paratune.costs.bands) is the memory model's own measured error. A CPU plan (gloo) has none
of them. What they leave out: the caching allocator's fragmentation (no public measurement found;
`expandable_segments` keeps it small), FlashAttention's and cuDNN's scratch, NVLS / CollNet buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratune.config.devices import Device
from paratune.config.plan import Plan

# The CUDA context of a process: "around 400MB if CUDA >= 11.7 is used and lazy module loading
# enabled (default in PyTorch)" (a PyTorch maintainer, pytorch/pytorch#109888, 2023-09-23).
CUDA_CONTEXT_BYTES = 400e6
# NCCL's buffers for one communicator on 8 H100s: "[0] NV 1.06 GB" held by NCCL before the first
# all-to-all, "[0] NV 4.34 GB" after it (NVIDIA/nccl#1685, 2025-04-16: up to 32 channels a pair of
# GPUs for the all-to-all's direct connections, so 7 peers there; a group of n ranks has n - 1).
# Ring collectives keep "a limited amount of memory as it only has 2 connections regardless of
# the scale" (NVIDIA/nccl#986): one figure a communicator, whatever its size.
NCCL_BYTES_PER_GROUP = 1.06e9
NCCL_ALL_TO_ALL_BYTES_PER_PEER = (4.34e9 - 1.06e9) / 7
# cuBLAS's workspace, allocated through the caching allocator per (handle, stream):
# aten/src/ATen/cuda/CublasHandlePool.cpp, `getChosenWorkspaceSize`: "32MiB for Hopper" (sm_90),
# else 4096 KiB x 2 + 16 KiB x 8 (8.125 MiB).
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 * 2**20, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}


@dataclass(frozen=True)
class CudaOverheads:
    """A GPU rank's bytes beyond its tensors: inside the caching allocator (`workspace`) and
    outside it (`context`, `nccl`)."""

    workspace: float = 0.0
    context: float = 0.0
    nccl: float = 0.0

    @property
    def in_allocator(self) -> float:
        return self.workspace

    @property
    def outside_allocator(self) -> float:
        return self.context + self.nccl

    @property
    def total(self) -> float:
        return self.in_allocator + self.outside_allocator

    def parts(self) -> dict[str, float]:
        return {"cublas_workspace": self.workspace, "cuda_context": self.context, "nccl_buffers": self.nccl}


def process_groups(plan: Plan) -> int:
    """The NCCL communicators a rank uses in a step: one for each parallel dimension with more
    than one rank (data, tensor, pipeline, context, expert), two for a hybrid FSDP (its shard and
    replicate groups)."""
    from paratune.model.shapes import replicas

    groups = 0
    dp = replicas(plan)
    if dp > 1:
        hybrid = plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.sharding == "hybrid"
        groups += 2 if hybrid else 1
    groups += sum(getattr(plan, d) > 1 for d in ("tp", "pp", "cp", "ep"))
    return groups


def cuda_overheads(plan: Plan, device: Device) -> CudaOverheads:
    """The named CUDA-only terms of one rank of the plan on the device; none for a CPU plan or the
    CPU entry (gloo has no NCCL, the host no CUDA context)."""
    if plan.device == "cpu" or device.gpu is None:
        return CudaOverheads()
    streams = 2 if getattr(plan, "async_tp", False) else 1  # async TP's matmuls run on a side stream too
    from paratune.costs.efficiency import ARCHITECTURE

    hopper = ARCHITECTURE.get(device.gpu) == "hopper"  # sm_90: the GPU models efficiency's table calls Hopper
    workspace = CUBLAS_WORKSPACE_BYTES["hopper" if hopper else "other"] * streams
    nccl = NCCL_BYTES_PER_GROUP * process_groups(plan) + NCCL_ALL_TO_ALL_BYTES_PER_PEER * (plan.ep - 1)
    return CudaOverheads(workspace, CUDA_CONTEXT_BYTES, nccl)
