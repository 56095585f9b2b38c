"""The lever registry (paratune.levers): every Plan field is owned by exactly one lever or by the
Plan's core, and a lever defined here, in this file only, is validated, labelled, refused, priced,
exported and applied on the workers by the product's own functions. The existing levers moved into
the registry without changing what users see: the plan file's field order, the space's enumeration
order, the labels and the order rules are checked in are held to what they were before."""

import pytest
import torch
from torch import nn

from paratune.config import extras
from paratune.config.devices import get_device
from paratune.costs.estimate import compute_seconds
from paratune.out.export_tools import accelerate_config
from paratune.levers import (APPLY_STAGES, Lever, LeverField, applied_at, device_refusal, lever_fields, levers,
                             owner_of, register, unregister)
from paratune.costs.memory import estimate_memory
from paratune.parallel.runner import WorkerPlace, apply_levers
from paratune.config.plan import Plan, PlanCore, PlanError, load_plan_dict, plan_class
from paratune.sweep.space import SWEEPABLE
from paratune.out.tables import strategy_label

# What these were before the registry (paratune 2026-12-06, 8a82517), read from that tree.
PLAN_FIELD_ORDER_BEFORE = [
    "model", "model_overrides", "data", "seq_len", "global_batch", "micro_batch", "grad_accum", "num_workers", "tp",
    "pp", "pp_schedule", "sequence_parallel", "cp", "ep", "gpus_per_node", "exclusive_nodes", "strategy", "ddp",
    "fsdp", "zero", "peft", "activation_checkpointing", "checkpoint_every", "compile", "float8", "float8_all_gather",
    "loss", "async_tp", "precision", "grad_clip", "optimizer", "cpus_per_worker", "lr", "weight_decay", "env",
    "warmup_steps", "measure_steps", "seed", "device", "comm_timeout_s", "trial_timeout_s", "profile_comm",
    "track_memory"]
SWEEPABLE_BEFORE = ("micro_batch", "activation_checkpointing", "precision", "tp", "pp", "cp", "ep", "pp_schedule",
                    "sequence_parallel", "checkpoint_every", "compile", "float8", "float8_all_gather", "loss", "async_tp")


def test_every_plan_field_is_owned_by_exactly_one_lever_or_the_core():
    core = set(PlanCore.model_fields)
    owned = [f.name for f in lever_fields()]
    assert len(owned) == len(set(owned)), "a field owned by two levers"
    assert not core & set(owned), f"fields both core and a lever's: {core & set(owned)}"
    assert set(Plan.model_fields) == core | set(owned)
    assert {owner_of(name).name for name in owned} == {lever.name for lever in levers()}
    assert owner_of("tp") is None and owner_of("float8").name == "float8"
    with pytest.raises(ValueError, match="field 'compile' is owned by lever 'compile'"):
        register(Lever(name="second_compile", doc="", fields=(LeverField("compile", bool, False, ""),)))
    assert [lever.name for lever in levers()] == ["checkpointing", "float8", "compile", "loss", "async_tp"]


def test_what_users_see_of_the_existing_levers_did_not_move():
    plan = load_plan_dict({"num_workers": 4, "tp": 2, "precision": "bf16", "strategy": "fsdp", "compile": True,
                           "activation_checkpointing": "layers", "checkpoint_every": 3, "loss": "vocab_parallel",
                           "float8": "tensorwise", "float8_all_gather": True, "global_batch": 16, "micro_batch": 8})
    assert list(plan.to_dict()) == PLAN_FIELD_ORDER_BEFORE
    assert list(plan.to_yaml().splitlines()[0].split(":")[:1]) == ["model"]
    assert SWEEPABLE == SWEEPABLE_BEFORE
    assert strategy_label(plan.to_dict()) == "fsdp:full mb8x1 tp2 dp2 ckpt/3 bf16 fp8:tensorwise+ag(partial 26%) compiled vp-loss"
    async_plan = load_plan_dict({"num_workers": 4, "tp": 2, "precision": "bf16", "async_tp": True, "compile": True,
                                 "sequence_parallel": True, "activation_checkpointing": "selective", "device": "cuda",
                                 "global_batch": 16, "micro_batch": 8, "data": {"loader_workers": 2}})
    assert strategy_label(async_plan.to_dict()) == "ddp mb8x1 tp2+sp dp2 sac bf16 compiled async-tp loader2x2"
    # the rules in their old order: with ZeRO-3, compile and float8 both broken, float8's is the plan's error
    # (a space counts its removed plans by the first broken rule)
    with pytest.raises(PlanError, match="float8: 'tensorwise' with strategy 'zero'"):
        load_plan_dict({"strategy": "zero", "zero": {"stage": 3}, "compile": True, "precision": "bf16",
                        "float8": "tensorwise", "micro_batch": 8, "global_batch": 16})
    # the workers' order: float8 and the loss form on meta, checkpointing before tp, compile after it
    assert [applied_at(stage) for stage in APPLY_STAGES] == [
        ["paratune.parallel.float8:apply_lever", "paratune.parallel.loss:apply_lever"],
        ["paratune.parallel.recompute:apply_lever"], ["paratune.parallel.compile:apply_lever"]]


# ---- a toy lever, defined here only ------------------------------------------------------------

TOY_REASON = "toy fusion needs micro_batch >= 2 (it fuses pairs of sequences)"
APPLIED: list[tuple[str, int, WorkerPlace]] = []


def _toy_rules(plan) -> None:
    if plan.toy_fusion > 0 and plan.micro_batch < 2:
        raise ValueError(f"toy_fusion: {plan.toy_fusion} with micro_batch {plan.micro_batch}: {TOY_REASON}; "
                         "allowed: toy_fusion 0, or micro_batch >= 2")


def _toy_refusal(plan, gpu, has_fp8) -> str | None:
    if plan.toy_fusion > 0 and gpu is None:
        return f"toy_fusion: {plan.toy_fusion} on CPU workers: a CUDA kernel; allowed: 0 on CPU"
    return None


def toy_apply(model: nn.Module, plan, place: WorkerPlace) -> None:
    APPLIED.append((type(model).__name__, plan.toy_fusion, place))


TOY = Lever(
    name="toy_fusion",
    doc="a test's lever: fuses pairs of sequences (nothing real)",
    fields=(LeverField("toy_fusion", int, 0, "fusion depth", {"ge": 0, "le": 4}),),
    rules=_toy_rules,
    device_refusal=_toy_refusal,
    label=lambda plan: f"toy{plan['toy_fusion']}" if plan.get("toy_fusion") else None,
    label_rank=85,  # between bf16 (80) and float8 (90)
    compute_time_factor=lambda plan: 0.5 if plan.toy_fusion else 1.0,
    extra_memory_bytes=lambda plan, shape: 2**30 * plan.toy_fusion,
    export_notes=lambda plan, tool: [f"{tool}: toy_fusion {plan.toy_fusion} not expressed here"] if plan.toy_fusion else [],
    apply=(("before_wrap", f"{__name__}:toy_apply"),),
    extra="float8",  # torchao's extra stands in for the toy's package
)


@pytest.fixture
def toy_plan_type():
    register(TOY)
    try:
        yield plan_class()
    finally:
        unregister(TOY.name)
    assert "toy_fusion" not in [f.name for f in lever_fields()]


def _toy(plan_type, **fields):
    base = {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2, "precision": "bf16"}
    return load_plan_dict({**base, **fields}, plan_type=plan_type)


def test_a_toy_lever_is_validated_labelled_refused_priced_exported_and_applied(toy_plan_type, monkeypatch):
    plan = _toy(toy_plan_type, toy_fusion=2)
    assert plan.toy_fusion == 2 and _toy(toy_plan_type).toy_fusion == 0
    # validated: its type and bounds (pydantic, naming the field), its rule (naming field, value, allowed)
    with pytest.raises(PlanError, match="toy_fusion: got 9"):
        _toy(toy_plan_type, toy_fusion=9)
    with pytest.raises(PlanError, match=r"toy_fusion: 1 with micro_batch 1: toy fusion needs .* allowed: toy_fusion 0"):
        _toy(toy_plan_type, toy_fusion=1, micro_batch=1)
    with pytest.raises(PlanError, match="unknown field"):  # the module's Plan, built before it, does not take it
        load_plan_dict({"toy_fusion": 1})
    assert plan.with_changes(micro_batch=4).toy_fusion == 2  # a changed plan keeps its class
    monkeypatch.setitem(extras._found, extras.EXTRAS["float8"][0], False)  # its extra not installed: refused, named
    with pytest.raises(PlanError, match=r"toy_fusion: 2 needs torchao, .* allowed without it: toy_fusion 0"):
        _toy(toy_plan_type, toy_fusion=2)
    _toy(toy_plan_type)  # off, it needs nothing
    monkeypatch.undo()
    # labelled, at its rank; the plan file keeps it in the levers' block
    assert strategy_label(plan.to_dict()) == "ddp mb2x2 bf16 toy2"
    assert list(plan.to_dict()).index("toy_fusion") == list(plan.to_dict()).index("async_tp") + 1
    # refused on CPU workers, not on a GPU
    assert "toy_fusion: 2 on CPU workers" in device_refusal(plan, None, False)
    assert device_refusal(plan, "H100", True) is None
    # priced: the roofline's compute time halved, a GiB more a rank in the memory model
    h100 = get_device("h100-80gb")
    off = _toy(toy_plan_type)
    assert compute_seconds(plan, h100) == pytest.approx(0.5 * compute_seconds(off, h100))
    assert estimate_memory(plan, "formula").total - estimate_memory(off, "formula").total == pytest.approx(2 * 2**30)
    # exported: what the tool cannot express is a note
    assert "accelerate: toy_fusion 2 not expressed here" in accelerate_config(plan)[1]
    # applied on the workers at its stage, after the levers registered before it
    assert applied_at("before_wrap")[-1] == f"{__name__}:toy_apply"
    APPLIED.clear()
    # with the rank's place: async TP's compile needs the device and the tp group's name (a GPU-only
    # path; on CPU the property it relies on, that the place reaches the lever's runtime, is checked)
    place = WorkerPlace(torch.device("cpu"), "tp-group-0")
    apply_levers(nn.Linear(2, 2, device="meta"), plan, "before_wrap", place)
    assert APPLIED == [("Linear", 2, place)]
