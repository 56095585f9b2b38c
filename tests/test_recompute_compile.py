"""Selective / every-N-th-layer activation checkpointing and per-block torch.compile (issue 28).

The modes' mapping onto transformers' hook, the bytes selective checkpointing keeps (between none
and full, on one process), Dynamo's own behaviour the compile check relies on (a graph break, a
block skipped under a dispatch mode), and loss parity on 2 real gloo processes: every plan of
this module in ONE set of processes (the compiled ones last, one model shape for all, so the
first compiled plan of each layout compiles and the rest reuse Dynamo's and Inductor's caches).
"""

from __future__ import annotations

import functools

import pytest
import torch
from gloo_harness import batch_result, one_torch_thread, reference_for, run_named_batch  # noqa: F401 (fixture)
from conftest import BASE_PLAN
from tiers import cases, wanted
from torch import nn

from paratune.model.materialize import build_meta
from paratune.model.build import build_config, build_model
from paratune.parallel import compile as block_compile
from paratune.parallel import recompute
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import load_plan_dict

MODEL = {"model": "tiny-llama", "model_overrides": {"hidden_size": 64, "num_hidden_layers": 2}}


def _plan(**fields):
    return load_plan_dict({**BASE_PLAN, **MODEL, "seed": 7, **fields})


@pytest.mark.parametrize("mode, every, expected", [
    ("none", 2, [False] * 4), ("full", 2, [True] * 4), ("selective", 2, [True] * 4),
    ("layers", 2, [True, False, True, False]), ("layers", 3, [True, False, False, True]),
])
def test_modes_set_the_blocks_transformers_checkpoints(mode, every, expected):
    """layers + checkpoint_every N: blocks 0, N, 2N, ... recomputed whole (transformers'
    every_n_layers counts decoder blocks from 0); selective: every block, with a policy."""
    plan = _plan(activation_checkpointing=mode, **({"checkpoint_every": every} if mode == "layers" else {}),
                 model_overrides={"hidden_size": 64, "num_hidden_layers": 4})
    model = build_meta(build_config(plan.model, plan.model_overrides))
    recompute.apply_checkpointing(model, plan)
    assert recompute.checkpointed_blocks(model) == expected
    settings = recompute.checkpoint_settings(plan)
    assert settings is None if mode == "none" else settings == ({"layers": "full"}.get(mode, mode), every if
                                                                 mode == "layers" else 1)


def test_selective_policy_saves_matmuls_attention_and_under_tp_the_collectives():
    must, again = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE, torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    for tp in (False, True):
        policy = recompute.selective_policy(tp)
        assert policy(None, aten.mm.default) is must
        assert policy(None, aten._scaled_dot_product_flash_attention_for_cpu.default) is must
        assert policy(None, aten.silu.default) is again and policy(None, aten.mul.Tensor) is again
        assert policy(None, c10d.wait_tensor.default) is again  # no communication: free to recompute
        for collective in (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default,
                           c10d.all_gather_into_tensor.default):
            assert policy(None, collective) is (must if tp else again)


def _live_bytes_after_forward(mode: str) -> int:
    """Tensor bytes alive after one forward (what autograd and the checkpoints keep for the
    backward, plus the loss and logits), by MemTracker, above what existed before."""
    from torch.distributed._tools.mem_tracker import MemTracker

    plan = _plan(activation_checkpointing=mode)
    model = build_model(build_config(plan.model, plan.model_overrides), seed=0)
    model.train()
    recompute.apply_checkpointing(model, plan)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("current").values())
        loss = model(input_ids=ids, labels=ids).loss
        after = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("current").values())
        loss.backward()
    return after - before


def test_selective_keeps_fewer_bytes_than_none_and_more_than_full():
    """So the policy can be caught saving everything (= none) or nothing (= full); torchtitan's op
    policy (selective_op: every second matmul recomputed) between selective and full."""
    kept = {mode: _live_bytes_after_forward(mode) for mode in ("none", "selective", "selective_op", "full")}
    assert kept["none"] > kept["selective"] > kept["selective_op"] > kept["full"] > 0, kept


class _Block(nn.Module):
    def __init__(self, graph_break: bool = False):
        super().__init__()
        self.linear, self.graph_break = nn.Linear(8, 8), graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x).relu()
        if self.graph_break:
            torch._dynamo.graph_break()
        return x * 2


def _watched(block: nn.Module) -> block_compile.CompileWatch:
    torch._dynamo.reset()
    block.compile(backend="eager")  # Dynamo's capture is what is checked; no Inductor needed
    return block_compile.CompileWatch(1, block_compile.block_codes([block]))


def test_compile_watch_accepts_one_graph_and_refuses_a_graph_break():
    block = _Block()
    watch = _watched(block)
    block(torch.randn(2, 8))
    assert watch.warmed_up() == 1
    block(torch.randn(2, 8))
    watch.measured()  # same shapes: nothing compiled
    block(torch.randn(3, 4, 8))  # a new rank of input: a recompile inside the "measured" steps
    with pytest.raises(block_compile.CompileFallback, match="measured steps compiled"):
        watch.measured()
    broken = _Block(graph_break=True)
    watch = _watched(broken)
    broken(torch.randn(2, 8))
    with pytest.raises(block_compile.CompileFallback, match="graph break"):
        watch.warmed_up()


def test_compile_under_tp_copies_the_embeddings_async_output_once():
    """tp's embedding hands out an AsyncCollectiveTensor (parallel.compile's note): compile_blocks
    hooks a copy after it, once however often it is called; tp 1 leaves the embedding alone."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    model = build_meta(build_config(MODEL["model"], MODEL["model_overrides"]))
    embedding = model.get_input_embeddings()
    block_compile.compile_blocks(model, _plan(compile=True))
    assert not embedding._forward_hooks
    for _ in range(2):
        block_compile.compile_blocks(model, _plan(compile=True, tp=2))
    from paratune.parallel.tp import _owned_output

    assert list(embedding._forward_hooks.values()) == [_owned_output]
    waiting = AsyncCollectiveTensor(torch.ones(2, 3))
    plain = _owned_output(embedding, (), waiting)
    assert type(plain) is torch.Tensor and torch.equal(plain, torch.ones(2, 3))
    # a view (eager tp's _ToTorchTensor output) is copied too: CTRL scales its embeddings in place
    base = torch.ones(2, 3, requires_grad=True) * 1.0
    view = base.view(3, 2)
    owned = _owned_output(embedding, (), view)
    assert not owned._is_view() and torch.equal(owned, view)
    owned *= 2.0  # in place, as CTRL does: allowed on the copy
    plain_tensor = torch.ones(2)
    assert _owned_output(embedding, (), plain_tensor) is plain_tensor
    torch._dynamo.reset()


def test_async_tp_refused_off_cuda_and_sets_inductors_pass_and_symmetric_memory(tmp_path):
    """async_tp on a CPU device: refused with levers' reason. What it sets (the same function a
    CUDA run calls after the device check), read back on a one-process gloo group: symmetric
    memory for the tp group, and Inductor's micro-pipeline pass in the blocks' own compile
    options, never in Inductor's global config (which a reused worker group's next plan would
    inherit). Dynamo keys cached graphs by those options: an async and a plain plan's compiles
    are different backends, so neither reuses the other's graph."""
    import torch._inductor.config
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm

    from paratune.levers import ASYNC_TP_CPU_REASON

    # The plan itself refuses async_tp on CPU (paratune.levers); the runtime check stands behind it.
    plan = _plan(compile=True, tp=2, sequence_parallel=True).model_copy(update={"async_tp": True})
    with pytest.raises(ValueError, match=f"async_tp: true on device 'cpu': {ASYNC_TP_CPU_REASON[:30]}"):
        block_compile.enable_async_tp(plan, torch.device("cpu"), "0")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group_name = dist.group.WORLD.group_name
        block_compile.set_async_tp(group_name)
        assert symm.is_symm_mem_enabled_for_group(group_name)
    finally:
        symm._group_name_to_store.pop(group_name, None)
        dist.destroy_process_group()
    assert torch._inductor.config._micro_pipeline_tp is False  # nothing global
    fused, plain = block_compile.compile_options(plan), block_compile.compile_options(_plan(compile=True))
    assert fused == {"dynamic": False, "options": {"_micro_pipeline_tp": True}} and plain == {"dynamic": False}
    backends = [torch._TorchCompileInductorWrapper("default", kw.get("options"), kw["dynamic"]) for kw in (fused, plain)]
    assert backends[0].config["_micro_pipeline_tp"] is True and backends[0] != backends[1]


def test_an_async_tp_plans_workers_serve_it_alone():
    """torch's symmetric-memory registry outlives a process group and refuses a group name twice
    (names restart at 0 in every fresh group): an async-TP plan gets a worker group of its own key,
    retired after its one plan; other keys keep being reused."""
    from types import SimpleNamespace

    from paratune.cluster.launch import WorkerDemand
    from paratune.cluster.pool import SessionPool
    from paratune.cluster.session import GroupKey

    cuda = {"device": "cuda", "num_workers": 2, "gpus_per_node": 2}
    async_plan = _plan(compile=True, tp=2, sequence_parallel=True, async_tp=True, **cuda)
    plain = _plan(compile=True, tp=2, sequence_parallel=True, **cuda)
    keys = [GroupKey.for_workers(WorkerDemand.for_plan(p, use_gpu=True)) for p in (async_plan, plain)]
    assert keys[0].single_use and not keys[1].single_use and keys[0] != keys[1]
    assert keys[0].workers.single_use  # through the group's own demand too
    pool = SessionPool(max_groups=1)
    served = lambda key, n: SimpleNamespace(key=key, requests_served=n)  # noqa: E731
    assert pool._retired(served(keys[0], 1)) and not pool._retired(served(keys[0], 0))
    assert not pool._retired(served(keys[1], 5))


def test_a_block_first_called_under_a_dispatch_mode_is_caught_and_reset():
    """Dynamo skips a frame under a TorchDispatchMode and marks its code SKIP for the process:
    the watch sees no graph, and the next compile_blocks clears the mark."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    block = _Block()
    watch = _watched(block)
    with Passthrough():
        block(torch.randn(2, 8))
    block(torch.randn(2, 8))  # SKIP-marked: eager again, silently
    with pytest.raises(block_compile.CompileFallback, match="no graph"):
        watch.warmed_up()
    assert block_compile._skipped(block_compile.block_codes([block]))
    block_compile.make_room_for_graphs([block])
    assert not block_compile._skipped(block_compile.block_codes([block]))
    torch._dynamo.reset()


# 2 gloo processes, fp32: every mode against the single-process reference WITHOUT checkpointing
# or compile (the probe saw bitwise-equal losses for checkpointing, ~1e-6 for compile).
LAYOUTS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
           "tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2},
           "zero2": {"strategy": "zero", "zero": {"stage": 2}}}
# selective under every layout; layers (the same transformers hook with every_n_layers) where the
# blocks are called differently: whole model (ddp) and pipeline stages (pp2).
CHECKPOINTED = {f"{layout}-{mode}": {**LAYOUTS[layout], "activation_checkpointing": mode}
                for layout in ("ddp", "fsdp", "tp2", "pp2", "zero2") for mode in ("selective", "layers")
                if mode == "selective" or layout in ("ddp", "pp2")}
CHECKPOINTED["tp2-sp-selective"] = {**LAYOUTS["tp2-sp"], "activation_checkpointing": "selective"}  # SP's collectives
# Compiled last: the first of each layout compiles its block graph, "ddp-compiled-again" (a second
# plan of the same shapes in the same processes) must find it in the cache.
# tp and tp + sequence parallelism: tp's embedding output is copied before the first block
# (parallel.compile.resolve_async_embedding); without it the first backward fails.
COMPILED = {f"{layout}-compiled": {**LAYOUTS[layout], "compile": True}
            for layout in ("ddp", "fsdp", "pp2", "zero2", "tp2-sp")}  # tp2-sp: tp's embedding hook, and SP's
COMPILED["ddp-compiled-again"] = COMPILED["ddp-compiled"]
CHECKPOINT_TOLERANCE, COMPILE_TOLERANCE = 1e-5, 1e-4
# `matrix` (make test-matrix; tests/tiers.py): checkpointing and compile are applied to the blocks before
# the strategy wraps them; these layouts add no path of their own, the kept cases named run it.
MATRIX = {
    "zero2-selective": "ddp-selective (the policy on whole-model blocks) and test_parity_gloo zero-2-checkpointing",
    "tp2-selective": "tp2-sp-selective (the policy with tp's collectives, and SP's)",
    "pp2-selective": "pp2-layers (checkpointing inside pipeline stages) and ddp-selective (the policy)",
    "zero2-compiled": "ddp-compiled (compile_blocks before the wrapper) and test_parity_gloo's zero-2 cases",
    "pp2-compiled": "ddp-compiled (compile_blocks), fsdp-compiled (a wrapper around compiled blocks) and pp2-layers (stages)",
}


@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    return run_named_batch({name: _plan(**fields) for name, fields in {**CHECKPOINTED, **COMPILED}.items()
                            if wanted(name, MATRIX)})


def _eager_reference(plan) -> list[float]:
    return reference_for(load_plan_dict({**plan.to_dict(), "activation_checkpointing": "none", "compile": False}))


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(CHECKPOINTED, MATRIX))
def test_checkpointing_trains_like_no_checkpointing(name):
    plan, out = batch_result(_runs()[name])
    assert max_loss_difference(out["losses"], _eager_reference(plan)) < CHECKPOINT_TOLERANCE
    assert out["compile_s"] is None and out["compile_graphs"] is None


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(COMPILED, MATRIX))
def test_compiled_blocks_train_like_eager_with_compile_time_apart(name):
    plan, out = batch_result(_runs()[name])
    assert max_loss_difference(out["losses"], _eager_reference(plan)) < COMPILE_TOLERANCE
    # The warm-up compiled one graph for the one block class, or found it in the cache (0): the
    # first compiled plan of these processes compiles, the same plan again must not.
    expected = {"ddp-compiled": {1}, "ddp-compiled-again": {0}}.get(name, {0, 1})
    assert out["compile_graphs"] in expected, out["compile_graphs"]
    assert out["compile_s"] is not None and out["compile_s"] >= 0
    assert len(out["step_times_s"]) == plan.measure_steps  # the compiling step is not among them
    assert set(out["linear_matmul_dtypes"]) == {"float32"}  # recorded in the extra eager step


@pytest.mark.parametrize("site", ["dev", "gpu-image"])
def test_the_checkpoint_sits_inside_forward_and_inside_the_compiled_graph_on_both_transformers(site):
    """transformers 5.17 (the GPU image's) checkpoints a block's `__call__`, 5.23 its `forward`;
    paratune checkpoints the forward itself on both: a block's module hooks (FSDP2's unshard) run
    once per forward + backward while the block is recomputed, and a compiled selective block
    holds the checkpoint in its Dynamo graph (seen with transformers' own hook on 5.17: hooks
    twice, no checkpoint in the graph)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    if site == "gpu-image":
        image = Path(sys.prefix) / "gpu-image-site"
        assert (image / "transformers").is_dir(), f"{image} is missing: run `make install`"
        env["PYTHONPATH"] = f"{root / 'tests' / 'image_shaped'}:{image}"
    proc = subprocess.run([sys.executable, str(root / "tests" / "checkpoint_placement.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["transformers"].startswith("5.17" if site == "gpu-image" else "5.2"), seen
    assert (seen["hook_calls"], seen["mlp_calls"], seen["graph_has_checkpoint"]) == (1, 2, True), seen


def test_compiled_blocks_stay_static_when_a_later_plan_changes_shapes():
    """Dynamo's automatic-dynamic state lives per code object, and every block class of every plan
    in a worker group runs the same forward: by default a second plan with another micro-batch
    recompiles with that dimension dynamic (slower kernels). The blocks compile with
    dynamic=False (parallel.compile.compile_options): each shape gets a static graph of its own."""

    def graphs_for(kwargs: dict) -> list[bool]:
        seen: list[bool] = []

        def capture(gm, example_inputs):  # noqa: ANN001 - Dynamo's backend signature
            seen.append(any(isinstance(d, torch.SymInt) for x in example_inputs if isinstance(x, torch.Tensor)
                            for d in x.shape) or any(isinstance(x, torch.SymInt) for x in example_inputs))
            return gm.forward

        torch._dynamo.reset()
        block = _Block()
        block.compile(backend=capture, **kwargs)
        for batch in (2, 4, 6):  # three plans' micro-batches
            block(torch.randn(batch, 8))
        return seen

    assert graphs_for({k: v for k, v in block_compile.compile_options(_plan(compile=True)).items()
                       if k != "options"}) == [False, False, False]
    assert True in graphs_for({})  # what the default did: the second shape compiled dynamic
    torch._dynamo.reset()
