"""Every strategy and option trains like the single-process reference (real gloo processes).

fp32: the per-step losses must match within 1e-5 (observed ~5e-7). bf16 rounds differently
per strategy, so it is held to a bf16-sized tolerance instead.
"""

import functools
import math

import pytest
from gloo_harness import assert_groups_use_plan_timeout, batch_result, one_torch_thread, reference_for, run_named_batch  # noqa: F401 (fixture)
from conftest import BASE_PLAN, expected_parameter_share
from test_loss_forms import loss_form_plans
from test_expert_parallel import ep_plans
from test_moe_families import moe_family_plans
from test_moe_measure import CASES as MOE_MEASURE_CASES
from tiers import cases, wanted

from paratune.config.plan import load_plan_dict
from paratune.sweep.parity import max_loss_difference

pytestmark = pytest.mark.integration

CASES = {
    "ddp": {"strategy": "ddp"},
    "ddp-small-buckets-no-view": {"strategy": "ddp", "ddp": {"bucket_cap_mb": 0.05, "gradient_as_bucket_view": False}},
    "ddp-static-graph-accum": {"strategy": "ddp", "ddp": {"static_graph": True}},
    "ddp-checkpointing": {"strategy": "ddp", "activation_checkpointing": "full"},
    "fsdp-full": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "fsdp-grad-op-prefetch": {"strategy": "fsdp", "fsdp": {"sharding": "grad_op", "prefetch": 1}},
    "fsdp-no-shard": {"strategy": "fsdp", "fsdp": {"sharding": "no_shard"}},
    "fsdp-hybrid-2x2": {"strategy": "fsdp", "num_workers": 4, "global_batch": 8, "micro_batch": 1,
                        "fsdp": {"sharding": "hybrid", "shard_group_size": 2}},
    "fsdp-cpu-offload": {"strategy": "fsdp", "fsdp": {"sharding": "full", "cpu_offload": True}},
    "fsdp-checkpointing": {"strategy": "fsdp", "activation_checkpointing": "full"},
    "zero-0": {"strategy": "zero", "zero": {"stage": 0}},
    "zero-1": {"strategy": "zero", "zero": {"stage": 1}},
    "zero-2-overlap-buckets": {"strategy": "zero", "zero": {"stage": 2, "overlap_comm": True,
                                                            "reduce_bucket_size": 20000, "allgather_bucket_size": 20000}},
    "zero-3-prefetch": {"strategy": "zero", "zero": {"stage": 3, "stage3_prefetch_bucket_size": 10000}},
    "zero-2-offload-optimizer": {"strategy": "zero", "zero": {"stage": 2, "offload_optimizer": True}},
    "zero-3-offload-all": {"strategy": "zero", "zero": {"stage": 3, "offload_optimizer": True, "offload_param": True}},
    # DeepSpeed's own CPU Adam, as offload plans run on GPUs: the same AdamW as the reference's.
    "zero-2-offload-deepspeed-cpu-adam": {"strategy": "zero", "optimizer": "deepspeed",
                                          "zero": {"stage": 2, "offload_optimizer": True}},
    "zero-2-checkpointing": {"strategy": "zero", "zero": {"stage": 2}, "activation_checkpointing": "full"},
}


# `matrix` (make test-matrix; tests/tiers.py): another value of a code path a kept case runs, with the
# kept case that covers it. paratune hands these options to torch / DeepSpeed the way the kept case does.
FP32_MATRIX = {
    "ddp-small-buckets-no-view": "ddp-static-graph-accum: ddp's options handed to torch's DDP",
    "fsdp-no-shard": "model-parallel dp2xtp2-no-shard: FSDP2's no_shard layout (and fsdp-full: FSDP2 on dp)",
    "fsdp-checkpointing": "test_recompute_compile fsdp-selective: the checkpoint hook under FSDP2; ddp-checkpointing: full",
    "zero-0": "zero-1: the same DeepSpeed engine and config, another stage number",
    "zero-2-offload-optimizer": "zero-3-offload-all (offload_optimizer) and zero-2-offload-deepspeed-cpu-adam (stage 2 offload)",
}


def _fp32_plan(name: str):
    return load_plan_dict({**BASE_PLAN, "seed": 7, **CASES[name]})


BF16_CASES = ["ddp", "fsdp-full", "zero-2-overlap-buckets"]


def _bf16_plan(name: str):
    return load_plan_dict({**BASE_PLAN, "precision": "bf16", **CASES[name]})


@pytest.mark.parametrize("name", cases(CASES, FP32_MATRIX))
def test_fp32_loss_parity(name):
    plan, out = batch_result(_runs(_fp32_plan(name).num_workers)[("fp32", name)])
    reference = reference_for(plan)
    assert len(out["losses"]) == plan.total_steps
    assert max_loss_difference(out["losses"], reference) < 1e-5, (out["losses"], reference)
    assert out["losses"][-1] < out["losses"][0]  # it trains
    assert set(out["linear_matmul_dtypes"]) == {"float32"}  # fp32 plans compute in fp32
    if plan.fsdp is not None and plan.fsdp.sharding == "hybrid":  # its replicate and shard groups
        assert_groups_use_plan_timeout(plan, out)


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_trains_close_to_reference(name):
    plan, out = batch_result(_runs(_bf16_plan(name).num_workers)[("bf16", name)])
    assert all(math.isfinite(x) for x in out["losses"])
    assert max_loss_difference(out["losses"], reference_for(plan)) < 0.05


# Model-parallel plans (2, 4 and 8 gloo processes): every layer's math is split, so parity is the
# proof that the split is right; the local parameter counts prove that every rank holds its share.
MODEL_PARALLEL = {
    "tp2": {"num_workers": 2, "tp": 2},
    "tp2-sequence-parallel": {"num_workers": 2, "tp": 2, "sequence_parallel": True},
    "pp2-1f1b": {"num_workers": 2, "pp": 2},
    "pp2-gpipe": {"num_workers": 2, "pp": 2, "pp_schedule": "gpipe"},
    "pp2-interleaved": {"num_workers": 2, "pp": 2, "micro_batch": 1, "pp_schedule": "interleaved_1f1b",
                        "model_overrides": {"num_hidden_layers": 4}},
    "dp2xtp2-fsdp": {"num_workers": 4, "tp": 2, "strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "dp2xtp2-ddp": {"num_workers": 4, "tp": 2, "grad_clip": 0.05},  # clipping active on every step
    "dp2xpp2-fsdp": {"num_workers": 4, "pp": 2, "strategy": "fsdp", "fsdp": {"sharding": "grad_op"}},
    # DDP semantics under a pipeline schedule: FSDP2's replicate on every stage (DDP's reducer breaks).
    "dp2xpp2-ddp": {"num_workers": 4, "pp": 2, "strategy": "ddp"},
    "dp2xtp2-no-shard": {"num_workers": 4, "tp": 2, "strategy": "fsdp", "fsdp": {"sharding": "no_shard"}},
    # LoRA on every linear beside the sharded base (paratune.parallel.tp.adapted_plan), FSDP2 on dp
    "dp2xtp2-fsdp-sequence-parallel-lora": {"num_workers": 4, "tp": 2, "strategy": "fsdp", "sequence_parallel": True,
                                            "peft": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
    # 3-D, the layout of Llama-3-70B on 32 GPUs in miniature: tp innermost, FSDP2 per stage on dp.
    "dp2xpp2xtp2-fsdp": {"num_workers": 8, "tp": 2, "pp": 2, "strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "dp2xpp2xtp2-ddp-sequence-parallel": {"num_workers": 8, "tp": 2, "pp": 2, "strategy": "ddp",
                                          "sequence_parallel": True, "grad_clip": 0.05},
    # HSDP on the dp axis with tp: shard over 2 dp ranks, replicate over 2.
    "hsdp2x2xtp2": {"num_workers": 8, "tp": 2, "micro_batch": 1, "strategy": "fsdp",
                    "fsdp": {"sharding": "hybrid", "shard_group_size": 2}},
}


MODEL_PARALLEL_MATRIX = {
    "pp2-gpipe": "pp2-1f1b: the same stages, torch's other schedule class",
    "dp2xpp2xtp2-ddp-sequence-parallel": "dp2xpp2xtp2-fsdp (the 3-D mesh), dp2xpp2-ddp (ddp under pp), tp2-sequence-parallel",
    "hsdp2x2xtp2": "fsdp-hybrid-2x2 (HSDP's groups) and dp2xtp2-fsdp (FSDP2 beside tp)",
}


def _matrix(kind: str) -> dict:
    """The matrix cases of one kind of this module's batch (the other modules' own)."""
    from test_expert_parallel import EP_MATRIX
    from test_moe_families import MOE_FAMILY_MATRIX

    return {"fp32": FP32_MATRIX, "model-parallel": MODEL_PARALLEL_MATRIX, "ep": EP_MATRIX,
            "moe-family": MOE_FAMILY_MATRIX}.get(kind, {})


def _all_plans() -> dict:
    """Every case of this module by (kind, name)."""
    return ({("fp32", n): _fp32_plan(n) for n in CASES} | {("bf16", n): _bf16_plan(n) for n in BF16_CASES}
            | {("model-parallel", n): load_plan_dict({**BASE_PLAN, **case}) for n, case in MODEL_PARALLEL.items()}
            | {("loss-form", n): plan for n, plan in loss_form_plans().items()}  # test_loss_forms' cases
            | {("ep", n): plan for n, plan in ep_plans().items()}  # test_expert_parallel's cases
            | {("moe-family", n): plan for n, plan in moe_family_plans().items()}  # test_moe_families' cases
            | {("moe-measure", n): plan for n, plan in MOE_MEASURE_CASES.items()})  # test_moe_measure's


@functools.lru_cache(maxsize=None)
def _runs(world: int) -> dict:
    """Every case of one world size (fp32, bf16 and model-parallel alike), run by one set of gloo
    processes: process start, imports (DeepSpeed's included) and the process group paid once per
    world size, not once per case. A case that fails is that case's failure only (the harness
    runs the cases after it in fresh processes). Only the cases of the tiers this session runs."""
    return run_named_batch({key: plan for key, plan in _all_plans().items()
                            if plan.num_workers == world and wanted(key[1], _matrix(key[0]))})


@pytest.mark.parametrize("name", cases(MODEL_PARALLEL, MODEL_PARALLEL_MATRIX))
def test_model_parallel_loss_parity(name):
    plan, out = batch_result(_runs(MODEL_PARALLEL[name]["num_workers"])[("model-parallel", name)])
    assert max_loss_difference(out["losses"], reference_for(plan)) < 1e-5
    assert_groups_use_plan_timeout(plan, out)  # the tp / pp / dp sub-groups of the device mesh
    if plan.peft is not None:  # the counts are of trained parameters: the adapters (test_adapters)
        return
    share = expected_parameter_share(plan)
    # Replicated norm weights under tp and layer counts that do not split evenly leave a few percent.
    assert 0.9 * share <= min(out["local_parameter_counts"]) <= max(out["local_parameter_counts"]) <= 1.1 * share, \
        (out["local_parameter_counts"], share)
