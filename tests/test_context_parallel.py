"""Context parallelism (paratune.parallel.cp): the rules, the CPU guard, and parity on gloo.

torch 2.13 rings only CUDA's SDPA kernels, so the gloo runs install the test-only shim
tests/cp_cpu_shim.py in every worker: torch's own ring attention then runs with the CPU kernel,
and paratune's recipe around it (sequence buffers, shifted labels, positions, mask, loss and
gradient scaling) is proven exact against the single-process reference. Loss parity alone
cannot see a gradient off by a constant factor (AdamW's update and clipping are scale-free),
so the first step's gradients are compared too, element by element.
"""

import functools

import numpy as np
import pytest
from conftest import BASE_PLAN, expected_parameter_share
from gloo_harness import one_torch_thread  # noqa: F401 (fixture: in-process references on one thread)
from tiers import cases, wanted
from gloo_harness import assert_groups_use_plan_timeout, batch_result, run_named_batch, single_torch_thread, training_key

from paratune.config.degrees import CP_CPU_REASON
from paratune.config.plan import load_plan_dict
from paratune.sweep.parity import max_loss_difference, reference_losses

SHIM = "cp_cpu_shim:install"
MEASURE = "test_context_parallel:measure_with_gradients"

# seq_len 32 (BASE_PLAN): every rank holds a head and a tail chunk of every sequence.
CASES = {
    "cp2-ddp": {"num_workers": 2, "cp": 2},
    "cp2-fsdp-full": {"num_workers": 2, "cp": 2, "strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "cp2-fsdp-no-shard": {"num_workers": 2, "cp": 2, "strategy": "fsdp", "fsdp": {"sharding": "no_shard"}},
    "cp2-ddp-checkpointing": {"num_workers": 2, "cp": 2, "activation_checkpointing": "full"},
    "cp2-fsdp-grad-op-offload": {"num_workers": 2, "cp": 2, "strategy": "fsdp",
                                 "fsdp": {"sharding": "grad_op", "cpu_offload": True}},
    "dp2xcp2-fsdp-full": {"num_workers": 4, "cp": 2, "strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "dp2xcp2-ddp": {"num_workers": 4, "cp": 2},
    "cp4-ddp": {"num_workers": 4, "cp": 4},
    "cp2xtp2-ddp": {"num_workers": 4, "cp": 2, "tp": 2, "grad_clip": 0.05},  # clipping active
    "cp2xtp2-fsdp-sequence-parallel": {"num_workers": 4, "cp": 2, "tp": 2, "sequence_parallel": True,
                                       "strategy": "fsdp", "fsdp": {"sharding": "full"}},
    # Per-head q/k norms (their gradients summed over tp) and tied embeddings.
    "cp2xtp2-fsdp-qwen3": {"num_workers": 4, "cp": 2, "tp": 2, "model": "tiny-qwen3", "strategy": "fsdp"},
}
# `matrix` (make test-matrix; tests/tiers.py): another degree or wrapper option on a path kept cases run.
MATRIX = {
    "cp2-fsdp-no-shard": "cp2-fsdp-full (the ring under FSDP2) and test_parity_gloo dp2xtp2-no-shard",
    "cp4-ddp": "cp2-ddp (the same ring, head and tail chunks of 4 ranks instead of 2)",
    "dp2xcp2-ddp": "dp2xcp2-fsdp-full (dp x cp mesh, gradients over dp x cp) and cp2-ddp",
}
BF16 = {
    "cp2-ddp-bf16": {"num_workers": 2, "cp": 2, "precision": "bf16"},  # autocast around the ring
    "cp2-fsdp-bf16": {"num_workers": 2, "cp": 2, "precision": "bf16", "strategy": "fsdp"},  # FSDP2 mixed precision
}


def _plan(case: dict):
    return load_plan_dict({**BASE_PLAN, **case})


# --------------------------------------------------------------------------- rules and guard
@pytest.mark.parametrize("case, fragment", [
    ({"cp": 4, "num_workers": 4, "seq_len": 36}, "divisible by 2 x cp = 8"),
    ({"cp": 2, "device": "cpu"}, CP_CPU_REASON),
    ({"cp": 2, "strategy": "zero"}, "DeepSpeed's engine has no context-parallel group"),
    ({"cp": 2, "pp": 2, "num_workers": 4}, "together with pp 2"),
    ({"cp": 2, "num_workers": 8, "global_batch": 8, "strategy": "fsdp",
      "fsdp": {"sharding": "hybrid", "shard_group_size": 2}}, "'hybrid'"),
    ({"cp": 2, "tp": 4, "num_workers": 8, "sequence_parallel": True, "seq_len": 36}, "divisible by cp x tp = 8"),
    ({"cp": 2, "device": "cuda"}, "fp32 GQA on SDPA's math kernel"),
])
def test_cp_rules_refuse(case, fragment):
    with pytest.raises(ValueError) as err:
        _plan(case)
    assert fragment in str(err.value)


@pytest.mark.parametrize("case", [
    {"cp": 2, "device": "cuda", "precision": "bf16"},  # GQA on flash
    {"cp": 2, "device": "cuda", "model_overrides": {"num_key_value_heads": 4}},  # fp32 MHA: efficient kernel
    {"cp": 2, "tp": 2, "num_workers": 4, "sequence_parallel": True},
])
def test_cp_rules_allow(case):
    assert _plan(case).dp_degree == case.get("num_workers", 2) // (case["cp"] * case.get("tp", 1))


@pytest.mark.parametrize("case, fragment", [
    ({"model": "tiny-gemma2"}, "attention 'eager'"),  # SDPA cannot soft-cap: the ring would not run
    # A window longer than a rank's shard but shorter than the sequence: transformers builds no
    # mask on the shard and the ring attends causally over everything (measured: loss off by 1.6e-2).
    ({"model": "tiny-mistral", "model_overrides": {"sliding_window": 24}}, "sliding_window 24 < seq_len 32"),
])
def test_preflight_refuses_attention_the_ring_cannot_compute(case, fragment):
    from paratune.checks.preflight import check_plan_against_model
    from paratune.config.plan import PlanError

    with pytest.raises(PlanError, match="cp: 2") as err:
        check_plan_against_model(_plan({"cp": 2, **case}))
    assert fragment in str(err.value)
    check_plan_against_model(_plan({"cp": 2, "model": "tiny-mistral"}))  # its 4096-token window covers seq_len


def test_guard_refuses_cpu_unless_the_cpu_kernel_has_a_ring_handler():
    """The guard probes CP's handler table itself: torch 2.13 has no CPU handler (refused with
    torch's reason), the test shim adds one (allowed), and removing it refuses again."""
    import torch

    import cp_cpu_shim
    from paratune.model.build import build_config
    from paratune.parallel.cp import check_cp_supported, cpu_ring_attention_available

    plan = _plan({"cp": 2})
    config = build_config(plan.model, plan.model_overrides)
    cpu = torch.device("cpu")
    assert not cpu_ring_attention_available()
    with pytest.raises(ValueError, match="cp: 2 on a CPU device") as err:
        check_cp_supported(config, plan, cpu)
    assert CP_CPU_REASON in str(err.value)
    cp_cpu_shim.install()
    try:
        assert cpu_ring_attention_available()
        check_cp_supported(config, plan, cpu)
    finally:
        cp_cpu_shim.uninstall()
    assert not cpu_ring_attention_available()
    with pytest.raises(ValueError, match="CPU device"):
        check_cp_supported(config, plan, cpu)


def test_guard_refuses_fp32_gqa_on_cuda_for_device_auto():
    """A plan with device 'auto' passes the rules; the worker that lands on a GPU refuses."""
    import torch

    from paratune.model.build import build_config
    from paratune.parallel.cp import check_cp_supported

    plan = _plan({"cp": 2})
    with pytest.raises(ValueError, match="math kernel"):
        check_cp_supported(build_config(plan.model, plan.model_overrides), plan, torch.device("cuda"))


def test_labels_are_shifted_before_sharding():
    import torch

    from paratune.parallel.cp import IGNORE_INDEX, shift_labels

    ids = torch.arange(8).view(2, 4)
    assert shift_labels(ids).tolist() == [[1, 2, 3, IGNORE_INDEX], [5, 6, 7, IGNORE_INDEX]]


# --------------------------------------------------------------------------- gloo parity
def _named_gradients(runner) -> dict:
    """Whole gradients by parameter name (FSDP/TP DTensors gathered); DDP's local shards of
    tensor-parallel weights are left out (their loss parity covers them)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in runner.model.named_parameters():
        grad = param.grad
        if grad is None or hasattr(param, "_st_info"):
            continue
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        out[name.removeprefix("module.")] = grad.detach().float().numpy().copy()
    return out


def capture_first_step_gradients(runner) -> dict:
    """Arms the runner to copy, into the dict returned, the gradients its first optimizer step
    starts from (before clipping); the training itself is unchanged."""
    captured: dict = {}
    clip, step = runner.clip_gradients, runner.optimizer.step

    def capture() -> None:
        if not captured:
            captured.update(_named_gradients(runner))

    def clip_after_capture() -> None:
        capture()
        clip()

    def step_after_capture(*args, **kwargs):
        capture()
        return step(*args, **kwargs)

    runner.clip_gradients, runner.optimizer.step = clip_after_capture, step_after_capture
    return captured


def first_step_gradients(runner, micro) -> dict:
    """The gradients the first optimizer step starts from, before clipping."""
    captured = capture_first_step_gradients(runner)
    runner.train_step(micro)
    return captured


def measure_with_gradients(plan, rank: int, world: int, local_world: int, device) -> dict:
    """train_and_measure, with the gradients of its first step (run in every gloo worker).

    The step is the trial's own step 0 (a warm-up step): the runner train_and_measure builds,
    seeded with seed + 1 + dp rank (the cp ranks of a dp rank train on the same sequences), on
    step 0's micro-batches of this dp rank, as the reference's first step on the whole batch."""
    import paratune.parallel
    from paratune.trial.worker import train_and_measure

    build = paratune.parallel.build_runner
    armed: list[dict] = []

    def build_and_capture(*args, **kwargs):
        runner = build(*args, **kwargs)
        armed.append(capture_first_step_gradients(runner))
        return runner

    paratune.parallel.build_runner = build_and_capture  # train_and_measure imports it when it runs
    try:
        out = train_and_measure(plan, rank, world, local_world, device)
    finally:
        paratune.parallel.build_runner = build
    assert len(armed) == 1, f"train_and_measure built {len(armed)} runners"
    out["gradients"] = armed[0]
    return out


def reference_gradients(plan) -> dict:
    """The single-process reference's first-step gradients (as paratune.sweep.parity trains its reference)."""
    import torch

    from paratune.config.data import TokenBatches
    from paratune.model.build import build_config, build_model
    from paratune.parallel.recompute import apply_checkpointing
    from paratune.parallel.runner import StepRunner, make_optimizer

    config = build_config(plan.model, plan.model_overrides)
    model = build_model(config, seed=plan.seed)
    apply_checkpointing(model, plan)
    model.train()
    runner = StepRunner(model, make_optimizer(model.parameters(), plan), plan, torch.device("cpu"),
                        autocast=plan.precision == "bf16")
    data = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed)
    torch.manual_seed(plan.seed + 1)
    return first_step_gradients(runner, data.micro_batches(0, dp_rank=0, dp_degree=1, micro_batch=plan.micro_batch))


_references: dict = {}


def _reference(plan) -> tuple[list[float], dict]:
    """The reference's losses and first-step gradients, once per distinct training (the plan
    without its layout: the reference reads none of the layout's fields)."""
    key = training_key(plan)
    if key not in _references:
        with single_torch_thread():
            _references[key] = (reference_losses(plan), reference_gradients(plan))
    return _references[key]


@functools.lru_cache(maxsize=None)
def _runs(world: int) -> dict:
    """Every case of one world size, run by one set of gloo processes with the shim installed."""
    every = {**CASES, **BF16}
    return run_named_batch({n: _plan(case) for n, case in every.items()
                            if case["num_workers"] == world and wanted(n, MATRIX)},
                           setup=SHIM, measure=MEASURE)


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(CASES, MATRIX))
def test_cp_matches_reference(name):
    plan, out = batch_result(_runs(CASES[name]["num_workers"])[name])
    reference_loss, reference = _reference(plan)
    assert max_loss_difference(out["losses"], reference_loss) < 1e-5, out["losses"]
    assert set(out["linear_matmul_dtypes"]) == {"float32"}
    assert_groups_use_plan_timeout(plan, out)  # the cp, dp x cp (and tp) groups of the device mesh
    grads = out["gradients"]
    assert grads and set(grads) <= set(reference)
    if plan.tp == 1 or plan.strategy == "fsdp":
        assert set(grads) == set(reference)
    for key, grad in grads.items():
        scale = max(1e-3, float(np.abs(reference[key]).max()))
        assert np.abs(grad - reference[key]).max() < 1e-5 * scale, key
    share = expected_parameter_share(plan)
    assert 0.9 * share <= min(out["local_parameter_counts"]) <= max(out["local_parameter_counts"]) <= 1.1 * share


@pytest.mark.integration
@pytest.mark.parametrize("name", list(BF16))
def test_cp_bf16_trains_close_to_reference(name):
    plan, out = batch_result(_runs(BF16[name]["num_workers"])[name])
    assert max_loss_difference(out["losses"], _reference(plan)[0]) < 0.05
    assert set(out["linear_matmul_dtypes"]) == {"bfloat16"}


_REDUCTION_PROBE = """
import json, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from paratune.parallel.cp import configure_gradient_reduction
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
out = {}
for device in ("cpu", "cuda"):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    scale = configure_gradient_reduction(model, "fsdp", dp=2, cp=2, device=torch.device(device))
    # every FSDP unit that holds parameters (the two layers; the root holds none). `_fsdp_param_group`:
    # torch 2.11 (the GPU image's) has only that one; 2.13 keeps it beside its list `_fsdp_param_groups`.
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]
    out[device] = {"scale": scale, "units": len(groups), "factors": sorted({g.gradient_divide_factor for g in groups}),
                   "force_sum": sorted({bool(g.force_sum_reduction_for_comms) for g in groups})}
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.integration  # gloo worker processes
def test_fsdp_reduction_over_dp_x_cp_divides_by_dp_and_sums_only_on_gloo():
    """On GPUs FSDP2 divides by dp inside NCCL's reduction (PREMUL_SUM); gloo has no PREMUL_SUM, so
    only CPU workers force a plain sum (divided after). Real FSDP2 units on a one-rank gloo group."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    platform_dir = str(Path(__file__).parents[1] / "platform")
    env = {**os.environ, "PROBE_PORT": str(port), "PYTHONPATH": platform_dir}
    done = subprocess.run([sys.executable, "-c", _REDUCTION_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for device in ("cpu", "cuda"):
        assert out[device]["units"] == 2 and out[device]["factors"] == [2.0] and out[device]["scale"] == 1.0
    assert out["cpu"]["force_sum"] == [True] and out["cuda"]["force_sum"] == [False]
