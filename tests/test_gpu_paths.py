"""GPU-only decisions, proved on CPU: the process-group backend a plan needs, and the CPUs a GPU
worker reserves (Ray turns them into OMP_NUM_THREADS, which offload's CPU Adam runs on)."""

import pytest
import torch

from paratune.plan import load_plan_dict
from paratune.trial import gpu_node_cpus_per_gpu, needs_cpu_collectives, process_group_backend, worker_resources

BASE = {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2}


@pytest.mark.parametrize("plan, on_gpu, backend", [
    ({"strategy": "ddp"}, True, "nccl"),
    ({"strategy": "fsdp"}, True, "nccl"),
    ({"strategy": "fsdp", "fsdp": {"cpu_offload": True}}, True, "cpu:gloo,cuda:nccl"),
    ({"strategy": "zero", "zero": {"stage": 3, "offload_optimizer": True, "offload_param": True}}, True, "nccl"),
    ({"strategy": "fsdp", "fsdp": {"cpu_offload": True}}, False, "gloo"),
    ({"strategy": "ddp"}, False, "gloo"),
])
def test_backend_choice(plan, on_gpu, backend):
    assert process_group_backend(load_plan_dict({**BASE, **plan}), on_gpu) == backend


def test_a_mixed_backend_string_reduces_host_tensors():
    """torch accepts the per-device backend string Ray passes through, and its CPU half reduces
    host tensors (what clipping does under FSDP2 CPU offload)."""
    import torch.distributed as dist

    from gloo_harness import _free_port

    dist.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert "gloo" in str(dist.get_backend())
    finally:
        dist.destroy_process_group()
    assert needs_cpu_collectives(load_plan_dict({**BASE, "strategy": "fsdp", "fsdp": {"cpu_offload": True}}))


# ray.nodes() as Ray 2.60 returns it (the fields read here).
NODES = [
    {"Alive": True, "Resources": {"CPU": 8.0, "memory": 3e10}},  # the head: no GPU
    {"Alive": True, "Resources": {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
    {"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
    {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}},  # a dead node counts for nothing
]


def test_gpu_workers_reserve_their_share_of_the_node():
    plan = load_plan_dict({**BASE, "strategy": "zero", "zero": {"stage": 2, "offload_optimizer": True}})
    assert gpu_node_cpus_per_gpu(NODES) == 12.0  # the smallest GPU node: 96 CPUs / 8 GPUs
    assert worker_resources(plan, True, NODES) == {"GPU": 1, "CPU": 12}
    assert worker_resources(plan.with_changes(cpus_per_worker=4), True, NODES) == {"GPU": 1, "CPU": 4}
    assert worker_resources(plan, True, []) == {"GPU": 1, "CPU": 1}  # no GPU node visible yet
    assert worker_resources(plan, False, None) == {"CPU": 1}


def test_deepspeed_optimizer_only_with_zero():
    from paratune.plan import PlanError

    with pytest.raises(PlanError, match="optimizer: 'deepspeed' needs strategy 'zero'"):
        load_plan_dict({**BASE, "strategy": "fsdp", "optimizer": "deepspeed"})


def test_offload_host_only_where_fsdp_was_applied():
    """FSDP2 CPU offload keeps shards on the host only where FSDP2 wraps the model (dp > 1); a
    tp/pp plan at dp 1 gets no FSDP2, so its model must be materialized on the device."""
    from paratune.parallel.dims import ParallelDims
    from paratune.parallel.nd import DataParallelLayout, _materialize_device

    cuda = torch.device("cuda", 0)

    def device_of(plan):
        return _materialize_device(cuda, DataParallelLayout.for_plan(plan, ParallelDims.from_plan(plan, "cuda")))

    tp_only = load_plan_dict({**BASE, "strategy": "fsdp", "tp": 2, "fsdp": {"cpu_offload": True}})
    assert tp_only.dp_degree == 1 and device_of(tp_only) == cuda
    dp2_tp2 = tp_only.with_changes(num_workers=4)
    assert dp2_tp2.dp_degree == 2 and device_of(dp2_tp2) == torch.device("cpu")
    assert device_of(dp2_tp2.with_changes(fsdp={"cpu_offload": False})) == cuda


def test_gpu_workers_raise_on_nccl_timeouts_unless_the_plan_says_otherwise():
    """Ray Train would set TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (the watchdog kills the process: a
    timeout then reads as worker_died); GPU workers get 2, and a plan's own setting wins."""
    from paratune.trial import worker_env

    plan = load_plan_dict(BASE)
    assert worker_env(plan, True) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert worker_env(plan, False) == {}
    own = plan.with_changes(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ALGO": "Ring"})
    assert worker_env(own, True) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ALGO": "Ring"}
