"""The Plan: one validated, typed training configuration, and its YAML form.

A plan is everything one trial needs: the model, the data, the global batch and how it is split,
the parallel strategy and its knobs, precision, and the communication environment. Every rule
is checked here, before any worker starts, and a broken rule names the field, the value and
what is allowed.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from paratune.config.degrees import check_degrees
from paratune.config.extras import missing_extra
from paratune.levers import check_levers, lever_fields, ordered_fields

Strategy = Literal["ddp", "fsdp", "zero"]
FsdpSharding = Literal["full", "grad_op", "hybrid", "no_shard"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Precision = Literal["fp32", "bf16"]

# Environment variables a plan may set on its workers. Communication settings are swept; site
# settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) are allowed too, but belong in the cluster's
# runtime env rather than in a search space.
ALLOWED_ENV_PREFIXES: tuple[str, ...] = (
    "NCCL_",
    "TORCH_NCCL_",
    "GLOO_",
    "TORCH_DISTRIBUTED_",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "PARATUNE_",
)
# LL128 needs NVLink/Hopper-class hardware; forcing it elsewhere corrupts or hangs.
ALLOWED_NCCL_PROTO = {"Simple", "LL", "LL128"}
ALLOWED_NCCL_ALGO = {"Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT"}


class PlanError(ValueError):
    """A plan (or plan file) that breaks a rule; the message names field, value and what is allowed."""


WHOLE_NUMBER_FORMS = "an integer, written 500000000, 500_000_000, 5e8 or 5.0e+8"


def _whole_number(value: Any) -> Any:
    """An integer size as users write it: 5e8 (a string to PyYAML, which needs `5.0e+8` for a
    float), 5.0e+8 (a float), "500_000_000" or 500000000. Refuses bools (pydantic's int takes
    true as 1) and anything with a fractional part; the field's bounds are checked after."""
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}, a boolean; allowed: {WHOLE_NUMBER_FORMS}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        text = repr(value)  # exact for what was written: Decimal('5e+08'), not the float's binary digits
    elif isinstance(value, str):
        text = value.strip()
    else:
        return value  # not a number at all: pydantic's int says so
    try:
        float(text)  # the grammar of a Python number literal (500_000_000; not 5__0 or _5, which Decimal takes)
        number = Decimal(text)
    except (ValueError, InvalidOperation):
        raise ValueError(f"got {value!r}, not a number; allowed: {WHOLE_NUMBER_FORMS}") from None
    if not number.is_finite() or number != number.to_integral_value():
        raise ValueError(f"got {value!r}, not a whole number; allowed: {WHOLE_NUMBER_FORMS}")
    return int(number)


# An integer count or size (elements, bytes, tokens) that also takes e-notation: DeepSpeed users
# write `reduce_bucket_size: 5e8`. Reusable: `x: WholeNumber = Field(..., ge=1)`.
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]


def _real_number(value: Any) -> Any:
    """A float field that refuses bools (pydantic's float takes true as 1.0 MiB)."""
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}, a boolean; allowed: a number such as 25, 25.0 or 2.5e1")
    return value


# A real-valued size (e.g. DDP's bucket_cap_mb, in MiB): a number, never a bool.
RealNumber = Annotated[float, BeforeValidator(_real_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DDPOptions(_Strict):
    """torch.nn.parallel.DistributedDataParallel knobs."""

    bucket_cap_mb: RealNumber = Field(25.0, gt=0, le=4096)
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    # torch's own flag (HF TrainingArguments' ddp_find_unused_parameters): DDP looks each step for
    # parameters the step does not reach (a pooler, a vision tower, an indexer trained by another
    # loss) instead of waiting for their gradients. Off by default, as in torch: a plan without it
    # on such a model fails its first step naming those parameters.
    find_unused_parameters: bool = False


class FSDPOptions(_Strict):
    """PyTorch FSDP2 (`fully_shard`) knobs.

    `full` ~ ZeRO-3 (reshard after forward), `grad_op` ~ ZeRO-2 (keep gathered weights until
    backward), `hybrid` = full shard inside a shard group, replicate across groups,
    `no_shard` = replicate everything (DDP semantics, FSDP machinery).
    """

    sharding: FsdpSharding = "full"
    # hybrid only: dp ranks per shard group (normally those of one node: its GPUs / tp). None = one
    # node's (all dp ranks where the node size is unknown).
    shard_group_size: int | None = Field(None, ge=1)
    # Overrides what `sharding` implies for the blocks; the root module never reshards.
    reshard_after_forward: bool | None = None
    # How many blocks ahead to prefetch the all-gather (0 = FSDP2's implicit default).
    prefetch: int = Field(0, ge=0, le=4)
    cpu_offload: bool = False

    @property
    def reshards_after_forward(self) -> bool:
        """The explicit setting, else what the sharding implies (grad_op keeps weights gathered)."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else self.sharding != "grad_op"


class ZeroOptions(_Strict):
    """DeepSpeed ZeRO knobs (names as in DeepSpeed's config)."""

    stage: Literal[0, 1, 2, 3] = 2
    # Elements (DeepSpeed's unit); 5e8 as DeepSpeed's docs write it is accepted (WholeNumber).
    reduce_bucket_size: WholeNumber = Field(500_000_000, ge=1)
    allgather_bucket_size: WholeNumber = Field(500_000_000, ge=1)
    stage3_prefetch_bucket_size: WholeNumber = Field(50_000_000, ge=0)
    overlap_comm: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False


class PeftSpec(_Strict):
    """LoRA adapters (paratune.model.adapters, through peft): the base frozen, only the adapters trained.

    `target_modules`: module names (suffixes, as peft matches them), "all-linear", or None for
    peft's default for the model family (q_proj and v_proj for Llama-shaped models)."""

    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1, le=4096)
    alpha: RealNumber = Field(16.0, gt=0)
    dropout: RealNumber = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] | None = None

    @field_validator("target_modules")
    @classmethod
    def _named_targets(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value or any(not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", t) for t in value):
                raise ValueError(f"got {value!r}; allowed: a non-empty list of module names (e.g. [q_proj, "
                                 "v_proj]), 'all-linear', or none (the family's default)")
        return value


class DataSpec(_Strict):
    """Where token batches come from: synthetic (default) or a local text / JSONL / Parquet file."""

    kind: Literal["synthetic", "text", "jsonl", "parquet"] = "synthetic"
    path: Path | None = None
    # A local tokenizer directory (never a hub name); None = byte-level tokens (ids 0..255).
    tokenizer: Path | None = None
    text_field: str = "text"
    # torch DataLoader worker processes that prepare the coming steps' micro-batches (0: in the
    # training process, between steps) and how many steps each keeps ready; both can be swept.
    loader_workers: int = Field(0, ge=0, le=64)
    prefetch: int = Field(2, ge=1, le=64)

    @model_validator(mode="after")
    def _path_for_files(self) -> "DataSpec":
        if self.kind != "synthetic" and self.path is None:
            raise ValueError(f"data.path: required when data.kind is '{self.kind}'; got none")
        if self.loader_workers == 0 and self.prefetch != 2:
            raise ValueError(f"data.prefetch: got {self.prefetch} with loader_workers 0; allowed: a prefetch "
                             "only with loader_workers >= 1 (DataLoader workers keep it; the training process does not)")
        if self.kind == "synthetic" and (self.path is not None or self.tokenizer is not None):
            raise ValueError("data.path/data.tokenizer: only allowed when data.kind is 'text', 'jsonl' or 'parquet'")
        return self


class PlanCore(_Strict):
    """The Plan's own fields and rules; the levers' fields are added from their registry (`plan_class`).
    One configuration of one trial. `micro_batch x grad_accum x dp_degree == global_batch`."""

    model: str = "tiny-llama"  # a preset name (paratune.model.build.PRESETS) or a path to config.json
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    data: DataSpec = Field(default_factory=DataSpec)
    seq_len: WholeNumber = Field(128, ge=8, le=1_048_576)  # tokens (131072 may be written 1.31072e5)
    global_batch: WholeNumber = Field(8, ge=1)  # sequences per optimizer step
    micro_batch: int = Field(2, ge=1)
    grad_accum: int | None = Field(None, ge=1)  # None: derived from the global batch
    num_workers: int = Field(2, ge=1, le=100_000)  # world size: dp x tp x pp
    # Model-parallel degrees; the data-parallel degree is what is left: num_workers / (tp x pp).
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    pp_schedule: PipelineSchedule = "1f1b"  # micro-batches in flight = grad_accum (>= pp)
    sequence_parallel: bool = False  # shard norms/residual along the sequence inside the tp group
    # Context parallelism: every sequence split over cp ranks, attention as a ring over them (torch's
    # context_parallel); the data-parallel degree is num_workers / (tp x pp x cp). GPUs only.
    cp: int = Field(1, ge=1, le=1024)
    # Expert parallelism (mixture-of-experts models): each routed-experts layer's experts split over
    # ep of the data-parallel ranks, tokens sent to their experts and back by all-to-all (dropless).
    # It borrows dp ranks, as torchtitan's EP does: the dp degree and the batch split stay the same,
    # and the experts' own data-parallel degree is dp / ep (paratune.parallel.ep).
    ep: int = Field(1, ge=1, le=1024)
    gpus_per_node: int | None = Field(None, ge=1)  # the cluster's node size: tp must stay inside it
    # A trial on whole nodes, never sharing one with another trial (paratune.trial.placement); None: on
    # when gpus_per_node is set. Where it runs, not what it trains: not part of the plan's meaning.
    exclusive_nodes: bool | None = None

    strategy: Strategy = "ddp"
    ddp: DDPOptions | None = None
    fsdp: FSDPOptions | None = None
    zero: ZeroOptions | None = None
    # Fine-tuning with LoRA adapters (paratune.model.adapters); None: full fine-tune, every weight trained.
    peft: PeftSpec | None = None

    # Here, in plan files: the levers' fields (paratune.levers: each lever's module owns its own).
    precision: Precision = "fp32"
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping (for every strategy alike)
    # AdamW's implementation: `deepspeed` lets ZeRO build it from its config (DeepSpeedCPUAdam under
    # optimizer offload, torch's fused AdamW on GPUs), `torch` hands DeepSpeed paratune's torch
    # AdamW (the CPU parity path); `auto` = deepspeed for ZeRO on GPUs, torch elsewhere.
    optimizer: Literal["auto", "torch", "deepspeed"] = "auto"
    # CPUs Ray reserves per worker (they set OMP_NUM_THREADS: the CPU Adam of offload plans runs on
    # them). None: 1 on CPU clusters; on GPU clusters the GPU nodes' CPUs / GPUs (the smallest node).
    cpus_per_worker: float | None = Field(None, gt=0, le=1024)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)

    env: dict[str, str] = Field(default_factory=dict)

    warmup_steps: int = Field(2, ge=0)
    measure_steps: int = Field(5, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    comm_timeout_s: float = Field(300.0, gt=0)  # process-group collective timeout
    trial_timeout_s: float = Field(1800.0, gt=0)  # whole trial; past it the trial is a hang
    profile_comm: bool = True  # profile one extra step for the communication share
    track_memory: bool = True  # track tensor memory of one extra step on CPU

    @property
    def dp_degree(self) -> int:
        return self.num_workers // (self.tp * self.pp * self.cp)

    @property
    def expert_dp_degree(self) -> int:
        """Copies of each expert: the dp ranks that expert parallelism does not split them over."""
        return self.dp_degree // self.ep

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measure_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @model_validator(mode="before")
    @classmethod
    def _fill_strategy_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        strategy = data.get("strategy", "ddp")
        for name in ("ddp", "fsdp", "zero"):
            if name != strategy and data.get(name) is not None:
                raise ValueError(
                    f"{name}: options for strategy '{name}' given, but strategy is "
                    f"'{strategy}'; allowed: only the '{strategy}' section"
                )
        if strategy in ("ddp", "fsdp", "zero") and data.get(strategy) is None:
            data[strategy] = {}
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> "PlanCore":
        missing = missing_extra(self)  # first: a space sweeping it drops all such plans under this one rule
        if missing is not None:
            raise ValueError(missing)
        check_degrees(self)
        dp = self.dp_degree
        per_step = self.micro_batch * dp
        if self.grad_accum is None:
            if self.global_batch % per_step:
                raise ValueError(
                    f"global_batch: {self.global_batch} is not divisible by micro_batch x dp_degree "
                    f"= {self.micro_batch} x {dp} = {per_step}; {_allowed_split(self, dp)}"
                )
            object.__setattr__(self, "grad_accum", self.global_batch // per_step)
        elif self.micro_batch * self.grad_accum * dp != self.global_batch:
            raise ValueError(
                f"grad_accum: micro_batch x grad_accum x dp_degree must equal global_batch, got "
                f"{self.micro_batch} x {self.grad_accum} x {dp} = "
                f"{self.micro_batch * self.grad_accum * dp} != {self.global_batch}; "
                f"{_allowed_split(self, dp)} (grad_accum follows)"
            )
        if self.pp > 1 and self.grad_accum < self.pp:
            raise ValueError(
                f"grad_accum: {self.grad_accum} micro-batches per step with pp {self.pp} leaves stages idle; "
                f"allowed: grad_accum >= pp (micro_batch <= {self.global_batch // (self.pp * dp)})")
        for key, value in self.env.items():
            check_env(key, value)
        check_levers(self)
        if self.fsdp is not None:
            _check_fsdp(self.fsdp, dp)
        if self.optimizer == "deepspeed" and self.strategy != "zero":
            raise ValueError(f"optimizer: 'deepspeed' needs strategy 'zero', got '{self.strategy}'; "
                             "allowed: 'auto' or 'torch'")
        if self.zero is not None and self.zero.offload_param and self.zero.stage != 3:
            raise ValueError(
                f"zero.offload_param: true needs zero.stage 3, got stage {self.zero.stage}; "
                "allowed: offload_param only with stage 3"
            )
        if self.zero is not None and self.zero.stage == 0 and self.precision == "bf16":
            # DeepSpeed's bf16 optimizer at stage 0 takes an extra optimizer step at start, so its
            # training differs from every other strategy's; stage 0 is plain DDP anyway.
            raise ValueError(
                "zero.stage: 0 with precision 'bf16' trains differently (DeepSpeed takes an extra "
                "optimizer step at start); allowed: stage 1-3 with bf16, or strategy 'ddp'"
            )
        return self

    # ---- YAML in/out -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/YAML-safe), with the derived grad_accum filled in; the levers' fields
        where plan files have them (after `peft`)."""
        data = self.model_dump(mode="json")
        return {name: data[name] for name in field_order(type(self)) if name in data}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_changes(self, **changes: Any) -> "Plan":
        """A new validated plan with some fields replaced (grad_accum re-derived unless given)."""
        data = self.to_dict()
        if "grad_accum" not in changes:
            data["grad_accum"] = None
        if "strategy" in changes:
            for name in ("ddp", "fsdp", "zero"):
                data.pop(name, None)
        data.update(changes)
        return load_plan_dict(data, plan_type=type(self))

    def flat(self) -> dict[str, Any]:
        """The plan flattened to dotted keys (for parameters in tracking and tables)."""
        return flatten_dict(self.to_dict())


def plan_class() -> type[PlanCore]:
    """The Plan model: the core's fields and every registered lever's (paratune.levers), built from
    the registry as it is now. The module's `Plan` is built once, at import; a lever registered later
    (a test's toy) gets its own class from here."""
    fields = {f.name: (f.annotation, Field(f.default, description=f.doc, **f.constraints)) for f in lever_fields()}
    return create_model("Plan", __base__=PlanCore, __module__=__name__, __doc__=PlanCore.__doc__, **fields)


def field_order(plan_type: type[BaseModel]) -> list[str]:
    """The plan's fields as plan files list them: the core's, the levers' block after `peft`."""
    core = list(PlanCore.model_fields)
    at = core.index("peft") + 1
    levers = [name for name in ordered_fields([]) if name in plan_type.model_fields]
    return core[:at] + levers + core[at:]


Plan = plan_class()


def _allowed_split(plan: "Plan", dp: int) -> str:
    """What would make the global batch split: the micro-batches that do, or, when dp itself does
    not divide the global batch, the model-parallel sizes that make it (an empty list helps nobody)."""
    sizes = _divisors(plan.global_batch, dp)
    if sizes:
        return f"allowed micro_batch: {sizes}"
    world = plan.num_workers
    model_parallel = [m for m in range(1, world + 1) if world % m == 0 and plan.global_batch % (world // m) == 0]
    return (f"no micro_batch can: dp_degree = num_workers / (tp x pp x cp) = {world} / "
            f"{plan.tp * plan.pp * plan.cp} = {dp} does not divide global_batch {plan.global_batch}; allowed: "
            f"tp x pp x cp in {model_parallel[:10]}{' ...' if len(model_parallel) > 10 else ''}, "
            "or a global_batch divisible by dp")


def _divisors(global_batch: int, dp: int) -> list[int]:
    if global_batch % dp:
        return []
    per_rank = global_batch // dp
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0]


# Names that hold credentials: never in a plan (plans are logged to MLflow and exported), and
# their values are scrubbed from anything paratune logs.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|AUTH", re.I)


def check_env(key: str, value: str) -> None:
    if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
        raise ValueError(f"env.{key}: not a valid environment variable name; allowed: [A-Z_][A-Z0-9_]*")
    if SECRET_NAME.search(key):
        raise ValueError(f"env.{key}: looks like a credential; secrets never go in a plan (it is logged "
                         "and exported); allowed: communication settings only (set secrets in the job's environment)")
    if not key.startswith(ALLOWED_ENV_PREFIXES):
        raise ValueError(
            f"env.{key}: not a communication setting; allowed prefixes: {', '.join(ALLOWED_ENV_PREFIXES)}"
        )
    if key == "NCCL_PROTO":
        for proto in value.lstrip("^").split(","):
            if proto.strip() not in ALLOWED_NCCL_PROTO:
                raise ValueError(f"env.NCCL_PROTO: got '{value}'; allowed: {sorted(ALLOWED_NCCL_PROTO)}")
    if key == "NCCL_ALGO":
        for algo in value.lstrip("^").split(","):
            if algo.strip() not in ALLOWED_NCCL_ALGO:
                raise ValueError(f"env.NCCL_ALGO: got '{value}'; allowed: {sorted(ALLOWED_NCCL_ALGO)}")


def _check_fsdp(options: FSDPOptions, world: int) -> None:
    """`world` is the dp degree: a hybrid shard group is made of dp ranks (all workers without tp/pp)."""
    if options.shard_group_size is not None and options.sharding != "hybrid":
        raise ValueError(
            f"fsdp.shard_group_size: only for sharding 'hybrid', got sharding '{options.sharding}'"
        )
    if options.sharding == "hybrid":
        size = options.shard_group_size or world
        if world % size:
            raise ValueError(
                f"fsdp.shard_group_size: {size} does not divide the dp degree {world}; allowed: "
                f"{[d for d in range(1, world + 1) if world % d == 0]}"
            )
        if size == 1 and world > 1:
            # A shard group of one rank is pure replication; FSDP2's HSDP with such a group
            # has silently skipped the gradient all-reduce. Say what is meant instead.
            raise ValueError(
                "fsdp.shard_group_size: 1 makes 'hybrid' pure replication; allowed: >= 2, "
                "or sharding 'no_shard' for replication"
            )


def flatten_dict(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_dict(value, f"{name}."))
        elif value is not None and value != {}:
            out[name] = value
    return out


def _fields_at(schema: type[BaseModel], path: tuple) -> list[str]:
    """The field names of the model found by following `path` from `schema` (nested models, their
    optional forms, and dict values of a model type); [] where the path leaves the models."""
    import typing

    current: Any = schema
    for part in path:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *typing.get_args(annotation)]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:  # e.g. dict[str, Model]: the value's model for the next part
            inner = [a for c in candidates for a in typing.get_args(c)]
            current = next((c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def unknown_field_message(name: str, allowed: list[str]) -> str:
    """`allowed: a, b, c` with the closest match first asked about ("did you mean ...")."""
    import difflib

    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}allowed: {', '.join(sorted(allowed))}" if allowed else "allowed: none here"


def format_validation_error(err: ValidationError | list[dict[str, Any]], source: str = "plan",
                            schema: type[BaseModel] | None = None) -> str:
    """One line per broken rule: `source: field: got VALUE; what is allowed` (of all the error's
    entries, or of those given: a caller may report some of them, e.g. the per-field ones). An
    unknown field lists the allowed ones of its place in `schema` (default: the Plan), closest first."""
    lines = []
    for e in err.errors() if isinstance(err, ValidationError) else err:
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("value_error", "assertion_error"):
            lines.append(f"{source}: {msg}" if not loc else f"{source}: {loc}: {msg}")
        elif e["type"] == "extra_forbidden":
            path = tuple(p for p in e["loc"] if not str(p).startswith("function-"))
            allowed = _fields_at(schema or Plan, path[:-1])
            lines.append(f"{source}: {loc}: unknown field (value {e['input']!r}); "
                         f"{unknown_field_message(str(path[-1]), allowed)}")
        else:
            lines.append(f"{source}: {loc}: got {e.get('input')!r}; {msg}")
    return "\n".join(lines)


def load_plan_dict(data: dict[str, Any], source: str = "plan", plan_type: type[PlanCore] | None = None) -> Plan:
    """A validated plan from a dict; errors name the source, the field, the value and what is allowed.
    `plan_type`: a Plan class built with more levers (`plan_class`); default the module's Plan."""
    try:
        return (plan_type or Plan).model_validate(data)
    except ValidationError as err:
        raise PlanError(format_validation_error(err, source, plan_type)) from None


def read_yaml_mapping(path: Path, what: str, error: type[ValueError]) -> dict[str, Any]:
    """A YAML file that must hold a mapping; errors name the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} file must be a mapping of fields, got {type(data).__name__}")
    return data


def absolute_local_paths(fields: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """The plan fields that name local files (a `model` folder or config.json, `data.path`,
    `data.tokenizer`) made absolute: a relative one against `base` (the plan or space file's
    folder), or the current directory where it exists only there (files written before this rule).

    A file is read where the command runs, but trials check and train in Ray's processes, whose
    working directory is not the user's: `model: ./my-model` would not be found there."""

    def absolute(value: str) -> str:
        if value.startswith("/"):
            return value
        beside = (base or Path.cwd()) / value
        return str((beside if beside.exists() or not Path(value).exists() else Path(value)).resolve())

    out = dict(fields)
    model = out.get("model")
    preset = Path(__file__).resolve().parents[1] / "presets" / f"{model}.json"  # a preset name wins (paratune.model.build)
    if isinstance(model, str) and not preset.is_file() and ("/" in model or model.endswith(".json")
                                                            or (base or Path.cwd()).joinpath(model).exists()):
        out["model"] = absolute(model)
    data = out.get("data")
    if isinstance(data, dict):
        data = dict(data)
        for key in ("path", "tokenizer"):
            value = data.get(key)
            if isinstance(value, str):
                data[key] = absolute(value)
        out["data"] = data
    return out


def load_plan(path: str | Path) -> Plan:
    """Read a plan YAML file; errors name the file, the field, the value and what is allowed.
    Local paths in it are relative to the file's folder (`absolute_local_paths`)."""
    path = Path(path)
    fields = absolute_local_paths(read_yaml_mapping(path, "plan", PlanError), path.resolve().parent)
    return load_plan_dict(fields, source=str(path))
