"""LoRA adapters (paratune.model.adapters): deterministic init, frozen base, preflight refusals, and ddp /
fsdp / ZeRO-1-3 losses equal to the single-process reference with the base unchanged and the
adapters trained."""

import math

import pytest
import torch
from conftest import BASE_PLAN
from gloo_harness import one_torch_thread, reference_for, run_plans_on_gloo  # noqa: F401 (fixture)

from paratune.model.adapters import adapter_refusal, build_adapted_model
from paratune.model.materialize import module_seed
from paratune.model.build import build_config
from paratune.parallel.runner import make_optimizer
from paratune.sweep.parity import max_loss_difference
from paratune.config.plan import PlanError, load_plan_dict

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_adapter_init_is_peft_default_seeded_and_only_adapters_train():
    plan = load_plan_dict({**BASE_PLAN, "peft": LORA})
    config = build_config(plan.model)
    model = build_adapted_model(config, plan)
    again = build_adapted_model(config, plan)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name  # the same values however often (and wherever) built
        assert p.requires_grad == (".lora_" in name), name
    name = "model.layers.0.self_attn.q_proj.lora_A.default"
    expected = torch.empty(4, config.hidden_size)
    torch.nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=torch.Generator().manual_seed(module_seed(0, name)))
    assert torch.equal(model.get_submodule(name).weight, expected)
    assert not model.get_submodule("model.layers.0.self_attn.q_proj.lora_B.default").weight.any()
    optimizer = make_optimizer(model.parameters(), plan)
    stepped = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    layers = config.num_hidden_layers
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    assert stepped == layers * 4 * (2 * config.hidden_size + config.hidden_size + kv)  # A (r x in) + B (out x r)


@pytest.mark.parametrize("changes, field", [
    ({"num_workers": 2, "pp": 2}, "peft: LoRA with pp 2"),
    ({"num_workers": 2, "tp": 2, "strategy": "zero"}, "peft: LoRA with ZeRO and tp 2"),
    ({"num_workers": 2, "tp": 2, "peft": {"target_modules": ["q_proj", "lm_head"]}}, "adapts a module outside the decoder blocks"),
    ({"peft": {"target_modules": ["nope"]}}, "peft.target_modules: ['nope']"),
    ({"peft": {"target_modules": ["embed_tokens"]}}, "allowed: nn.Linear layers only"),
])
def test_preflight_refuses_what_lora_cannot_run(changes, field):
    from paratune.checks.preflight import check_plan_against_model

    plan = load_plan_dict({**BASE_PLAN, "peft": LORA, **changes})
    assert field in (adapter_refusal(plan) or "")
    with pytest.raises(PlanError, match="allowed"):
        check_plan_against_model(plan)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: its DTensor shard, its ZeRO-3 partition, or itself."""
    local = t.to_local() if hasattr(t, "to_local") else getattr(t, "ds_tensor", t)
    return local.detach().clone()


def lora_measure(plan, rank, world, local_world, device):
    """train_and_measure, with the runner it builds kept: base and adapter values before and after."""
    import torch.distributed as dist

    import paratune.parallel as par
    from paratune.trial.worker import train_and_measure

    built, original = [], par.build_runner

    def recording(*args, **kwargs):
        runner = original(*args, **kwargs)
        built.append((runner, {n: _local(p) for n, p in runner.model.named_parameters()}))
        return runner

    par.build_runner = recording
    try:
        out = train_and_measure(plan, rank, world, local_world, device)
    finally:
        par.build_runner = original
    runner, before = built[0]
    params = dict(runner.model.named_parameters())
    base_same = all(torch.equal(_local(p), before[n]) for n, p in params.items() if not p.requires_grad)
    trainable = [n for n, p in params.items() if p.requires_grad]
    adapters_moved = all(not torch.equal(_local(params[n]), before[n]) for n in trainable if "lora_B" in n)
    flags = torch.tensor([float(base_same), float(adapters_moved), float(all(".lora_" in n for n in trainable))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {**out, "base_unchanged": bool(flags[0]), "adapters_trained": bool(flags[1]),
            "only_adapters_trainable": bool(flags[2]), "trainable": len(trainable)}


LAYOUTS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
           **{f"zero{stage}": {"strategy": "zero", "zero": {"stage": stage}} for stage in (1, 2, 3)},
           # bf16 ZeRO-3: the adapters made in the partitioned base's bf16, DeepSpeed's fp32 master
           "zero3-bf16": {"strategy": "zero", "zero": {"stage": 3}, "precision": "bf16"},
           # tp 2: the adapters laid out beside the sharded base (paratune.parallel.tp.adapted_plan)
           "tp2": {"strategy": "ddp", "tp": 2, "peft": {**LORA, "target_modules": "all-linear"}},
           "tp2-sp": {"strategy": "ddp", "tp": 2, "sequence_parallel": True, "peft": {**LORA, "target_modules": "all-linear"}}}
TOLERANCE = {"zero3-bf16": 1e-3}  # bf16 weights against the fp32 reference (seen: 1.6e-4)


@pytest.mark.integration
def test_lora_under_ddp_fsdp_and_zero_matches_the_reference_and_trains_only_adapters():
    plans = [load_plan_dict({**BASE_PLAN, "peft": LORA, **case}) for case in LAYOUTS.values()]
    outs = run_plans_on_gloo(plans, measure="test_adapters:lora_measure")
    for name, plan, out in zip(LAYOUTS, plans, outs):
        reference = reference_for(plan)  # one per distinct training (the adapters' targets)
        assert max_loss_difference(out["losses"], reference) < TOLERANCE.get(name, 1e-5), (name, out["losses"], reference)
        assert out["base_unchanged"] and out["adapters_trained"] and out["only_adapters_trainable"], (name, out)
        assert out["trainable"] > 0, name


def test_memtracker_measures_a_lora_step_without_the_frozen_weights_gradients_and_adam_states():
    """torch's MemTracker puts a gradient hook on every parameter and torch refuses one on a frozen
    parameter: the trial's tracked peak (step_memory.tracked_peak_bytes) must still measure a LoRA step,
    and it must be lower than the full fine-tune's by at least the frozen weights' fp32 gradients
    and one of Adam's two states (the three copies LoRA does not keep, less what the peak's
    phase hides)."""
    from paratune.config.data import TokenBatches
    from paratune.parallel.runner import StepRunner, make_optimizer
    from paratune.trial.step_memory import tracked_peak_bytes

    peaks, frozen = {}, 0
    for name, peft in (("lora", {"method": "lora", "r": 8, "alpha": 16}), ("full", None)):
        plan = load_plan_dict({**BASE_PLAN, "num_workers": 1, "peft": peft})
        config = build_config(plan.model)
        model = build_adapted_model(config, plan)
        runner = StepRunner(model, make_optimizer(model.parameters(), plan), plan, torch.device("cpu"))
        micro = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed) \
            .micro_batches(0, 0, 1, plan.micro_batch)
        runner.train_step(micro)  # the optimizer's states exist, as in the trial's extra step
        peaks[name], method = tracked_peak_bytes(runner, micro)
        assert method.startswith("torch MemTracker"), (name, method)
        if peft is not None:
            frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 0 and peaks["full"] - peaks["lora"] >= 2 * 4 * frozen, (peaks, frozen)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], "all-linear"])
def test_adapter_counts_are_the_adapted_models_trainable_parameters(targets):
    """The memory and time models' adapter counts (one block's, counted on a one-block meta model)
    are the trainable parameters of the whole adapted model, block by block."""
    from paratune.model.adapters import adapter_counts
    from paratune.model.build import decoder_blocks

    plan = load_plan_dict({**BASE_PLAN, "peft": {"r": 4, "alpha": 8, "target_modules": targets}})
    model = build_adapted_model(build_config(plan.model), plan)
    counts = adapter_counts(plan)
    blocks = decoder_blocks(model)
    per_block = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks]
    assert per_block == [counts.per_block] * len(blocks) and counts.per_block > 0, (per_block, counts)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == counts.per_block * len(blocks) + counts.root
    assert counts.largest == max(p.numel() for p in trainable)
    assert adapter_counts(load_plan_dict(BASE_PLAN)) is None


def test_lora_memory_counts_only_the_adapters_gradients_and_optimizer_states():
    """Under LoRA the 8B one-node DDP plan keeps the base (its linears in bf16) but only the adapters'
    gradients and Adam states (the memory model's parts; the tracked-peak test checks the total)."""
    from paratune.model.adapters import adapter_counts
    from paratune.costs.memory import estimate_memory, model_states

    fixed = {"model": "llama3-8b", "seq_len": 2048, "global_batch": 16, "micro_batch": 1, "num_workers": 8,
             "strategy": "ddp", "precision": "bf16", "device": "cuda", "activation_checkpointing": "full"}
    full, lora = (load_plan_dict({**fixed, "peft": peft}) for peft in (None, {"r": 16, "alpha": 32}))
    counts = adapter_counts(lora)
    adapters = counts.per_block * 32 + counts.root
    states_full, states_lora = model_states(full), model_states(lora)
    assert states_lora.optimizer == 8 * adapters and states_lora.gradients == 4 * adapters
    # the fp32 base and adapters, less 2 bytes for every frozen linear parameter (kept in bf16)
    linears = counts.frozen_linear_per_block * 32 + counts.frozen_linear_root
    assert linears > 0.8 * 8e9 and states_lora.weights == states_full.weights + 4 * adapters - 2 * linears
    assert states_full.optimizer > 1000 * states_lora.optimizer
    est_full, est_lora = estimate_memory(full), estimate_memory(lora)
    assert est_lora.total < est_full.total - 0.9 * (states_full.optimizer + states_full.gradients), (est_full, est_lora)


def test_frozen_linears_in_bf16_give_autocasts_numbers_exactly():
    """A bf16 DDP LoRA plan keeps its frozen linears in bf16 (adapters.store_frozen_base): autocast
    would round their fp32 copies to the same bf16 at every matmul, so the loss and the adapters'
    gradients are bit for bit those of the fp32-stored base, at half the base's bytes."""
    from paratune.model.adapters import add_adapters, frozen_base_dtype, prepare_init, store_frozen_base
    from paratune.model.materialize import ModelInit, build_meta, materialize

    plan = load_plan_dict({**BASE_PLAN, "num_workers": 1, "precision": "bf16", "peft": LORA})
    assert frozen_base_dtype(plan) == torch.bfloat16
    assert frozen_base_dtype(load_plan_dict({**BASE_PLAN, "peft": LORA})) == torch.float32  # fp32 plan
    config = build_config(plan.model)
    reference = build_adapted_model(config, plan)
    model = add_adapters(build_meta(config), plan)
    store_frozen_base(model, plan)
    init = ModelInit(model, config, plan.seed)
    prepare_init(init, plan)
    materialize(model, init, torch.device("cpu"))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.float32 and dtypes["model.norm.weight"] == torch.float32
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert frozen < 0.75 * sum(p.numel() * 4 for p in reference.parameters() if not p.requires_grad)


def test_the_24gb_space_fits_a_7b_lora_and_rejects_its_full_fine_tune(tmp_path, capsys):
    """search_spaces/qwen2.5_7b_lora_1x24gb.yaml through `paratune plan` on one 24 GB L4: a DDP
    LoRA plan fits (its frozen linears in bf16); the same plans without `peft` do not, and say
    that the model's own states are what overflows."""
    import json

    from paratune.cli import main
    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate

    out = tmp_path / "plans.json"
    assert main(["plan", "search_spaces/qwen2.5_7b_lora_1x24gb.yaml", "--device", "l4-24gb", "--nodes", "1",
                 "--gpus-per-node", "1", "--json", str(out)]) == 0
    assert "in launch order" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["plan"]["strategy"] == "ddp" and r["plan"]["peft"]["r"] == 16 for r in fitting)
    assert all(r["predicted_peak_memory_gib"] <= 22 for r in fitting)
    assert all(r["predicted_weights_gib"] < 16 for r in fitting)  # 7.6B parameters: the linears at 2 bytes
    device = get_device("l4-24gb")
    for row in fitting:
        full = estimate(load_plan_dict({**row["plan"], "peft": None}), device)
        assert not full.fits and "weights+grads+optimizer" in full.overflow, full.overflow


def test_a_space_fixes_lora_and_does_not_sweep_it():
    import yaml

    from paratune.sweep.space import SpaceError, space_from_dict

    data = yaml.safe_load(open("search_spaces/qwen2.5_7b_lora_1x8.yaml"))
    assert space_from_dict(data).spec.fixed["peft"]["r"] == 16
    data["space"]["peft"] = [{"r": 8}, {"r": 64}]
    with pytest.raises(SpaceError, match=r"peft: .*training's meaning.*allowed: set it under fixed.peft"):
        space_from_dict(data)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_lora_states_partition_the_base_and_keep_only_the_adapters_master_and_moments(stage):
    """ZeRO under LoRA (8B, one node, bf16): the base's weights are held as under full fine-tuning
    (whole at stages 1/2, partitioned at 3), while gradients, the fp32 master and Adam's moments
    are the adapters' partitions only."""
    from paratune.model.adapters import adapter_counts
    from paratune.costs.memory import model_states

    fixed = {"model": "llama3-8b", "seq_len": 2048, "global_batch": 16, "micro_batch": 1, "num_workers": 8,
             "strategy": "zero", "zero": {"stage": stage}, "precision": "bf16", "device": "cuda"}
    full, lora = (load_plan_dict({**fixed, "peft": peft}) for peft in (None, {"r": 16, "alpha": 32}))
    counts = adapter_counts(lora)
    adapters = counts.per_block * 32 + counts.root
    states_full, states_lora = model_states(full), model_states(lora)
    held = 1 if stage < 3 else 8  # the ranks the weights are divided over
    assert states_lora.weights - states_full.weights == pytest.approx(2 * adapters / held, rel=1e-6)
    assert states_lora.optimizer == pytest.approx(12 * adapters / 8)  # fp32 master + 2 moments, partitioned
    assert states_lora.step_gradients == pytest.approx(4 * adapters / 8)
    assert states_full.optimizer > 500 * states_lora.optimizer


@pytest.mark.parametrize("layout", [{"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "zero", "zero": {"stage": 2}},
                                    {"strategy": "zero", "zero": {"stage": 3}}])
def test_lora_steps_and_reduces_only_the_adapters_while_zero3_still_gathers_the_base(layout):
    """The time model's optimizer step and the gradient traffic under LoRA are the adapters'; the
    parameter gathers of FSDP2 and ZeRO-3 still carry the frozen base (every micro-batch)."""
    from paratune.model.adapters import adapter_counts
    from paratune.costs.estimate import comm_volume
    from paratune.costs.profile import optimizer_params

    fixed = {"model": "llama3-8b", "seq_len": 2048, "global_batch": 16, "micro_batch": 1, "num_workers": 8,
             "precision": "bf16", "device": "cuda", **layout}
    full, lora = (load_plan_dict({**fixed, "peft": peft}) for peft in (None, {"r": 16, "alpha": 32}))
    counts = adapter_counts(lora)
    adapters = counts.per_block * 32 + counts.root
    sharded = 1 if layout["strategy"] == "ddp" else 8
    assert optimizer_params(lora) == int(adapters / sharded)
    assert optimizer_params(full) > 1000 * optimizer_params(lora)
    comm_full, comm_lora = comm_volume(full).dp, comm_volume(lora).dp
    gathers_base = layout["strategy"] == "fsdp" or layout.get("zero", {}).get("stage") == 3
    if gathers_base:  # the base's gathers stay; only the gradients' reduce-scatter shrinks
        assert 0.3 * comm_full < comm_lora < 0.75 * comm_full, (comm_full, comm_lora)
    else:
        assert comm_lora < comm_full / 1000, (comm_full, comm_lora)


def test_the_profiles_lora_block_is_built_with_the_frozen_base_a_trial_runs():
    """The calibrated profile times a LoRA plan's block as a trial runs it: peft's adapters on the
    block, the base frozen (its backward computes no weight gradients), only the adapters trained."""
    from paratune.costs.profile import plan_blocks, profile_requests_for
    from paratune.cluster.profiling import _build_levered, lever_plan

    plan = load_plan_dict({**BASE_PLAN, "num_workers": 1, "peft": LORA})
    (request,) = profile_requests_for([plan])
    (shape,) = plan_blocks(plan)
    _, _, model = _build_levered(request, 1, 1, lever_plan(request, shape), torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable
    assert {n.split(".")[-4] for n in trainable if "lora_A" in n} == {"q_proj", "v_proj"}  # ...q_proj.lora_A.default.weight


def test_adapters_added_to_a_built_model_follow_its_base_layers_dtype_on_the_given_device():
    """What ZeRO-3's LoRA relies on (parallel.zero.build_zero3): adapters added after zero.Init are
    made on the trial's device (cuda on a GPU: the `torch.device` context) in the base layers'
    dtype (bf16 under ZeRO's bf16, peft's own placement), so DeepSpeed partitions them as it does
    the base. On CPU the dtype rule is what can be seen; the device is the context's."""
    from paratune.model.adapters import add_adapters
    from paratune.model.materialize import build_meta

    config = build_config("tiny-llama")
    model = build_meta(config).to_empty(device="cpu").to(torch.bfloat16)
    add_adapters(model, load_plan_dict({**BASE_PLAN, "peft": LORA}), torch.device("cpu"))
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert adapters and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.requires_grad for p in adapters)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
