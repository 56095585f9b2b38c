"""`activation_checkpointing: selective_op`, torchtitan's op-level selective checkpointing (issue 55
item 4): the policy's decisions, the memory model (traced and formula) against the real trace
and against MemTracker (the bytes a real forward keeps, between full and paratune's `selective`:
tests/test_recompute_compile.py), a sweep space that holds it, and loss parity on 2 real gloo
processes under DDP, FSDP2, DeepSpeed ZeRO-2 and tp + sequence parallelism (whose all-gathers the
policy recomputes).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import BASE_PLAN, traced_as_real
from gloo_harness import batch_result, one_torch_thread, reference_for, run_named_batch  # noqa: F401 (fixture)
from tiers import cases, wanted

from paratune.config.plan import PlanError, load_plan_dict
from paratune.costs.activations import (_formula_coefficients, _traced_coefficients,
                                        activation_coefficients)
from paratune.costs.memory import estimate_memory
from paratune.model.build import build_config, build_model, config_key
from paratune.model.shapes import mlp_width, model_shape
from paratune.parallel import recompute
from paratune.sweep.parity import max_loss_difference

MUST, AGAIN = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE, torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
aten, c10d = torch.ops.aten, torch.ops._c10d_functional
MODEL = {"model": "tiny-llama", "model_overrides": {"hidden_size": 64, "num_hidden_layers": 2}}


def _plan(**fields):
    return load_plan_dict({**BASE_PLAN, **MODEL, "seed": 7, **fields})


# --------------------------------------------------------------------------- the lever and its policy
def test_the_value_is_a_lever_value_with_its_label_and_sets_every_block():
    from paratune.out.tables import strategy_label

    plan = _plan(activation_checkpointing="selective_op")
    assert strategy_label(plan.to_dict()).split().count("sac/op") == 1
    assert recompute.checkpoint_settings(plan) == ("selective_op", 1)
    model = build_model(build_config(plan.model, {**plan.model_overrides, "num_hidden_layers": 3}), seed=0)
    recompute.apply_checkpointing(model, plan)
    assert recompute.checkpointed_blocks(model) == [True] * 3
    with pytest.raises(PlanError, match="checkpoint_every: 3 is used only with activation_checkpointing 'layers', "
                                        "got 'selective_op'"):
        _plan(activation_checkpointing="selective_op", checkpoint_every=3)


def test_the_policy_recomputes_every_second_matmul_and_keeps_attention_reduce_scatter_and_max():
    policy = recompute.op_policy()
    assert [policy(None, op) for op in (aten.mm.default, aten.mm.default, aten.addmm.default, aten.mm.default,
                                        aten.addmm.default)] == [MUST, AGAIN, MUST, AGAIN, MUST]
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_cudnn_attention.default, aten.max.default,
               c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default):
        assert policy(None, op) is MUST, op
    for op in (aten.silu.default, aten.mul.Tensor, aten.bmm.default, c10d.all_gather_into_tensor.default,
               c10d.all_reduce.default, c10d.wait_tensor.default):
        assert policy(None, op) is AGAIN, op
    assert recompute.op_policy()(None, aten.mm.default) is MUST  # a fresh policy counts from its first matmul
    assert recompute.op_context_fn() is recompute.op_context_fn()  # one object: a compiled block's guard


def test_a_llama_block_keeps_q_v_gate_down_and_attention():
    """On a real Llama block: the 7 projections in dispatch order q, k, v, o, gate, up, down; the
    policy keeps q, v, gate, down (by their output widths) and recomputes k, o, up."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    config = build_config("tiny-llama", {"num_hidden_layers": 1})
    model = build_model(config, seed=0)
    inner, seen = recompute.op_policy(), []

    def watching(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN202 - torch's policy signature
        decision = inner(ctx, func, *args, **kwargs)
        if func in recompute.OP_POLICY_MATMULS:
            seen.append((ctx.op_output.shape[-1], decision))
        return decision

    x = torch.randn(2, 16, config.hidden_size, requires_grad=True)
    position = model.model.rotary_emb(x, torch.arange(16)[None].expand(2, -1))
    block = model.model.layers[0]
    checkpoint(lambda h: block(h, position_embeddings=position), x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(watching))
    shape = model_shape(_plan(model_overrides={}))
    h, kv, f = shape.hidden, shape.kv_heads * shape.head_dim, mlp_width(shape)
    assert seen[:7] == [(h, MUST), (kv, AGAIN), (kv, MUST), (h, AGAIN), (f, MUST), (f, AGAIN), (h, MUST)]


def test_the_time_models_prior_and_torchtitans_export_know_it():
    """A profile that never measured a selective_op block prices it by its prior (between
    selective and full); the torchtitan export names torchtitan's own option for it."""
    from typing import get_args

    from paratune.costs.profile import LEVER_PRIORS
    from paratune.levers import Checkpointing
    from paratune.out.export_tools import torchtitan_overrides

    priors = LEVER_PRIORS["checkpointing"]
    assert set(priors) == set(get_args(Checkpointing)) - {"layers"}  # layers: composed of none and full blocks
    assert priors["selective"] < priors["selective_op"] < priors["full"]
    _, notes = torchtitan_overrides(_plan(activation_checkpointing="selective_op", strategy="fsdp",
                                          fsdp={"sharding": "full"}))
    assert any("'selective' with selective_ac_option 'op'" in n for n in notes), notes


# --------------------------------------------------------------------------- the memory model
LLAMA_SHAPED = {"vocab_size": 2000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "tie_word_embeddings": False}


def test_the_trace_runs_the_real_policy_and_matches_real_tensors_at_every_phase():
    """Traced on fake tensors with the runtime's own policy: equal to the same micro-batch on real
    tensors at every phase; per block it keeps selective's bytes less those of k, o and up."""
    traced = traced_as_real("selective_op")
    selective = _traced_coefficients(config_key(build_config("tiny-llama")), "selective", "fp32", 2, 64)
    shape = model_shape(_plan(model_overrides={}))
    h, kv, f = shape.hidden, shape.kv_heads * shape.head_dim, mlp_width(shape)
    assert selective.per_layer - traced.per_layer == pytest.approx(4 * (h + kv + f))  # fp32 k, o, up


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_llama_shaped_model_is_predicted_below_selective_and_above_full(precision):
    """Traced and formula, per block and as the plan's activations: full < selective_op < selective,
    and the formula's step from selective is the traced one (k, o and up at 16 or 32 bits)."""
    plans = {m: load_plan_dict({"model": "tiny-llama", "model_overrides": LLAMA_SHAPED, "seq_len": 256,
                                "global_batch": 4, "micro_batch": 4, "num_workers": 1, "device": "cpu",
                                "precision": precision, "activation_checkpointing": m})
             for m in ("selective", "selective_op", "full")}
    for model in ("trace", "formula"):
        per_layer = {m: activation_coefficients(p, model).per_layer for m, p in plans.items()}
        assert per_layer["full"] < per_layer["selective_op"] < per_layer["selective"], (model, per_layer)
        held = {m: estimate_memory(p, model).activations for m, p in plans.items()}
        assert held["full"] < held["selective_op"] < held["selective"], (model, held)
    shape = model_shape(plans["selective"])
    step = (shape.hidden + shape.kv_heads * shape.head_dim + mlp_width(shape)) * (4 if precision == "fp32" else 2)
    formula = {m: _formula_coefficients(shape, m, precision, 256).per_layer for m in ("selective", "selective_op")}
    assert formula["selective"] - formula["selective_op"] == pytest.approx(step)


def _measured_step_peak_mib(mode: str) -> float:
    """MemTracker's peak over one training step (parameters, gradients and AdamW state already
    there), fp32, one process: bench/probes/levers/sac_check.py's measurement (git df094a6)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    plan = load_plan_dict({"model": "tiny-llama", "model_overrides": {**LLAMA_SHAPED, "num_key_value_heads": 4},
                           "seq_len": 256, "global_batch": 4, "micro_batch": 4, "num_workers": 1, "device": "cpu",
                           "activation_checkpointing": mode})
    model = build_model(build_config(plan.model, plan.model_overrides), seed=0)
    model.train()
    recompute.apply_checkpointing(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 2000, (4, 256), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot("peak").values()) / 2**20


def test_the_predicted_saving_is_memtrackers():
    """The probe's shape (hidden 256, 4 layers, 4 x 256 tokens, fp32): what selective_op saves
    against none, predicted (the traced model, paratune.costs.memory's peak), is MemTracker's
    measured saving to 0.15 MiB, the tolerance test_lever_costs holds selective to; selective,
    measured the same way, reproduces the probe's recorded saving (157.6 - 124.1 MiB)."""
    over = {**LLAMA_SHAPED, "num_key_value_heads": 4}
    plan = dict(model_overrides=over, seq_len=256, global_batch=4, micro_batch=4, precision="fp32",
                model="tiny-llama", num_workers=1, device="cpu")
    predicted = {m: estimate_memory(load_plan_dict({**plan, "activation_checkpointing": m})).total / 2**20
                 for m in ("none", "selective_op")}
    measured = {m: _measured_step_peak_mib(m) for m in ("none", "selective", "selective_op")}
    assert measured["none"] - measured["selective"] == pytest.approx(157.6 - 124.1, abs=0.15), measured
    assert predicted["none"] - predicted["selective_op"] == pytest.approx(
        measured["none"] - measured["selective_op"], abs=0.15), (predicted, measured)
    assert measured["selective_op"] < measured["selective"]


# --------------------------------------------------------------------------- a sweep space holds it
def test_a_space_sweeps_it_beside_the_other_modes():
    from paratune.sweep.space import SpaceError, space_from_dict

    fixed = {k: v for k, v in {**BASE_PLAN, **MODEL}.items() if k != "num_workers"}
    space = space_from_dict({"name": "sac", "fixed": {**fixed, "num_workers": 2},
                             "space": {"strategy": {"ddp": {}},
                                       "activation_checkpointing": ["none", "selective", "selective_op", "full"]}})
    modes = sorted(c.plan.activation_checkpointing for c in space.candidates)
    assert modes == ["full", "none", "selective", "selective_op"], modes
    with pytest.raises(SpaceError, match="selective-op"):
        space_from_dict({"name": "sac", "fixed": {**fixed, "num_workers": 2},
                         "space": {"strategy": {"ddp": {}}, "activation_checkpointing": ["selective-op"]}})


# --------------------------------------------------------------------------- loss parity on gloo
# 2 gloo processes, fp32, against the single-process reference without checkpointing (as
# test_recompute_compile's selective cases): the policy under each strategy's wrapper, and under
# tp + sequence parallelism, where it recomputes the all-gathers and keeps the reduce-scatters.
LAYOUTS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
           "zero2": {"strategy": "zero", "zero": {"stage": 2}}, "tp2-sp": {"tp": 2, "sequence_parallel": True},
           "tp2": {"tp": 2}, "pp2": {"pp": 2}}
PLANS = {f"{layout}-selective_op": {**fields, "activation_checkpointing": "selective_op"}
         for layout, fields in LAYOUTS.items()}
MATRIX = {"tp2-selective_op": "tp2-sp-selective_op (the policy with recomputed tp collectives)",
          "pp2-selective_op": "test_recompute_compile pp2-layers (checkpointing inside stages) and "
                              "ddp-selective_op (the policy)"}
TOLERANCE = 1e-5  # test_recompute_compile's CHECKPOINT_TOLERANCE


@functools.lru_cache(maxsize=None)
def _runs() -> dict:
    return run_named_batch({name: _plan(**fields) for name, fields in PLANS.items() if wanted(name, MATRIX)})


@pytest.mark.integration
@pytest.mark.parametrize("name", cases(PLANS, MATRIX))
def test_selective_op_trains_like_no_checkpointing(name):
    plan, out = batch_result(_runs()[name])
    reference = reference_for(load_plan_dict({**plan.to_dict(), "activation_checkpointing": "none"}))
    assert max_loss_difference(out["losses"], reference) < TOLERANCE
