"""float8 training through torchao (paratune.parallel.float8) and the recorder that proves it ran.

Single process: the conversion on the meta device keeps every module object and parameter name
(so materialize fills the reference's values), skips the LM head and what CUDA's `_scaled_mm`
cannot run (dimensions not multiples of 16), and feeds the float8 linears bf16 under CPU autocast
as GPU autocast does; the recorder counts a converted linear's matmul as float8 and one that fell
back apart. Real gloo processes (2, one set for every case): DDP, FSDP2 (with and without the
float8 all-gather), pipeline stages and tp, tensorwise and rowwise, train within FLOAT8_TOLERANCE
of the single-process bf16 reference, every converted linear in float8 and the head in bf16.
"""

import functools
import math

import pytest
import torch
from conftest import BASE_PLAN
from gloo_harness import batch_result, one_torch_thread, reference_for, run_named_batch, training_key  # noqa: F401
from torch import nn

from paratune.config.data import TokenBatches
from paratune.model.materialize import ModelInit, build_meta, materialize
from paratune.model.build import build_config, build_model
from paratune.parallel.float8 import SKIPPED_ATTR, convert_to_float8, converted_linears
from paratune.parallel.runner import StepRunner, make_optimizer
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import load_plan_dict
from paratune.trial.precision import FLOAT8_FORWARD, IN_FLOAT8_LINEAR, LinearMatmulDtypes, precision_problem

pytest.importorskip("torchao.float8")

# Against the single-process bf16 reference (no float8), 3 steps at lr 1e-2: measured 0.0023-0.0027
# (DDP, pipeline), 0.0025-0.0041 (tp 2), 0.0042-0.0045 (FSDP2 tensorwise, with or without the float8
# all-gather), 0.0105 (FSDP2 rowwise); the bf16 layouts' own spread is up to 0.003 (tp 2 without
# float8). e4m3 keeps 3 mantissa bits (bf16: 7), so float8 adds rounding of its own: 0.03 is ~3x
# the worst measured, still under the 0.05 bf16 parity tolerance. Broken scales (overflow, a wrong
# amax) move the loss by far more than that (NaN or whole units), a missing conversion is the
# recorder's to catch.
FLOAT8_TOLERANCE = 0.03
# DDP and pipeline stages compute exactly what one process computes with the same float8 linears
# (fp32 parameters, bf16 autocast, the same micro-batches): measured < 1e-6.
SAME_FLOAT8_TOLERANCE = 1e-4
F8 = {"precision": "bf16", "float8": "tensorwise"}
# tiny-llama: 2 blocks x 7 linears, all dimensions multiples of 16 (intermediate 176): 14 float8
# linears, the LM head in bf16.
TINY_CONVERTED = 14


def _plan(**fields):
    return load_plan_dict({**BASE_PLAN, **F8, "num_workers": 1, **fields})


def _meta_model(plan, overrides=None):
    config = build_config(plan.model, overrides or {})
    model = build_meta(config)
    model.train()
    return config, model


def test_meta_conversion_keeps_modules_names_and_values_and_skips_what_cuda_cannot_run():
    plan = _plan()
    config, model = _meta_model(plan, {"intermediate_size": 168})  # 168 = 16 x 10.5: the MLP stays bf16
    init = ModelInit(model, config, plan.seed)
    before = dict(model.named_modules())
    names = [n for n, _ in model.named_parameters()]
    convert_to_float8(model, plan)
    assert converted_linears(model) == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    skipped = getattr(model, SKIPPED_ATTR)
    assert set(skipped) == {"lm_head"} | {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert "LM head" in skipped["lm_head"] and "in_features 168 not a multiple of 16" in skipped["model.layers.0.mlp.down_proj"]
    assert all(model.get_submodule(n) is m for n, m in before.items())  # ModelInit's slots still hold
    assert [n for n, _ in model.named_parameters()] == names
    materialize(model, init, torch.device("cpu"))
    reference = build_model(config, seed=plan.seed).state_dict()
    assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters())


def test_tp_splits_decide_what_converts_by_the_shape_each_rank_multiplies():
    """Conversion runs before tp, but CUDA's _scaled_mm sees a rank's shard: at tp 2 tiny-llama's
    MLP (176 wide) is 88 a rank, so gate/up (column-parallel: out/tp) and down (row-parallel:
    in/tp) stay bf16 while q/k/v/o (64/tp = 32, 32/tp = 16) convert; at tp 1 all 14 convert."""
    from paratune.parallel.float8 import skipped_linears

    plan = _plan(tp=2, num_workers=2)
    _, model = _meta_model(plan)
    skipped = skipped_linears(model, plan)
    mlp = {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert set(skipped) == {"lm_head"} | mlp
    assert "out_features 176 / tp 2 = 88 per rank" in skipped["model.layers.0.mlp.up_proj"]
    assert "in_features 176 / tp 2 = 88 per rank" in skipped["model.layers.0.mlp.down_proj"]
    assert set(skipped_linears(model, _plan())) == {"lm_head"}
    convert_to_float8(model, plan)
    assert len(converted_linears(model)) == TINY_CONVERTED - len(mlp)
    # 192 / 2 = 96 a rank: the MLP converts at tp 2 too.
    wide = _plan(tp=2, num_workers=2, model_overrides={"intermediate_size": 192})
    assert set(skipped_linears(_meta_model(wide, {"intermediate_size": 192})[1], wide)) == {"lm_head"}


def test_a_float8_plan_that_would_convert_nothing_is_refused_before_launch():
    """hidden 48 at tp 2: every projection is 24 or 12 wide a rank, the MLP 88 whole: all bf16."""
    from paratune.config.plan import PlanError
    from paratune.checks.preflight import check_plan_against_model

    overrides = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
                 "intermediate_size": 88}
    plan = _plan(tp=2, num_workers=2, model_overrides=overrides)
    with pytest.raises(PlanError, match="float8: 'tensorwise' converts no linear of 'tiny-llama' at tp 2"):
        check_plan_against_model(plan)
    check_plan_against_model(_plan(tp=2, num_workers=2))  # the attention converts: accepted


def test_float8_all_gather_weights_materialize_with_the_reference_values():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    plan = _plan(strategy="fsdp", float8_all_gather=True)
    config, model = _meta_model(plan)
    init = ModelInit(model, config, plan.seed)
    convert_to_float8(model, plan)
    assert len(converted_linears(model)) == TINY_CONVERTED
    q_proj = model.model.layers[0].self_attn.q_proj
    materialize(model, init, torch.device("cpu"))
    assert isinstance(q_proj.weight.data, WeightWithDynamicFloat8CastTensor)
    reference = build_model(config, seed=plan.seed).state_dict()
    assert all(torch.equal(p.data if not isinstance(p.data, WeightWithDynamicFloat8CastTensor) else p.data._tensor,
                           reference[n]) for n, p in model.named_parameters())


def test_cpu_autocast_feeds_the_float8_linears_bf16_as_gpu_autocast_does():
    """torchao's forward casts its input to the autocast dtype under GPU autocast only
    (float8_linear.py:258-261). Alone under CPU autocast it quantizes the fp32 input (its amax, its
    scale) and saves it for backward in fp32; only the float8 operands are re-tagged bf16 at the mm
    (its `_to_copy` override). paratune's pre-hook casts first, as GPU autocast does: the result is
    torchao's on a bf16 input, bit for bit."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    x = torch.randn(4, 32) * 3
    torchao_only = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=Float8LinearConfig())
    converted = nn.Sequential(nn.Linear(32, 32))
    converted.load_state_dict(torchao_only.state_dict())
    convert_to_float8(converted, _plan())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = converted(x)
        as_on_gpu = torchao_only(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, as_on_gpu)
    out.float().sum().backward()
    assert converted[0].weight.grad.dtype == torch.float32  # the fp32 parameter keeps an fp32 gradient


def test_recorder_counts_float8_and_tells_a_fallen_back_float8_linear_from_the_head():
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType, convert_to_float8_training

    plan = _plan()
    config = build_config(plan.model, {"intermediate_size": 168})
    model = build_model(config, seed=plan.seed)
    convert_to_float8(model, plan)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with LinearMatmulDtypes() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    assert dict(seen.counts) == {FLOAT8_FORWARD: 8, "bfloat16": 7}  # attention in float8; MLP and head bf16
    assert precision_problem("bf16", "tensorwise", seen.counts) is None
    assert "not in bfloat16" in precision_problem("bf16", "none", seen.counts)
    # A float8 linear whose casts are all disabled multiplies bf16 operands: counted apart.
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    fallen_back = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)).to(torch.bfloat16), config=Float8LinearConfig(
        cast_config_input=off, cast_config_weight=off, cast_config_grad_output=off))
    with LinearMatmulDtypes() as fell:
        fallen_back(torch.randn(4, 32, dtype=torch.bfloat16))
    assert dict(fell.counts) == {"bfloat16" + IN_FLOAT8_LINEAR: 1}
    assert "neither float8" in precision_problem("bf16", "tensorwise", {FLOAT8_FORWARD: 8, **fell.counts})
    assert "no linear matmul ran in float8" in precision_problem("bf16", "tensorwise", {"bfloat16": 15})


CASES = {
    "ddp-tensorwise": {"strategy": "ddp"},
    "fsdp-rowwise": {"strategy": "fsdp", "float8": "rowwise"},
    "fsdp-tensorwise-float8-all-gather": {"strategy": "fsdp", "float8_all_gather": True},
    "pp2-tensorwise": {"pp": 2},
    # plain DTensor TP on torchao's Float8Linear; an MLP of 192 (96 a rank) so every block linear converts
    "tp2-tensorwise": {"tp": 2, "model_overrides": {"intermediate_size": 192}},
}
# Same numbers as one process with the same float8 linears (no bf16 parameter copy, no tp split).
# (Kept to what differs, for the suite's time: rowwise under fsdp, tensorwise under ddp, pp, tp and
# with the float8 all-gather; ddp rowwise and fsdp tensorwise without the all-gather ran alike.)
SAME_AS_ONE_PROCESS = {"ddp-tensorwise", "pp2-tensorwise"}


@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    """Every case in one set of 2 gloo processes (one spawn, one process group)."""
    return run_named_batch({name: load_plan_dict({**BASE_PLAN, **F8, **case}) for name, case in CASES.items()})


_float8_references: dict[str, list[float]] = {}


def float8_reference(plan) -> list[float]:
    """paratune.sweep.parity.reference_losses with the plan's float8 linears: one CPU process, fp32
    parameters, bf16 autocast, the same data and optimizer (cached per training)."""
    key = training_key(plan.with_changes(float8_all_gather=False))
    if key not in _float8_references:
        config = build_config(plan.model, plan.model_overrides)
        model = build_model(config, seed=plan.seed)
        convert_to_float8(model, plan.with_changes(strategy="ddp", float8_all_gather=False))
        model.train()
        runner = StepRunner(model, make_optimizer(model.parameters(), plan), plan, torch.device("cpu"), autocast=True)
        data = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed)
        torch.manual_seed(plan.seed + 1)
        _float8_references[key] = [float(runner.train_step(data.micro_batches(step, 0, 1, plan.micro_batch)))
                                   for step in range(plan.total_steps)]
    return _float8_references[key]


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CASES))
def test_float8_plans_train_close_to_the_bf16_reference_with_every_converted_linear_in_float8(name):
    plan, out = batch_result(_runs()[name])
    losses = out["losses"]
    assert len(losses) == plan.total_steps and all(math.isfinite(x) for x in losses)
    bf16_reference = reference_for(plan.with_changes(float8="none", float8_all_gather=False))
    assert max_loss_difference(losses, bf16_reference) < FLOAT8_TOLERANCE, (losses, bf16_reference)
    if name in SAME_AS_ONE_PROCESS:
        assert max_loss_difference(losses, float8_reference(plan)) < SAME_FLOAT8_TOLERANCE
    counts = out["linear_matmul_dtypes"]
    assert precision_problem(plan.precision, plan.float8, counts) is None, counts
    # Each forward runs every linear once: 14 float8 ones per bf16 head, none fell back.
    assert set(counts) == {FLOAT8_FORWARD, "bfloat16"} and counts[FLOAT8_FORWARD] == TINY_CONVERTED * counts["bfloat16"]


def test_torchao_import_noise_is_filtered_and_nothing_else():
    import logging

    from paratune.parallel.float8 import quiet_torchao_import

    quiet_torchao_import()
    quiet_torchao_import()  # idempotent: one filter per logger

    def kept(logger: str, message: str) -> bool:
        record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)
        filters = logging.getLogger(logger).filters
        assert len(filters) == 1
        return all(f.filter(record) for f in filters)

    assert not kept("torchao", "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: x")
    assert not kept("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively "
                                           "supported by torch.compile as an opaque value type.")
    assert kept("torchao", "Failed to load the checkpoint")  # torchao's other warnings stay
    assert kept("torch.utils._pytree", "something else")
