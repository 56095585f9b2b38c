"""Search spaces: YAML -> validated space -> the statically valid candidate plans.

A space file has a fixed part (Plan fields every trial shares, e.g. model, global batch,
workers) and a space part (the knobs to sweep, with strategy-conditional sub-spaces). The
structural knobs are enumerated and every combination is validated as a Plan, so a plan that
breaks a rule is never proposed; the sweep reports how many were removed and why.
Communication env choices carry no structural rule and are sampled independently.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from paratune.levers import lever_fields, ordered_fields
from paratune.config.plan import (
    absolute_local_paths,
    DDPOptions,
    FSDPOptions,
    Plan,
    PlanError,
    ZeroOptions,
    check_env,
    format_validation_error,
    load_plan_dict,
    read_yaml_mapping,
    unknown_field_message,
)

STRATEGY_OPTIONS: dict[str, type[BaseModel]] = {"ddp": DDPOptions, "fsdp": FSDPOptions, "zero": ZeroOptions}
# Plan fields that may be swept at the top level (besides strategy and env): the core's, and every
# lever's (paratune.levers), in the order candidates are enumerated.
CORE_SWEEPABLE = ("micro_batch", "precision", "tp", "pp", "cp", "ep", "pp_schedule", "sequence_parallel")
SWEEPABLE = tuple(ordered_fields(list(CORE_SWEEPABLE)))
# Fields the sweep owns: they may not be fixed, since the sweep sets them per trial. The
# SWEEPABLE ones and env may be fixed when the space does not sweep them (env: other keys).
SWEEP_OWNED = ("strategy", "ddp", "fsdp", "zero", "grad_accum")


class SpaceError(ValueError):
    """A space file that is wrong; names the file, the key path and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Objective(_Strict):
    metric: Literal["tokens_per_s_per_gpu"] = "tokens_per_s_per_gpu"
    # Per-rank peak memory budget; a plan measured above it is a failed trial (over_budget).
    memory_budget_gb: float | None = Field(None, gt=0)


class SearchSettings(_Strict):
    # calibrated: the plans predicted fastest by the step-time model (profiled on the cluster,
    # refitted on each trial) first, stopping when none left can win (paratune.sweep.stopping).
    algorithm: Literal["calibrated", "tpe", "random", "grid"] = "calibrated"
    trials: int = Field(12, ge=1, le=10_000)  # the budget: at most this many trials
    seed: int = 0
    # Stop a running trial whose first measured steps show it cannot reach the incumbent
    # (measure.TrialStopRule); it is recorded as stopped_early. Grid sweeps always measure fully.
    # calibrated: stop measuring once no unmeasured plan can win (paratune.sweep.stopping.SweepStopRule);
    # false spends the whole trial budget (plans predicted fastest first).
    stopping_rule: bool = True
    early_stop: bool = True
    early_stop_min_steps: int = Field(2, ge=1, le=100)
    # Measure plans with the same world size and env one after another in one worker group
    # (paratune.cluster.session), instead of launching workers for every trial.
    reuse_workers: bool = True
    # Noise-aware verdict: re-measure the top plans side by side before naming a winner.
    top_k: int = Field(3, ge=1, le=10)
    remeasure_rounds: int = Field(2, ge=0, le=10)


class EstimateSettings(_Strict):
    """The cost model's part in a sweep (paratune.costs.estimate)."""

    # Device of the table (`paratune plan --devices`), or auto: the cluster's GPU type, else "cpu".
    device: str = "auto"
    # Skip plans predicted over min(device memory, memory_budget_gb) by more than `margin`.
    skip_predicted_oom: bool = True
    margin: float = Field(0.05, ge=0.0, le=1.0)
    # The first trials measure the plans predicted fastest (then the searcher takes over).
    start_from_predicted: int = Field(2, ge=0, le=20)


def _knob_values(strategy: str, knob: str, choices: list[Any]) -> list[Any]:
    """A knob's choices checked by its options model, duplicates dropped: a choice no plan could
    take is the space's error (not a pruned combination), a string is replaced by what the plan
    reads ('5e8' -> 500000000, as PyYAML hands over `5e8`), so the sweep's points carry the number."""
    options = STRATEGY_OPTIONS[strategy]
    out: list[Any] = []
    seen: list[Any] = []
    for choice in choices:
        try:
            value = getattr(options.model_validate({knob: choice}), knob)
        except ValidationError as err:
            e = err.errors()[0]
            msg = e["msg"].removeprefix("Value error, ")
            raise ValueError(f"{strategy}.{knob}: {msg}" if e["type"] == "value_error"
                             else f"{strategy}.{knob}: got {choice!r}; {msg}") from None
        if value in seen:
            continue
        seen.append(value)
        # A number kept as written where it already equals the value (25 stays 25, not 25.0): the
        # candidate keys of ledgers written before stay the same, so --resume still finds them.
        out.append(value if isinstance(choice, str) or choice != value else choice)
    return out


class SpacePartCore(_Strict):
    """A space's swept part; the levers' lists are added from their registry (SpacePart)."""

    strategy: dict[str, dict[str, list[Any]]] = Field(default_factory=lambda: {"ddp": {}})
    micro_batch: list[int] | None = None
    precision: list[str] | None = None
    # Parallel degrees: a list, or "auto" for every factorization of the world size (the plan's
    # rules then remove what the model or the node size does not allow).
    tp: list[int] | Literal["auto"] | None = None
    pp: list[int] | Literal["auto"] | None = None
    cp: list[int] | Literal["auto"] | None = None  # context parallel (GPU clusters; long sequences)
    # Expert parallel (MoE models): experts split over ep of the dp ranks ("auto": every divisor).
    ep: list[int] | Literal["auto"] | None = None
    pp_schedule: list[str] | None = None
    sequence_parallel: list[bool] | None = None
    # Here: a list of choices for every lever field (paratune.levers), added by `space_part_class`.
    env: dict[str, list[str]] = Field(default_factory=dict)
    # The data loader (paratune.config.data.step_loader): worker processes and steps kept ready per worker.
    data: dict[Literal["loader_workers", "prefetch"], list[int]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _meaning_is_not_swept(cls, value: Any) -> Any:
        if isinstance(value, dict) and "peft" in value:
            raise ValueError("peft: what LoRA trains (its rank, alpha, targets) is the training's meaning, like the "
                             "global batch, not a speed knob; allowed: set it under fixed.peft, one per space")
        return value

    @field_validator("strategy")
    @classmethod
    def _known_strategies_and_knobs(cls, value: dict[str, dict[str, list[Any]]]) -> dict:
        if not value:
            raise ValueError("empty; allowed: one or more of ddp, fsdp, zero")
        for name, knobs in value.items():
            if name not in STRATEGY_OPTIONS:
                raise ValueError(f"unknown strategy '{name}'; allowed: {', '.join(STRATEGY_OPTIONS)}")
            allowed = list(STRATEGY_OPTIONS[name].model_fields)
            for knob, choices in (knobs or {}).items():
                if knob not in allowed:
                    raise ValueError(f"{name}.{knob}: unknown knob; allowed: {', '.join(allowed)}")
                if not isinstance(choices, list) or not choices:
                    raise ValueError(f"{name}.{knob}: must be a non-empty list of choices, got {choices!r}")
        return {name: {knob: _knob_values(name, knob, choices) for knob, choices in (knobs or {}).items()}
                for name, knobs in value.items()}

    @model_validator(mode="after")
    def _non_empty_lists(self) -> "SpacePartCore":
        for name in (*SWEEPABLE, "env", "data"):
            value = getattr(self, name)
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for key, choices in items:
                if choices is not None and len(choices) == 0:
                    path = f"{name}.{key}" if key else name
                    raise ValueError(f"{path}: empty list; allowed: one or more choices")
        return self


def space_part_class() -> type[SpacePartCore]:
    """SpacePart: the core's lists and one list of choices for every registered lever field. A
    Literal field's choices are strings here: each candidate plan checks them, naming the value."""
    def choice_type(annotation: Any) -> Any:
        return str if get_origin(annotation) is Literal else annotation

    types = {f.name: f.annotation for f in lever_fields()}
    fields = {name: (list[choice_type(types[name])] | None, None) for name in ordered_fields([])}
    return create_model("SpacePart", __base__=SpacePartCore, __module__=__name__, **fields)


SpacePart = space_part_class()


class SpaceFile(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    fixed: dict[str, Any] = Field(default_factory=dict)
    objective: Objective = Field(default_factory=Objective)
    space: SpacePart = Field(default_factory=SpacePart)
    search: SearchSettings = Field(default_factory=SearchSettings)
    estimate: EstimateSettings = Field(default_factory=EstimateSettings)

    @field_validator("fixed")
    @classmethod
    def _fixed_are_plan_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        allowed = [f for f in Plan.model_fields if f not in SWEEP_OWNED]
        for key in value:
            if key in SWEEP_OWNED:
                raise ValueError(f"{key}: set by the sweep, not fixed; put its choices under space.{key}")
            if key not in Plan.model_fields:
                raise ValueError(f"{key}: not a plan field; allowed: {', '.join(allowed)}")
        return value

    @model_validator(mode="after")
    def _fixed_or_swept_not_both(self) -> "SpaceFile":
        for name in SWEEPABLE:
            if name in self.fixed and getattr(self.space, name) is not None:
                raise ValueError(f"{name}: both fixed and swept; allowed: fixed.{name} or space.{name}, not both")
        both = set(self.fixed.get("env") or {}) & set(self.space.env)
        if both:
            raise ValueError(f"env.{sorted(both)[0]}: both fixed and swept; allowed: one of fixed.env or space.env")
        both = set(self.fixed.get("data") or {}) & set(self.space.data)
        if both:
            raise ValueError(f"data.{sorted(both)[0]}: both fixed and swept; allowed: one of fixed.data or space.data")
        return self


@dataclass(frozen=True)
class Candidate:
    """One statically valid point: the structural choices and the plan they make (env aside)."""

    choices: dict[str, Any]
    plan: Plan

    @property
    def key(self) -> str:
        return json.dumps(self.choices, sort_keys=True, default=str)


@dataclass
class Space:
    """A validated space: its file, the valid candidates and what static pruning removed."""

    source: Path | None
    spec: SpaceFile
    candidates: list[Candidate]
    total_combinations: int
    removed: Counter = field(default_factory=Counter)  # reason -> count
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one full message

    @property
    def env_choices(self) -> dict[str, list[str]]:
        return self.spec.space.env

    def plan_for(self, choices: dict[str, Any], env: dict[str, str]) -> Plan:
        base = next(c for c in self.candidates if c.key == json.dumps(choices, sort_keys=True, default=str))
        return base.plan.with_changes(env={**base.plan.env, **env}, grad_accum=base.plan.grad_accum)

    def env_grid(self) -> list[dict[str, str]]:
        keys = list(self.env_choices)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.env_choices[k] for k in keys))]

    def pruning_report(self) -> str:
        kept = len(self.candidates)
        lines = [f"static pruning: {self.total_combinations} combinations, {kept} valid, "
                 f"{self.total_combinations - kept} removed"]
        for reason, count in self.removed.most_common():
            example = self.examples.get(reason, "")
            lines.append(f"  - {count} x {reason}" + (f"  (e.g. {example})" if example else ""))
        return "\n".join(lines)


def _rule_of(message: str) -> str:
    """The rule a plan broke, without its numbers, so equal rules group together."""
    first = message.splitlines()[0].removeprefix("plan: ")
    head = first.split(";")[0]
    return re.sub(r"(?<![A-Za-z])-?\d+(\.\d+)?(e[+-]?\d+)?(?![A-Za-z])", "N", head)


def _config_of(plan: Plan, built: dict[str, Any]) -> Any:
    """The plan's model config, built once per model and overrides (a space's candidates share them);
    None where it cannot be built: the rules build it again and report the model's own error."""
    from paratune.model.build import build_config

    key = json.dumps([plan.model, plan.model_overrides], sort_keys=True, default=str)
    if key not in built:
        try:
            built[key] = build_config(plan.model, plan.model_overrides)
        except Exception:  # noqa: BLE001 - reported by the rule that needs the config, per candidate
            built[key] = None
    return built[key]


def enumerate_candidates(spec: SpaceFile, details: dict[str, str] | None = None
                         ) -> tuple[list[Candidate], int, Counter, dict[str, str]]:
    """Every structural combination (strategy, its knobs, shared knobs) with the fixed part,
    validated as one Plan and checked against the model (paratune.checks.preflight): what the family
    cannot do is pruned here. `details`, if given, gets each rule's first full message (with
    what is allowed), for the error of a space with no valid plan."""
    from paratune.config.model_config import ModelError
    from paratune.checks.refusals import check_plan

    candidates: list[Candidate] = []
    removed: Counter = Counter()
    examples: dict[str, str] = {}
    total = 0
    world = spec.fixed.get("num_workers", Plan.model_fields["num_workers"].default)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    shared = [(name, divisors if getattr(spec.space, name) == "auto" else getattr(spec.space, name))
              for name in SWEEPABLE if getattr(spec.space, name) is not None]
    shared += [(f"data.{knob}", choices) for knob, choices in spec.space.data.items()]
    configs: dict[str, Any] = {}  # every candidate has the fixed model: its config is built once
    for strategy, knobs in spec.space.strategy.items():
        knob_names = list(knobs)
        for knob_values in itertools.product(*(knobs[k] for k in knob_names)):
            for shared_values in itertools.product(*(choices for _, choices in shared)):
                total += 1
                choices: dict[str, Any] = {"strategy": strategy}
                choices.update({f"{strategy}.{k}": v for k, v in zip(knob_names, knob_values)})
                choices.update({name: v for (name, _), v in zip(shared, shared_values)})
                plan_dict = {**spec.fixed, "strategy": strategy, strategy: dict(zip(knob_names, knob_values)),
                             **{name: v for (name, _), v in zip(shared, shared_values) if "." not in name}}
                data = {name.removeprefix("data."): v for (name, _), v in zip(shared, shared_values) if "." in name}
                if data:
                    plan_dict["data"] = {**(spec.fixed.get("data") or {}), **data}
                try:
                    plan = load_plan_dict(plan_dict)
                    check_plan(plan, _config_of(plan, configs))  # the family's rules on the meta model, a user loop's
                    candidates.append(Candidate(choices, plan))
                except (PlanError, ModelError) as err:
                    rule = _rule_of(str(err))
                    removed[rule] += 1
                    first = str(err).splitlines()[0].removeprefix("plan: ")
                    examples.setdefault(rule, first.split(";")[0])
                    if details is not None:
                        details.setdefault(rule, first)
    return candidates, total, removed, examples


# The spaces paratune ships (in the package: a wheel has them; the checkout's search_spaces/ is this folder).
SHIPPED_SPACES = Path(__file__).resolve().parents[1] / "spaces"


def shipped_spaces() -> dict[str, Path]:
    """The shipped spaces by name (the file's stem: `local_cpu`), sorted."""
    return {p.stem: p for p in sorted(SHIPPED_SPACES.glob("*.yaml"))}


def resolve_space(name_or_path: str | Path) -> Path:
    """A space file as given, else the shipped space of that name (`local_cpu` or `local_cpu.yaml`):
    `paratune plan|tune|profile local_cpu` works from any folder, and under `ray job submit` with
    nothing from the working directory. Neither: SpaceError with the shipped names, closest first."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = shipped_spaces()
    name = path.name.removesuffix(".yaml").removesuffix(".yml")
    if path.parent == Path(".") and name in shipped:
        return shipped[name]
    raise SpaceError(f"space: {str(name_or_path)!r} is neither a file nor a shipped space; "
                     f"{unknown_field_message(name, list(shipped))} (`paratune spaces` lists them), or a space file")


def load_space(path: str | Path) -> Space:
    """Read and validate a space file (or a shipped space by name); every error names the file, the key
    path and what is allowed."""
    path = resolve_space(path)
    data = read_yaml_mapping(path, "space", SpaceError)
    if isinstance(data.get("fixed"), dict):  # the fixed part's local files, as a plan file's
        data = {**data, "fixed": absolute_local_paths(data["fixed"], path.resolve().parent)}
    return space_from_dict(data, source=path)


def read_space_mapping(path: str | Path) -> dict[str, Any]:
    """A space file's mapping for `paratune plan`, or a plan file's (plans/*.yaml: no `fixed` or
    `space`) as the mapping of a space of that one plan."""
    path = Path(path)
    raw = read_yaml_mapping(path, "space", SpaceError)
    if "fixed" not in raw and "space" not in raw:
        plan = dict(raw)
        strategy = plan.pop("strategy", "ddp")
        options = plan.pop(strategy, None) or {}
        raw = {"name": path.stem, "fixed": plan, "space": {"strategy": {strategy: {k: [v] for k, v in options.items()}}}}
    return raw


def space_from_dict(data: dict[str, Any], source: Path | None = None) -> Space:
    """Validate a space: its sections, the fixed part's own fields, then every combination of
    the fixed part with the swept values as one plan."""
    label = str(source) if source else "space"
    try:
        spec = SpaceFile.model_validate(data)
    except ValidationError as err:
        raise SpaceError(format_validation_error(err, label, schema=SpaceFile)) from None
    _check_fixed_alone(spec.fixed, label)
    for key, choices in spec.space.env.items():
        for value in choices:
            try:
                check_env(key, str(value))
            except ValueError as err:
                raise SpaceError(f"{label}: space.{err}") from None
    details: dict[str, str] = {}
    candidates, total, removed, examples = enumerate_candidates(spec, details)
    if not candidates:
        reasons = "\n".join(f"  - {n} x {details.get(r, r)}" for r, n in removed.most_common(3))
        more = f"\n  - and {len(removed) - 3} more rule(s)" if len(removed) > 3 else ""
        swept = ", ".join(f"{name} {getattr(spec.space, name)}" for name in SWEEPABLE
                          if getattr(spec.space, name) is not None)
        raise SpaceError(f"{label}: space: no valid plan among {total} combinations (the fixed part with each "
                         f"choice of strategy{', ' + swept if swept else ''}, validated as one plan); the rules "
                         f"they break:\n{reasons}{more}")
    return Space(source, spec, candidates, total, removed, examples)


def _check_fixed_alone(fixed: dict[str, Any], label: str) -> None:
    """What the fixed part says on its own: each field's type and bounds, and its env settings.

    Rules between fields (the global batch over dp = num_workers / (tp x pp x cp), degrees
    against the model's heads and layers, ...) are not checked here: they may hold only with the
    swept values (global batch 256 on 512 GPUs needs tp x pp >= 2), so every combination is
    validated as a whole plan instead, and a space with none valid says which rules broke."""
    try:
        Plan.model_validate(fixed)
    except ValidationError as err:
        # Field errors carry the field's location; the model's cross-field rules have none.
        alone = [e for e in err.errors() if e["loc"]]
        if alone:
            lines = format_validation_error(alone).splitlines()
            raise SpaceError("\n".join(line.replace("plan: ", f"{label}: fixed.", 1) for line in lines)) from None
    for key, value in (fixed.get("env") or {}).items():
        try:
            check_env(key, str(value))
        except ValueError as err:
            raise SpaceError(f"{label}: fixed.{err}") from None


def with_train_loop(space: Space, value: str) -> Space:
    """The space with every plan carrying the loop (fixed.env), validated again. A space that
    sweeps loops itself (space.env.PARATUNE_TRAIN_LOOP) keeps them, each checked as --train-loop is."""
    from paratune.config.train_loop import TRAIN_LOOP_ENV, TRAIN_LOOP_PATH_ENV, resolve

    loop, root = resolve(value)
    data = space.spec.model_dump(mode="json", exclude_unset=True)
    fixed = dict(data.get("fixed") or {})
    swept = ((data.get("space") or {}).get("env") or {}).get(TRAIN_LOOP_ENV)
    for other in swept or []:
        resolve(str(other), f"space.env.{TRAIN_LOOP_ENV}")
    fixed["env"] = {**(fixed.get("env") or {}), TRAIN_LOOP_PATH_ENV: root, **({} if swept else {TRAIN_LOOP_ENV: loop})}
    return space_from_dict({**data, "fixed": fixed}, source=space.source)
