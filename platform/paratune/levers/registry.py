"""The lever registry: what a lever declares, and the functions that iterate every registered one.

A lever is one module in this package (checkpointing, compile, float8, loss, async_tp) that builds a
`Lever` and registers it. Everything that handles levers goes through the functions here, in
registration order: the Plan's and the space's fields (paratune.config.plan, paratune.sweep.space), the rules
(`check_levers`), the device refusals (`device_refusal`), the plan's label (paratune.out.tables), the
roofline's hooks (`compute_time_factor`, `tp_comm_hidden`, `extra_memory_bytes`: paratune.costs.estimate,
paratune.costs.timemodel, paratune.costs.memory), the exports' notes (paratune.out.export_tools) and the order the
workers apply them in (`applied_at`: paratune.parallel.runner). A new lever is one new module here,
plus its runtime code where it has some; a lever defined anywhere (a test's toy) works once
registered.

Torch-free and import-light: the config layer (the Plan) builds its fields from here. A lever's
runtime function is named as "module:function" and imported on the workers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# A paratune.config.plan.Plan; not imported, since the plan builds its lever fields from this registry.
Plan = Any

# Where on the workers a lever is applied (paratune.parallel.runner.apply_levers), in this order:
# before_layout: on the meta model before any layout (float8 linears, the loss's form on the head);
# before_shard: on whole blocks, before ep and tp split them (checkpointing wraps each block);
# before_wrap: after tp, before DDP / FSDP2 / ZeRO wrap the model (compile, which under async TP
# needs the tp group).
APPLY_STAGES = ("before_layout", "before_shard", "before_wrap")


@dataclass(frozen=True)
class LeverField:
    """One plan field a lever owns: its type, default and pydantic constraints (ge, le, ...).
    `after`: the field it follows in the plan and in a space's enumeration (`ordered_fields`; None
    or a field not there: after those before it, in registration order). The order is what users
    see in plan files and the order candidates are enumerated in, so it stays put as levers move."""

    name: str
    annotation: Any
    default: Any
    doc: str
    constraints: dict[str, Any] = field(default_factory=dict)
    after: str | None = None


def _no_rules(plan: Plan) -> None:
    return None


def _runs_anywhere(plan: Plan, gpu: str | None, has_fp8: bool) -> str | None:
    return None


def _no_label(plan: dict) -> str | None:
    return None


def _unchanged(plan: Plan) -> float:
    return 1.0


def _nothing_hidden(plan: Plan) -> float:
    return 0.0


def _no_bytes(plan: Plan, shape: Any) -> float:
    return 0.0


def _no_notes(plan: Plan, tool: str) -> list[str]:
    return []


@dataclass(frozen=True)
class Lever:
    """What one lever declares. Every hook has a neutral default, so a lever says only what it changes.

    - fields: the plan fields it owns (each owned by exactly one lever, or by the Plan's core).
    - rules(plan): raises ValueError naming the field, the value and what is allowed, on every device.
    - device_refusal(plan, gpu, has_fp8): why the cluster's device cannot run it (gpu None: CPU workers).
    - label(plan_dict) and label_rank: its part of the plan's short label, and where that part sits
      among the label's parts (paratune.out.tables.LABEL_RANKS for the core's).
    - compute_time_factor(plan): the roofline's ideal compute time is multiplied by it.
    - tp_comm_hidden(plan): the share of the tp collectives it hides (the largest share counts).
    - extra_memory_bytes(plan, shape): bytes a rank holds beyond the memory model's terms.
    - export_notes(plan, tool): what a tool's exported config cannot express of it ("accelerate",
      "hf", "torchtitan").
    - apply: (stage, "module:function") pairs; the function is called as f(model, plan, place) on
      the workers (place: paratune.parallel.runner.WorkerPlace).
    - extra: the `paratune[...]` extra (paratune.config.extras.EXTRAS) its fields need off their defaults.
    """

    name: str
    doc: str
    fields: tuple[LeverField, ...]
    rules: Callable[[Plan], None] = _no_rules
    device_refusal: Callable[[Plan, str | None, bool], str | None] = _runs_anywhere
    label: Callable[[dict], str | None] = _no_label
    label_rank: int = 1000
    compute_time_factor: Callable[[Plan], float] = _unchanged
    tp_comm_hidden: Callable[[Plan], float] = _nothing_hidden
    extra_memory_bytes: Callable[[Plan, Any], float] = _no_bytes
    export_notes: Callable[[Plan, str], list[str]] = _no_notes
    apply: tuple[tuple[str, str], ...] = ()
    extra: str | None = None

    def off_default(self, plan: Any) -> LeverField | None:
        """Its first field the plan sets off the field's default (None: the lever is off)."""
        return next((f for f in self.fields if getattr(plan, f.name) != f.default), None)

    def __post_init__(self) -> None:
        for stage, target in self.apply:
            if stage not in APPLY_STAGES or ":" not in target:
                raise ValueError(f"lever {self.name}: apply ({stage!r}, {target!r}); allowed: a stage in "
                                 f"{APPLY_STAGES} and 'module:function'")


_REGISTERED: list[Lever] = []


def register(lever: Lever) -> Lever:
    """Add a lever (after those registered before it). A field another lever owns is refused."""
    owned = {f.name: other.name for other in _REGISTERED for f in other.fields}
    for f in lever.fields:
        if f.name in owned:
            raise ValueError(f"lever {lever.name}: field {f.name!r} is owned by lever {owned[f.name]!r}")
    if any(other.name == lever.name for other in _REGISTERED):
        raise ValueError(f"lever {lever.name}: already registered")
    _REGISTERED.append(lever)
    return lever


def unregister(name: str) -> None:
    """Remove a lever by name (a test's toy, when the test ends)."""
    _REGISTERED[:] = [lever for lever in _REGISTERED if lever.name != name]


def levers() -> tuple[Lever, ...]:
    """Every registered lever, in registration order."""
    return tuple(_REGISTERED)


def lever_fields() -> tuple[LeverField, ...]:
    return tuple(f for lever in _REGISTERED for f in lever.fields)


def ordered_fields(base: list[str]) -> list[str]:
    """`base` (core field names) with every lever field placed: first those without an anchor among
    `base` and the lever fields, appended in registration order, then the anchored ones, each right
    after its anchor (the plan: base [], the lever block; a space: its core sweepable fields)."""
    fields = lever_fields()
    known = set(base) | {f.name for f in fields}
    out = list(base)
    out += [f.name for f in fields if f.after is None or f.after not in known]
    for f in fields:
        if f.after is not None and f.after in known:
            out.insert(out.index(f.after) + 1 if f.after in out else len(out), f.name)
    return out


def owner_of(field_name: str) -> Lever | None:
    """The lever that owns a plan field; None for the Plan's core fields."""
    return next((lever for lever in _REGISTERED if any(f.name == field_name for f in lever.fields)), None)


def check_levers(plan: Plan) -> None:
    """Every lever's rules that hold on every device; the first broken one raises ValueError."""
    for lever in _REGISTERED:
        lever.rules(plan)


def device_refusal(plan: Plan, gpu: str | None, has_fp8: bool) -> str | None:
    """Why the plan's levers cannot run on this device (None: they can). `gpu`: the GPU model the
    workers get, None for CPU workers; `has_fp8`: the device table's word on FP8 tensor cores."""
    for lever in _REGISTERED:
        reason = lever.device_refusal(plan, gpu, has_fp8)
        if reason:
            return reason
    return None


def lever_labels(plan: dict) -> list[tuple[int, str]]:
    """(rank, part) of every lever's label part for a plan dict (what a label shows of it)."""
    return [(lever.label_rank, part) for lever in _REGISTERED if (part := lever.label(plan))]


def compute_time_factor(plan: Plan) -> float:
    """The product of the levers' factors on the ideal compute time."""
    factor = 1.0
    for lever in _REGISTERED:
        factor *= lever.compute_time_factor(plan)
    return factor


def tp_comm_hidden(plan: Plan) -> float:
    """The share of the tp collectives the plan's levers hide (the largest one's)."""
    return max((lever.tp_comm_hidden(plan) for lever in _REGISTERED), default=0.0)


def extra_memory_bytes(plan: Plan, shape: Any) -> float:
    """Bytes a rank holds for the levers beyond the memory model's own terms."""
    return sum(lever.extra_memory_bytes(plan, shape) for lever in _REGISTERED)


def export_notes(plan: Plan, tool: str) -> list[str]:
    """What `tool`'s exported config cannot express of the plan's levers."""
    return [note for lever in _REGISTERED for note in lever.export_notes(plan, tool)]


def applied_at(stage: str) -> list[str]:
    """The runtime functions ("module:function") of a stage, in registration order."""
    if stage not in APPLY_STAGES:
        raise ValueError(f"stage {stage!r}; allowed: {APPLY_STAGES}")
    return [target for lever in _REGISTERED for where, target in lever.apply if where == stage]
