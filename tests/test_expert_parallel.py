"""Expert parallelism (plan field `ep`): the rules, and parity on real gloo processes.

The parity cases run in test_parity_gloo's shared process sets (`ep_plans` is added to its batch):
each must train like the single-process reference (fp32, < 1e-5), and every rank must hold exactly
its E / ep experts (local parameter counts), so a layout that kept every expert everywhere, or
averaged experts that differ, fails.
"""

from __future__ import annotations

import pytest
import torch
from gloo_harness import assert_groups_use_plan_timeout, batch_result, reference_for
from conftest import BASE_PLAN
from tiers import cases

from paratune.model.build import build_config, parameter_counts, routed_experts
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import PlanError, load_plan_dict
from paratune.checks.preflight import check_plan_against_model

MOE = {**BASE_PLAN, "model": "tiny-mixtral", "micro_batch": 1}
NO_AUX = {"output_router_logits": False}  # pipeline stages do not carry router logits to the loss

EP_CASES: dict[str, dict] = {
    # 2 processes: every dp rank is one ep rank (expert_dp 1)
    "ddp-ep2": {"num_workers": 2, "strategy": "ddp", "ep": 2, "grad_clip": 0.05,  # clipping on every step
                "profile_comm": True},  # and the all-to-all's share of a profiled step
    "fsdp-ep2": {"num_workers": 2, "strategy": "fsdp", "ep": 2, "grad_clip": 0.05},
    # 4 processes: expert_dp 2 (each expert on two ranks) or ep over all four
    "ddp-ep2-edp2": {"num_workers": 4, "strategy": "ddp", "ep": 2},
    "fsdp-ep2-edp2-selective": {"num_workers": 4, "strategy": "fsdp", "ep": 2, "grad_clip": 0.05,
                                "activation_checkpointing": "selective"},
    "fsdp-grad-op-ep4": {"num_workers": 4, "strategy": "fsdp", "fsdp": {"sharding": "grad_op"}, "ep": 4},
    "ddp-ep4-full-checkpointing": {"num_workers": 4, "strategy": "ddp", "ep": 4, "activation_checkpointing": "full"},
    # tp x ep: attention tensor-parallel, each tp rank dispatching a slice of the tokens it shares (the
    # loss: standard, since auto's vocab-parallel form cannot take the routers' aux loss; the trial says why)
    "dp2xtp2-ep2-fsdp": {"num_workers": 4, "strategy": "fsdp", "tp": 2, "ep": 2, "grad_clip": 0.05},
    "dp2xtp2-ep2-ddp": {"num_workers": 4, "strategy": "ddp", "tp": 2, "ep": 2, "grad_clip": 0.05},
    # pipeline x ep: each stage's experts over ep of its dp ranks
    "pp2-dp2-ep2-fsdp": {"num_workers": 4, "strategy": "fsdp", "pp": 2, "ep": 2, "model_overrides": NO_AUX},
    "pp2-dp2-ep2-ddp": {"num_workers": 4, "strategy": "ddp", "pp": 2, "ep": 2, "model_overrides": NO_AUX,
                        "grad_clip": 0.05},
    # 3-D x ep on 8 processes: pp 2 x dp 2 x tp 2, the experts over the 2 dp ranks of each stage
    "dp2xpp2xtp2-ep2-fsdp": {"num_workers": 8, "strategy": "fsdp", "pp": 2, "tp": 2, "ep": 2,
                             "model_overrides": NO_AUX, "grad_clip": 0.05},
}

# `matrix` (make test-matrix; tests/tiers.py): another combination of paths kept cases run, with them.
EP_MATRIX = {
    "ddp-ep4-full-checkpointing": "fsdp-grad-op-ep4 (ep over all 4 ranks) and fsdp-ep2-edp2-selective (checkpointing with ep)",
    "dp2xtp2-ep2-ddp": "dp2xtp2-ep2-fsdp (tp x ep) and ddp-ep2-edp2 (ddp's expert gradients)",
    "pp2-dp2-ep2-ddp": "pp2-dp2-ep2-fsdp (stages x ep) and test_parity_gloo dp2xpp2-ddp (ddp under pp)",
    "dp2xpp2xtp2-ep2-fsdp": "dp2xtp2-ep2-fsdp, pp2-dp2-ep2-fsdp and test_parity_gloo dp2xpp2xtp2-fsdp (the 3-D mesh)",
}

# bf16, the GPU's precision: FSDP2's mixed precision on the experts too (bf16 compute, fp32 reduction).
EP_BF16_CASES = {"fsdp-ep2-bf16": {"num_workers": 2, "strategy": "fsdp", "ep": 2, "precision": "bf16"}}


def ep_plans() -> dict:
    """The cases as plans (what test_parity_gloo adds to its batches, by world size)."""
    return {name: load_plan_dict({**MOE, **case}) for name, case in {**EP_CASES, **EP_BF16_CASES}.items()}


def _runs(world: int) -> dict:
    from test_parity_gloo import _runs as shared_runs

    return shared_runs(world)


def _expert_parameters(plan) -> int:
    from transformers import AutoModelForCausalLM

    config = build_config(plan.model, plan.model_overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for _, module, _ in routed_experts(model) for p in module.parameters())


def _expected_local_parameters(plan) -> float:
    """What one rank holds: the dense part as the strategy lays it out (over tp, then sharded over
    dp by FSDP2), E / ep of the experts (whole on every tp rank; FSDP2 shards them over their
    expert_dp x tp copies), both over pp stages."""
    total = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
    experts = _expert_parameters(plan)
    dense = total - experts
    if plan.strategy == "fsdp":
        return (dense + experts) / (plan.dp_degree * plan.tp * plan.pp)
    return (dense / plan.tp + experts / plan.ep) / plan.pp


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(EP_CASES, EP_MATRIX))
def test_expert_parallel_trains_like_the_reference(name):
    plan, out = batch_result(_runs(EP_CASES[name]["num_workers"])[("ep", name)])
    reference = reference_for(plan)
    # 1e-4: the all-to-all reorders fp32 sums (9.5e-7 on AMD EPYC, up to 1.05e-5 on an Intel Xeon; wrong layouts > 1e-2)
    assert max_loss_difference(out["losses"], reference) < 1e-4, (out["losses"], reference)
    assert out["losses"][-1] < out["losses"][0]
    assert_groups_use_plan_timeout(plan, out)  # the expert mesh's groups (ep, expert-dp) too
    # the routing, summed over ranks (and stages): every MoE layer, each routed token counted once
    tokens = out["expert_tokens"]
    layers = build_config(plan.model, plan.model_overrides).num_hidden_layers
    routed = plan.global_batch * plan.seq_len * plan.measure_steps * 2  # top-2
    assert len(tokens) == layers and all(sum(counts) == routed for counts in tokens), (tokens, routed)
    if plan.profile_comm:  # the dispatch's part of the collectives
        assert 0 < out["all_to_all_share"] <= out["comm_share"], (out["all_to_all_share"], out["comm_share"])
    expected = _expected_local_parameters(plan)
    counts = out["local_parameter_counts"]
    if plan.pp == 1 and plan.tp == 1:  # exact: the experts split evenly, FSDP2's shards differ by padding only
        assert all(abs(c - expected) <= 64 for c in counts), (counts, expected)
    else:  # stages hold unequal parts (embedding on the first, head on the last); tp replicates the norms
        assert 0.8 * expected <= min(counts) <= max(counts) <= 1.2 * expected, (counts, expected)
    # and not what every rank would hold without ep (the experts whole)
    whole = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
    if plan.strategy == "ddp" and plan.pp == 1:
        assert max(counts) <= whole - _expert_parameters(plan) / 2


@pytest.mark.integration
@pytest.mark.parametrize("name", list(EP_BF16_CASES))
def test_expert_parallel_in_bf16_trains_close_to_the_reference(name):
    plan, out = batch_result(_runs(EP_BF16_CASES[name]["num_workers"])[("ep", name)])
    assert max_loss_difference(out["losses"], reference_for(plan)) < 0.05
    assert set(out["linear_matmul_dtypes"]) == {"bfloat16"}


# ---- rules: refused before any worker starts, naming the field, the value and what is allowed ----
REFUSED = {
    "ep-not-dividing-dp": ({"num_workers": 4, "ep": 3}, r"ep: 3 must divide the data-parallel degree 4.*allowed ep: \[1, 2, 4\]"),
    "ep-with-zero": ({"strategy": "zero", "ep": 2}, r"ep: 2 with strategy 'zero'.*deepspeed\.moe.*allowed"),
    "ep-with-sequence-parallel": ({"num_workers": 4, "tp": 2, "ep": 2, "sequence_parallel": True},
                                  r"ep: 2 with tp 2 and sequence_parallel.*allowed: sequence_parallel false"),
    "ep-with-compile": ({"ep": 2, "compile": True, "warmup_steps": 1}, r"ep: 2 with compile: true.*split sizes"),
    "ep-with-hybrid": ({"num_workers": 4, "ep": 2, "strategy": "fsdp", "fsdp": {"sharding": "hybrid",
                                                                                 "shard_group_size": 2}},
                       r"ep: 2 with fsdp\.sharding 'hybrid'.*allowed: 'full' or 'grad_op'"),
    "ep-not-dividing-experts": ({"num_workers": 6, "global_batch": 6, "ep": 3},
                                r"ep: 3 must divide the model's 8 routed experts; allowed ep: \[1, 2\]"),
    "pp-drops-aux-loss": ({"num_workers": 2, "pp": 2}, r"pp: 2 with model_type 'mixtral', whose loss adds the routers' load-balancing loss.*allowed: pp 1"),
    "vocab-parallel-with-aux-loss": ({"num_workers": 4, "tp": 2, "ep": 2, "loss": "vocab_parallel"},
                                     r"loss: 'vocab_parallel' with output_router_logits true.*allowed: 'standard'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_plan_refuses_what_ep_cannot_do(name):
    fields, message = REFUSED[name]
    with pytest.raises(PlanError, match=message):  # the plan's rules, then the preflight's on the meta model
        check_plan_against_model(load_plan_dict({**MOE, **fields}))


def test_preflight_refuses_ep_on_a_dense_model_and_accepts_a_moe():
    with pytest.raises(PlanError, match=r"ep: 2 with model 'tiny-llama' .*no routed experts.*allowed: ep 1"):
        check_plan_against_model(load_plan_dict({**BASE_PLAN, "ep": 2}))
    check_plan_against_model(load_plan_dict({**MOE, "ep": 2}))  # no error


def test_expert_entries_follow_the_family_ep_plan():
    from transformers import AutoModelForCausalLM

    from paratune.parallel.ep import expert_entries

    config = build_config("tiny-mixtral")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    entries = expert_entries(model)
    assert [e.name for e in entries] == [f"model.layers.{i}.mlp.experts" for i in range(config.num_hidden_layers)]
    assert all(e.packed == ("gate_up_proj", "down_proj") and e.experts == 8 for e in entries)
    assert {id(e.module) for e in entries} == {id(m) for _, m, _ in routed_experts(model)}


def test_the_gpu_images_older_ep_plan_is_refused_with_the_reason():
    """The GPU image's transformers (5.17) writes Mixtral's EP plan as 'ep_router' + 'moe_tp_experts'
    (an all-reduce over a shared batch): read from that installed source, it is refused before
    launch, naming the entry, instead of failing on a worker."""
    import ast
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from paratune.parallel.ep import ep_refusal

    source = Path(".venv/gpu-image-site/transformers/models/mixtral/configuration_mixtral.py")
    if not source.is_file():
        pytest.skip("the GPU image's transformers is not beside the venv (make install puts it there)")
    tree = ast.parse(source.read_text())
    old_plan = next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "base_model_ep_plan" for t in node.targets))
    assert "ep_router" in old_plan.values()
    config = build_config("tiny-mixtral")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.config.base_model_ep_plan = old_plan
    refusal = ep_refusal(load_plan_dict({**MOE, "ep": 2}), model)
    assert refusal is not None and "'ep_router' is not implemented by paratune" in refusal and "allowed: ep 1" in refusal


# The public shapes (deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-30B-A3B config.json, abridged).
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                   num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=3,
                   moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                   n_group=8, topk_group=4, vocab_size=129280, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)


@pytest.mark.parametrize("shape", [DEEPSEEK_V3, QWEN3_30B_A3B], ids=["deepseek-v3", "qwen3-30b-a3b"])
def test_a_moe_proxy_keeps_its_experts_and_a_moe_layer(shape, tmp_path):
    """The parity proxy of a big MoE plan stays a MoE the plan's ep can split: every expert and the
    top-k kept, small experts, at least one MoE layer (DeepSeek's first 3 layers are dense), and
    small enough for the driver's CPU."""
    import json

    from paratune.model.materialize import build_meta
    from paratune.parallel.ep import ep_refusal
    from paratune.sweep.parity import parity_proxy

    (tmp_path / "config.json").write_text(json.dumps(shape))
    plan = load_plan_dict({"model": str(tmp_path / "config.json"), "num_workers": 16, "ep": 8, "strategy": "fsdp",
                           "global_batch": 16, "micro_batch": 1, "seq_len": 128})
    proxy = parity_proxy(plan)
    config = build_config(proxy.model, proxy.model_overrides)
    model = build_meta(config)
    experts = routed_experts(model)
    assert experts and all(count == shape.get("n_routed_experts", shape.get("num_experts")) for _, _, count in experts)
    assert ep_refusal(proxy, model) is None
    assert parameter_counts(config)["total"] < 20_000_000


# ---- checkpoints: each ep rank's experts saved and restored as its own (paratune train) ----
def checkpoint_round_trip(plan, rank: int, world: int, local_world: int, device) -> dict:
    """A gloo worker (gloo_harness `measure`): 2 steps, save the runner's state, a 3rd step; then a
    fresh runner loads the state and takes the same 3rd step. Equal losses (and equal expert
    weights after it) only if every rank's own experts and their optimizer states came back."""
    import os
    import shutil
    import tempfile

    import torch.distributed as dist

    from paratune.config.data import TokenBatches
    from paratune.parallel import build_runner
    from paratune.parallel.dims import ParallelDims

    config = build_config(plan.model, plan.model_overrides)
    dims = ParallelDims.from_plan(plan, device.type)
    data = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed)
    folder = os.path.join(tempfile.gettempdir(), f"paratune-ep-ckpt-{os.environ['MASTER_PORT']}-{plan.strategy}")

    def step(runner, index: int) -> float:
        torch.manual_seed(plan.seed + index)
        loss = runner.train_step(data.micro_batches(index, dims.dp_rank(rank), dims.dp, plan.micro_batch))
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        return float(total) / world

    def experts(runner) -> torch.Tensor:
        from paratune.parallel.ep import is_expert_param

        local = [p.to_local() if hasattr(p, "to_local") else p for p in runner.model.parameters() if is_expert_param(p)]
        return torch.cat([t.detach().reshape(-1) for t in local])

    first = build_runner(config, plan, device, local_world)
    step(first, 0), step(first, 1)
    first.save_state(folder)
    continued = step(first, 2)
    second = build_runner(config, plan, device, local_world)
    second.load_state(folder)
    resumed = step(second, 2)
    same_experts = bool(torch.equal(experts(first), experts(second)))
    flags = torch.tensor([float(same_experts)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank has loaded: the folder can go
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {"continued": continued, "resumed": resumed, "experts_equal_on_every_rank": bool(flags.item())}


CHECKPOINTED = {"ddp-ep2-checkpoint": {"num_workers": 2, "strategy": "ddp", "ep": 2},
                "fsdp-ep2-checkpoint": {"num_workers": 2, "strategy": "fsdp", "ep": 2}}


@pytest.mark.integration
def test_a_checkpoint_restores_every_ranks_own_experts():
    from gloo_harness import run_plans_on_gloo

    plans = [load_plan_dict({**MOE, **case}) for case in CHECKPOINTED.values()]
    outs = run_plans_on_gloo(plans, measure="test_expert_parallel:checkpoint_round_trip")
    for name, out in zip(CHECKPOINTED, outs):
        assert out["experts_equal_on_every_rank"], name
        assert out["resumed"] == pytest.approx(out["continued"], abs=1e-6), (name, out)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_winners_settings_say_how_experts_are_laid_out(strategy, tmp_path):
    import json

    from paratune.out.export import export_winner

    plan = load_plan_dict({**MOE, "num_workers": 4, "strategy": strategy, "ep": 2})
    export_winner(plan, tmp_path, {"label": "x"})
    settings = json.loads((tmp_path / f"{strategy}.json").read_text())["expert_parallel"]
    assert (settings["ep"], settings["expert_dp"], settings["dp"], settings["mesh_shape"]) == (2, 2, 4, [1, 2, 2, 1])
    assert ("fully_shard" in settings["expert_gradients"]) == (strategy == "fsdp")
    plain = load_plan_dict({**MOE, "num_workers": 4, "strategy": strategy})
    export_winner(plain, tmp_path / "plain", {"label": "x"})
    assert "expert_parallel" not in json.loads((tmp_path / "plain" / f"{strategy}.json").read_text())
