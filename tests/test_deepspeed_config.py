"""The exported deepspeed.json is what was measured, and DeepSpeed itself accepts it.

Every ZeRO variant a space can produce is exported as the winner would be, then parsed by
DeepSpeed's own config class (batch arithmetic, ZeRO section, optimizer section) and, for a
small model, handed to a plain `deepspeed.initialize(config=...)`: the optimizer it builds must
carry the plan's AdamW hyper-parameters.
"""

import json

import pytest
import torch
from gloo_harness import one_torch_thread  # noqa: F401 (fixture: in-process training on one thread)

from paratune.out.export import export_winner
from paratune.parallel.runner import ADAM_BETAS, ADAM_EPS
from paratune.config.plan import load_plan_dict

VARIANTS = [
    {"stage": s, "offload_optimizer": oo, "offload_param": op}
    for s in (0, 1, 2, 3) for oo in (False, True) for op in (False, True)
    if not (op and s != 3) and not (oo and s == 0)
]


@pytest.fixture(scope="module")
def one_process_group():
    import torch.distributed as dist

    from gloo_harness import _free_port

    import deepspeed

    from paratune.parallel.zero import skip_shm_allreduce_on_cpu

    skip_shm_allreduce_on_cpu(torch.device("cpu"))  # as every ZeRO trial on CPU does
    env = pytest.MonkeyPatch()
    env.setenv("LOCAL_RANK", "0")  # what a launcher sets; DeepSpeed's engine asks for it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # wraps the group above
    yield
    dist.destroy_process_group()
    env.undo()


class _DataParallelOf:
    """DeepSpeed asks an `mpu` for the data-parallel size (the cluster's, not this process's)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _exported(plan, tmp_path) -> dict:
    export_winner(plan, tmp_path, {"label": "test"})
    return json.loads((tmp_path / "deepspeed.json").read_text())


CASES = [(z, p) for z in VARIANTS for p in ("fp32", "bf16") if not (z["stage"] == 0 and p == "bf16")]  # plan rule


@pytest.mark.parametrize("zero, precision", CASES, ids=lambda v: v if isinstance(v, str) else
                         f"s{v['stage']}-oo{int(v['offload_optimizer'])}-op{int(v['offload_param'])}")
def test_exported_config_parses_with_deepspeed(zero, precision, tmp_path, one_process_group):
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = load_plan_dict({"model": "tiny-llama", "strategy": "zero", "zero": zero, "num_workers": 8,
                           "global_batch": 64, "micro_batch": 2, "precision": precision, "lr": 2e-4,
                           "weight_decay": 0.1})
    config = _exported(plan, tmp_path)
    parsed = DeepSpeedConfig(config, mpu=_DataParallelOf(plan.dp_degree))
    assert parsed.train_batch_size == 64 and parsed.gradient_accumulation_steps == plan.grad_accum
    assert parsed.zero_optimization_stage == zero["stage"]
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.optimizer_name == "adamw"
    params = parsed.optimizer_params
    assert (params["lr"], tuple(params["betas"]), params["eps"], params["weight_decay"]) == (2e-4, ADAM_BETAS, ADAM_EPS, 0.1)
    if zero["offload_optimizer"]:  # DeepSpeed's CPU Adam: DeepSpeed picks it from this block
        assert "torch_adam" not in params and parsed.zero_config.offload_optimizer.device == "cpu"
    else:
        assert params["torch_adam"] is True and params["fused"] is True


def test_plain_deepspeed_initialize_trains_what_was_tuned(tmp_path, one_process_group):
    import deepspeed

    from paratune.model.build import build_config, build_model

    plan = load_plan_dict({"model": "tiny-llama", "strategy": "zero", "zero": {"stage": 2}, "num_workers": 1,
                           "global_batch": 4, "micro_batch": 2, "lr": 5e-4, "weight_decay": 0.05})
    config = _exported(plan, tmp_path)
    config["optimizer"]["params"]["fused"] = False  # the exported file targets GPUs; this runs on CPU
    model = build_model(build_config(plan.model), seed=0)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inner = optimizer.optimizer
    assert isinstance(inner, torch.optim.AdamW)
    group = inner.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (5e-4, ADAM_BETAS, ADAM_EPS, 0.05)
    ids = torch.randint(0, 512, (2, 16))
    before = engine(input_ids=ids, labels=ids).loss.item()
    for _ in range(4):
        for _ in range(plan.grad_accum):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    assert engine(input_ids=ids, labels=ids).loss.item() < before


def test_zero3_bf16_keeps_the_references_fp32_rotary_tables(one_process_group):
    """zero.Init creates floating tensors in the training dtype (torch.arange included), which
    would leave a bf16 `inv_freq`; the built model must hold the reference's fp32 buffers, and
    its parameters the reference's values (rounded to bf16)."""
    from paratune.model.materialize import ModelInit, build_meta
    from paratune.model.build import build_config, build_model
    from paratune.parallel.zero import build_zero3, deepspeed_config

    plan = load_plan_dict({"model": "tiny-llama", "strategy": "zero", "zero": {"stage": 3}, "num_workers": 1,
                           "global_batch": 4, "micro_batch": 2, "precision": "bf16"})
    config = build_config(plan.model)
    model = build_zero3(ModelInit(build_meta(config), config, seed=5), deepspeed_config(plan, False), torch.device("cpu"), plan)
    reference = build_model(config, seed=5)
    buffers = dict(reference.named_buffers())
    for name, buf in model.named_buffers():
        assert buf.dtype == torch.float32 and torch.equal(buf, buffers[name]), name
    import deepspeed

    weights = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            assert torch.equal(param.data, weights[name].to(param.dtype)), name


def test_deepspeed_on_cpu_builds_no_shared_memory_op_and_reduces_through_gloo(one_process_group):
    """DeepSpeed's CPU comm backend would JIT-compile its shared-memory all-reduce (a minute of C++
    on 2 cores, charged to the first ZeRO trial); marked incompatible, it is not built and
    collectives are torch.distributed's (gloo)."""
    import torch.distributed as dist
    from deepspeed.comm import comm

    assert comm.cdb is not None and comm.cdb.shm_comm_op is None
    assert getattr(comm.cdb, "shm_vector_kernel_level", 0) == 0
    assert dist.get_backend() == "gloo"
    x = torch.ones(4)
    comm.inference_all_reduce(x)  # the only user of the op: falls back to the process group
    assert torch.equal(x, torch.ones(4))
