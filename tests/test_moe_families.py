"""Mixture-of-experts families (presets tiny-mixtral, -qwen3-moe, -olmoe, -deepseek-v3, -granitemoe).

One process: each preset builds, its routed experts are found (count, layers, top-k), the family
declares transformers' `base_model_ep_plan`, and the trained loss is the family's own (cross
entropy plus router_aux_loss_coef x the load-balancing loss where it has one). Two real gloo
processes (one set for the whole matrix): every family under ddp, fsdp (full) and ZeRO-3, and
four ep 2 cases, train like the single-process reference (fp32, < 1e-5); where the family has an
aux loss, changing its coefficient moves the reference far more than that tolerance, so the
parity also proves the distributed loss carries the aux loss.
"""

from __future__ import annotations

import functools

import pytest
import torch
from gloo_harness import batch_result, one_torch_thread, reference_for, run_named_batch  # noqa: F401 (fixture)
from conftest import BASE_PLAN
from tiers import cases

from paratune.model.build import build_config, build_model, routed_experts, routed_top_k
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import Plan, PlanError, load_plan_dict
from paratune.checks.preflight import check_plan_against_model

# family preset -> (routed experts per MoE layer, indices of the MoE layers, has a load-balancing loss)
FAMILIES: dict[str, tuple[int, list[int], bool]] = {
    "tiny-mixtral": (8, [0, 1], True),
    "tiny-qwen3-moe": (8, [0, 1], True),
    "tiny-olmoe": (8, [0, 1], True),
    # first_k_dense_replace 1: layer 0 dense; aux-loss-free routing (a score bias, no loss term)
    "tiny-deepseek-v3": (8, [1], False),
    "tiny-granitemoe": (8, [0, 1], True),
}
AUX_FAMILIES = [f for f, (_, _, aux) in FAMILIES.items() if aux]

STRATEGIES: dict[str, dict] = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "zero3": {"strategy": "zero", "zero": {"stage": 3}},
}

# Expert parallelism (ep 2: each rank holds 4 of the 8 experts, transformers' AllToAllEP dispatch)
# on the families tiny-mixtral's EP cases (test_expert_parallel) do not cover, each wrapper twice.
EP_CASES: dict[str, dict] = {
    "qwen3-moe-ddp-ep2": {"model": "tiny-qwen3-moe", "strategy": "ddp", "ep": 2},
    "olmoe-ddp-ep2": {"model": "tiny-olmoe", "strategy": "ddp", "ep": 2},
    "deepseek-v3-fsdp-ep2": {"model": "tiny-deepseek-v3", "strategy": "fsdp", "ep": 2},
    "granitemoe-fsdp-ep2": {"model": "tiny-granitemoe", "strategy": "fsdp", "ep": 2},
}

# Pipeline stages (pp 2: layer 0 on one rank, layer 1 on the other), the families without tied
# embeddings, their aux loss off (stages do not carry router logits; the preflight refuses it on).
NO_AUX = {"output_router_logits": False}
PP_CASES: dict[str, dict] = {
    f"{family.removeprefix('tiny-')}-pp2": {"model": family, "strategy": "ddp", "pp": 2, "micro_batch": 1,
                                            "model_overrides": NO_AUX}
    for family in ("tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe", "tiny-deepseek-v3")}

# `matrix` (make test-matrix; tests/tiers.py): the router and its aux loss are the family's, the wrapper is
# the strategy's. Every family keeps ddp (its own loss, aux included, against the reference); fsdp and
# ZeRO-3 keep one family each beside their EP / pipeline cases, the rest are these.
MOE_FAMILY_MATRIX = {
    **{f"{f}-fsdp": "deepseek-v3-fsdp, deepseek-v3-fsdp-ep2, granitemoe-fsdp-ep2 (FSDP2 on a MoE) and this family's ddp"
       for f in ("mixtral", "qwen3-moe", "olmoe", "granitemoe")},
    **{f"{f}-zero3": "qwen3-moe-zero3 (ZeRO-3 on a MoE) and this family's ddp"
       for f in ("mixtral", "olmoe", "deepseek-v3", "granitemoe")},
    "qwen3-moe-pp2": "mixtral-pp2 (stages of routed layers, aux loss off) and qwen3-moe-ddp",
    "olmoe-pp2": "mixtral-pp2 (stages of routed layers, aux loss off) and olmoe-ddp",
}

# 2 processes x micro_batch 2 = global_batch 4 (no accumulation): one warm-up step, two measured.
CASE = {**BASE_PLAN, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1, "measure_steps": 2}
PARITY_TOLERANCE = 1e-4  # fp32: ep's all-to-all reorders sums (1.05e-5 seen on an Intel Xeon); wrong layouts > 1e-2


def _case_name(family: str, strategy: str) -> str:
    return f"{family.removeprefix('tiny-')}-{strategy}"


def moe_family_plans() -> dict[str, Plan]:
    """Every family under every strategy, and the EP cases, as plans of 2 processes (what
    test_parity_gloo can add to its batch of 2 processes)."""
    plans = {_case_name(family, strategy): load_plan_dict({**CASE, "model": family, **fields})
             for family in FAMILIES for strategy, fields in STRATEGIES.items()}
    return plans | {name: load_plan_dict({**CASE, **fields}) for name, fields in {**EP_CASES, **PP_CASES}.items()}


def _moe_runs() -> dict:
    """name -> (plan, rank 0's output) of every case: test_parity_gloo's shared batch of 2 processes
    runs them with its own (one spawn, one import for all)."""
    from test_parity_gloo import _runs

    return {name: run for (kind, name), run in _runs(2).items() if kind == "moe-family"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preset_builds_and_its_experts_are_found(family):
    count, layers, aux = FAMILIES[family]
    config = build_config(family)
    model = build_model(config, seed=0)
    experts = routed_experts(model)
    assert [n for _, _, n in experts] == [count] * len(layers), experts
    assert [path.split(".")[2] for path, _, _ in experts] == [str(i) for i in layers], experts
    assert [routed_top_k(model, path, module) for path, module, _ in experts] == [2] * len(layers)
    # transformers' own expert-parallel plan for the family (what paratune.parallel.ep drives)
    assert getattr(config, "base_model_ep_plan", None), f"{family}: no base_model_ep_plan"
    assert bool(config.output_router_logits) == aux


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_loss_is_the_familys_own(family):
    """The loss a step trains on: cross entropy plus coef x the family's load-balancing loss (none
    for DeepSeek-V3), the aux loss computed from every layer's router logits in the forward."""
    _, layers, aux = FAMILIES[family]
    config = build_config(family)
    model = build_model(config, seed=0).train()
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    plain = model(input_ids=ids, labels=ids, output_router_logits=False)
    if not aux:
        assert out.get("aux_loss") is None and torch.equal(out.loss, plain.loss)
        return
    assert len(out.router_logits) == len(layers)
    assert out.aux_loss > 0
    expected = plain.loss + config.router_aux_loss_coef * out.aux_loss
    assert abs(out.loss.item() - expected.item()) < 1e-6, (out.loss.item(), expected.item())


@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_pipeline_refused_where_the_aux_loss_would_be_dropped(family):
    """Pipeline stages pass hidden states, not router logits: the plan refuses pp with the aux
    loss on (before any worker starts), and accepts it when the preset is overridden without it."""
    fields = {**CASE, "model": family, "pp": 2}
    with pytest.raises(PlanError, match="output_router_logits"):
        check_plan_against_model(load_plan_dict(fields))
    if family != "tiny-granitemoe":  # tied embeddings: refused under pp for that reason
        check_plan_against_model(load_plan_dict({**fields, "model_overrides": NO_AUX}))


def test_pipeline_accepted_for_the_aux_free_family():
    """DeepSeek-V3 adds no aux loss (its config has no router_aux_loss_coef): output_router_logits on
    changes nothing, and pp is accepted with it."""
    check_plan_against_model(load_plan_dict({**CASE, "model": "tiny-deepseek-v3", "pp": 2,
                                             "model_overrides": {"output_router_logits": True}}))


@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_aux_loss_moves_the_reference_far_beyond_the_tolerance(family):
    """Changing router_aux_loss_coef changes the reference's losses by far more than the parity
    tolerance: a distributed run within tolerance of the reference trains on the aux loss too."""
    plan = moe_family_plans()[_case_name(family, "ddp")]
    coef = build_config(family).router_aux_loss_coef
    changed = load_plan_dict({**plan.to_dict(), "model_overrides": {"router_aux_loss_coef": 10 * coef}})
    moved = max_loss_difference(reference_for(changed), reference_for(plan))
    assert moved > 100 * PARITY_TOLERANCE, moved


@pytest.mark.parametrize("family", list(FAMILIES))
def test_later_steps_depend_on_the_update(family):
    """The reference's steps after the first move by far more than the tolerance when the learning
    rate changes: parity on them checks each strategy's update, not only its forward. (Random
    tokens, a new batch every step: over 3 steps the loss need not fall, so it is not asserted.)"""
    plan = moe_family_plans()[_case_name(family, "ddp")]
    slower = load_plan_dict({**plan.to_dict(), "lr": plan.lr / 10})
    reference, slow = reference_for(plan), reference_for(slower)
    assert reference[0] == slow[0]  # same model, same first batch
    assert max_loss_difference(reference[1:], slow[1:]) > 100 * PARITY_TOLERANCE


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(moe_family_plans(), MOE_FAMILY_MATRIX))
def test_family_trains_like_the_reference(name):
    plan, out = batch_result(_moe_runs()[name])
    reference = reference_for(plan)
    assert len(out["losses"]) == plan.total_steps
    assert max_loss_difference(out["losses"], reference) < PARITY_TOLERANCE, (out["losses"], reference)
    assert set(out["linear_matmul_dtypes"]) == {"float32"}  # fp32 plans compute in fp32
