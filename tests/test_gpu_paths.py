"""GPU-only decisions, proved on CPU: the process-group backend a plan needs, and the CPUs a GPU
worker reserves (Ray turns them into OMP_NUM_THREADS, which offload's CPU Adam runs on)."""

import pytest
import torch

from paratune.config.plan import load_plan_dict
from paratune.cluster.launch import (
    gpu_node_cpus_per_gpu,
    needs_cpu_collectives,
    process_group_backend,
    worker_resources,
)

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


def test_one_worker_demand_carries_the_gpu_share_and_the_nccl_env_to_every_launch():
    """launch.WorkerDemand is what trials, reused groups, profiles and training all launch with:
    on GPUs each worker's share of the node, the NCCL error handling that keeps a timed-out
    collective a comm_timeout (not a dead worker), the plan's own env winning; none of it on CPU."""
    from paratune.cluster.launch import GPU_WORKER_ENV, WorkerDemand

    plan = load_plan_dict({**BASE, "gpus_per_node": 8, "env": {"NCCL_ALGO": "Ring"}})
    gpu = WorkerDemand.for_plan(plan, True, NODES)
    assert gpu.per_worker == {"GPU": 1, "CPU": 12} and gpu.demand.per_worker == gpu.per_worker
    assert gpu.env == {**GPU_WORKER_ENV, "NCCL_ALGO": "Ring"} and gpu.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert gpu.demand.slots_per_node == 8 and gpu.workers == plan.num_workers
    own = WorkerDemand.for_plan(plan.with_changes(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}), True, NODES)
    assert own.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # set by the plan: the plan's
    cpu = WorkerDemand.for_plan(plan, False)
    assert cpu.per_worker == {"CPU": 1} and cpu.env == {"NCCL_ALGO": "Ring"}


def test_deepspeed_optimizer_only_with_zero():
    from paratune.config.plan import PlanError

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
    from paratune.cluster.launch import worker_env

    plan = load_plan_dict(BASE)
    assert worker_env(plan, True) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert worker_env(plan, False) == {}
    own = plan.with_changes(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ALGO": "Ring"})
    assert worker_env(own, True) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ALGO": "Ring"}


# --------------------------------------------------------------------------- what a reused group frees
def _record_cuda_release(monkeypatch) -> list[str]:
    """The CUDA calls a release makes, recorded in order (this build has no CUDA to call)."""
    calls: list[str] = []
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "reset_peak_host_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    for name in ("_cuda_clearCublasWorkspaces", "_host_emptyCache"):
        monkeypatch.setattr(torch._C, name, lambda _n=name: calls.append(_n), raising=False)
    return calls


def test_release_gives_back_the_pinned_host_cache(monkeypatch):
    """FSDP2 / ZeRO offload copy through pinned host buffers, which torch's CachingHostAllocator
    keeps when freed: between two plans of a reused worker group the release empties it too, after
    the device cache, and the session's release goes through it."""
    from paratune.cluster import session
    from paratune.trial.worker import release_cached_memory

    calls = _record_cuda_release(monkeypatch)
    release_cached_memory(torch.device("cuda", 0))
    assert "_host_emptyCache" in calls and calls.index("empty_cache") < calls.index("_host_emptyCache")
    assert calls[0] == "synchronize" and "reset_peak_host_memory_stats" in calls
    calls.clear()
    session._release_memory(torch.device("cuda", 0))  # what _serve runs after every request
    assert "_host_emptyCache" in calls
    calls.clear()
    release_cached_memory(torch.device("cpu"))
    assert calls == []


def test_release_falls_back_to_the_device_generic_host_cache(monkeypatch):
    """A torch without the CUDA binding's name uses torch.accelerator's public form."""
    from paratune.trial.worker import release_cached_memory

    calls = _record_cuda_release(monkeypatch)
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    monkeypatch.setattr(torch.accelerator.memory, "empty_host_cache", lambda: calls.append("empty_host_cache"),
                        raising=False)  # torch 2.11 has no such function
    release_cached_memory(torch.device("cuda", 0))
    assert "empty_host_cache" in calls


# --------------------------------------------------------------------------- which GPU DeepSpeed takes
def test_deepspeed_takes_the_gpu_ray_assigned_on_a_16_gpu_node(monkeypatch):
    """On a 16-GPU node Ray Train numbers local ranks by GPU id as integers but lists
    CUDA_VISIBLE_DEVICES sorted as strings, and gives each worker the device at its id's place in
    that list: the worker of GPU 2 has local rank 2 and device cuda:8. DeepSpeed reads LOCAL_RANK
    for its device; aligned, it takes cuda:8 (Ray's own code computes both sides here)."""
    import os

    import ray
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from ray.air._internal.device_manager.nvidia_gpu import CUDATorchDeviceManager
    from ray.train.v2._internal.callbacks.accelerators import _get_visible_accelerator_ids_per_worker
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata

    from paratune.parallel.zero import align_local_rank_with_device

    workers = [ActorMetadata(hostname="n", node_id="n", node_ip="10.0.0.1", pid=i, accelerator_ids={"GPU": [str(i)]})
               for i in range(16)]
    visible = _get_visible_accelerator_ids_per_worker(workers, "GPU")[2]
    assert visible.split(",")[:5] == ["0", "1", "10", "11", "12"]
    local_rank = sorted(range(16)).index(2)  # Ray's worker order: lowest GPU id as an integer
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["2"])
    (device,) = CUDATorchDeviceManager().get_devices()  # what ray.train.torch.get_device() returns
    assert (local_rank, device) == (2, torch.device("cuda", 8))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert CUDA_Accelerator().device_name(os.environ["LOCAL_RANK"]) != str(device)  # the defect
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    align_local_rank_with_device(device)
    assert CUDA_Accelerator().device_name(os.environ["LOCAL_RANK"]) == "cuda:8" and chosen == [device]
    align_local_rank_with_device(torch.device("cpu"))  # CPU workers: nothing to align
    assert os.environ["LOCAL_RANK"] == "8"


def test_a_user_loops_steps_are_timed_between_two_device_syncs(monkeypatch):
    """CUDA runs asynchronously: a user loop's step is timed only if the clock is read after the
    device has finished the step's work. On a CUDA device each `user_loop.steps()` body sits between
    two `torch.cuda.synchronize` calls (paratune.config.devices.sync_device, the trial's own); on CPU none.
    The allocator's peak counter is reset as the first measured step starts (after warm-up, as the
    trial's) and read as the last one ends, before whatever the loop does after it."""
    from paratune.trial import user_loop

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync:{device}"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: events.append("read") or 7)
    plan = load_plan_dict({**BASE, "warmup_steps": 1, "measure_steps": 2})
    for device, expect_syncs in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        events.clear()
        session = user_loop._Session(plan, 0, 1, device, None)
        monkeypatch.setattr(user_loop, "_SESSION", session)
        for step in user_loop.steps():
            events.append(f"step:{step}")
        events.append("after the loop")
        steps = [f"step:{i}" for i in range(plan.total_steps)]
        if expect_syncs:
            synced = [e for s in steps for e in ("sync:cuda:0", s, "sync:cuda:0")]
            assert events == synced[:3] + ["reset"] + synced[3:] + ["read", "after the loop"], events
            assert session.window.bytes == 7 and session.window.steps == [1, 2]
        else:
            assert events == steps + ["after the loop"], events


@pytest.fixture
def gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_model_parallel_clipping_reduces_once_per_group_set_and_never_syncs(gloo_world_of_one, monkeypatch):
    """tp/pp/cp/ep plans clip with paratune's own global norm (torch's cannot mix meshes). It must
    not cost what DDP/FSDP plans do not pay: one all-reduce per distinct set of groups the
    gradients span (here: the tp mesh's, DDP's tp shards', the experts' ep group, the pp
    stages'), however many parameters, and no host sync (no `item()`/`float()` of a device
    tensor: a dispatch mode sees every op). The norm and the clipped gradients are torch's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratune.parallel.tp import clip_grad_norm

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    params = []
    for i in range(6):  # DTensor weights (sharded and replicated), plain, DDP's tp shards, experts
        value, grad = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen) * 10
        if i < 2:
            placement = [Shard(0)] if i == 0 else [Replicate()]
            p = torch.nn.Parameter(distribute_tensor(value, mesh, placement))
            p.grad = distribute_tensor(grad, mesh, placement)
        else:
            p = torch.nn.Parameter(value)
            p.grad = grad.clone()
            if i == 3:
                p._st_info = object()
            if i >= 4:
                p._paratune_expert = True
        params.append(p)
    plain = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in params]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in plain]))
    reduces: list = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: reduces.append(kw.get("group")) or real(t, *a, **kw))

    class HostSyncs(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    groups = {name: dist.new_group([0]) for name in ("tp", "ep", "pp")}
    with HostSyncs():
        total = clip_grad_norm(params, 1.0, pp_group=groups["pp"], tp_group=groups["tp"], ep_group=groups["ep"])
    assert HostSyncs.seen == []
    # Sharded DTensor (its mesh), DDP's tp shards (tp), experts (ep): 3 sets; replicated and plain need
    # none; then the pp stages' sum.
    assert len(reduces) == 4 and reduces[-1] is groups["pp"], reduces
    assert torch.allclose(total, expected)
    coef = 1.0 / (float(expected) + 1e-6)
    for p, g in zip(params, plain):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(got, g * coef, atol=1e-6)


def test_every_process_group_is_connected_before_the_first_step(gloo_world_of_one, monkeypatch):
    """NCCL creates a group's communicator at its first collective, and cuBLAS its handle at the
    first matmul: both would land in a compiled plan's first step and be counted as compile time
    (gloo connects eagerly, so a CPU trial never shows it). The warm-up runs one collective on
    every group the rank belongs to, in the order they were made (the same on every rank: NCCL's
    communicator set-up is a collective of its own), and one matmul."""
    import torch.distributed as dist

    from paratune.config.devices import warm_up_process_groups

    made = [dist.new_group([0]) for _ in range(3)]
    seen: list = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: seen.append(kw.get("group")) or real(t, *a, **kw))
    assert warm_up_process_groups(torch.device("cpu")) == 4
    assert seen[1:] == made and seen[0] in (None, dist.group.WORLD)
