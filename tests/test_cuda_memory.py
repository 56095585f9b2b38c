"""A GPU rank's bytes beyond its tensors (issue 55): the CUDA context, NCCL's buffers per
communicator and all-to-all peer, cuBLAS's workspace per architecture, counted against the
capacity and named in the reason; none on the CPU entry (gloo)."""

import pytest

from paratune.config.devices import get_device
from paratune.config.plan import load_plan_dict
from paratune.costs.cuda_memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    NCCL_ALL_TO_ALL_BYTES_PER_PEER,
    NCCL_BYTES_PER_GROUP,
    cuda_overheads,
    process_groups,
)
from paratune.costs.estimate import estimate
from paratune.model.shapes import GiB

H100, A100, CPU = get_device("h100-80gb"), get_device("a100-80gb"), get_device("cpu")


def _plan(**changes):
    base = {"model": "llama3-8b", "num_workers": 8, "global_batch": 16, "micro_batch": 2, "seq_len": 8192,
            "strategy": "fsdp", "fsdp": {"sharding": "full"}, "precision": "bf16", "device": "cuda", "gpus_per_node": 8}
    return load_plan_dict({**base, **changes}, source="test")


def test_one_communicator_per_parallel_dimension_and_two_for_hybrid():
    assert process_groups(_plan()) == 1
    assert process_groups(_plan(num_workers=1, global_batch=2)) == 0
    assert process_groups(_plan(tp=2, global_batch=8)) == 2
    assert process_groups(_plan(num_workers=16, global_batch=32, gpus_per_node=8,
                                fsdp={"sharding": "hybrid"})) == 2


def test_the_terms_by_device_and_layout():
    fsdp = cuda_overheads(_plan(), H100)
    assert fsdp.context == CUDA_CONTEXT_BYTES and fsdp.nccl == NCCL_BYTES_PER_GROUP
    assert fsdp.workspace == CUBLAS_WORKSPACE_BYTES["hopper"] == 32 * 2**20
    assert cuda_overheads(_plan(), A100).workspace == CUBLAS_WORKSPACE_BYTES["other"] < fsdp.workspace
    # async TP's matmuls on a side stream: a second workspace
    assert cuda_overheads(_plan(tp=2, global_batch=8, sequence_parallel=True, async_tp=True, compile=True),
                          H100).workspace == 2 * CUBLAS_WORKSPACE_BYTES["hopper"]
    # CPU plans (gloo, no CUDA) hold none of them
    cpu = load_plan_dict({"model": "tiny-llama", "num_workers": 2, "global_batch": 4, "micro_batch": 2,
                          "seq_len": 64, "device": "cpu"}, source="test")
    assert cuda_overheads(cpu, CPU).total == 0.0


def test_an_all_to_all_adds_buffers_per_peer():
    moe = {"model": "qwen3-30b-a3b", "seq_len": 4096, "global_batch": 64, "micro_batch": 1}
    ep2, ep8 = cuda_overheads(_plan(**moe, ep=2), H100), cuda_overheads(_plan(**moe, ep=8), H100)
    assert ep8.nccl - ep2.nccl == pytest.approx(6 * NCCL_ALL_TO_ALL_BYTES_PER_PEER)
    assert ep8.nccl > 4e9  # nccl#1685's 4.34 GB on 8 H100s with one ring communicator beside it


def test_the_capacity_left_to_the_tensors_and_the_reason():
    plan = _plan(micro_batch=1, activation_checkpointing="full")
    e = estimate(plan, H100, activation_model="formula")
    assert e.device_bytes < H100.memory_bytes
    assert e.device_bytes == pytest.approx(e.memory.total + e.cuda.total)
    assert e.reserved_bytes == pytest.approx(e.memory.total + e.cuda.workspace)
    # a budget between the tensors' peak and the peak with the CUDA terms: over, and the reason says why
    budget = (e.memory.total + e.cuda.total / 2) / GiB
    squeezed = estimate(plan, H100, capacity_gib=budget, activation_model="formula")
    assert not squeezed.fits and "CUDA context, NCCL buffers and cuBLAS workspace" in squeezed.overflow
    assert estimate(plan, H100, capacity_gib=budget + e.cuda.total / GiB, activation_model="formula").fits
    summary = e.summary()
    assert summary["predicted_device_memory_gib"] == pytest.approx(e.device_bytes / GiB)
    assert summary["predicted_nccl_buffers_gib"] == pytest.approx(NCCL_BYTES_PER_GROUP / GiB)
