"""The profile's records: what to profile for a sweep's plans, what was measured, its lookups and its store.

A roofline with a few global constants cannot tell ZeRO-2 from ZeRO-3 at the same micro-batch,
and misses what the device really does at a given shape. Following the predictors that reach a
few percent (Proteus, vTrain, Echo: per-layer timings measured at several batch sizes on the real
device, collective bandwidth measured on the real network), a profile (measured on the plans'
own workers by paratune.cluster.profiling) holds:

- one decoder layer of the real transformers model at the tensor-parallel-local shape, forward +
  backward, for every (micro_batch, seq_len, tp, checkpointing, compile, float8 recipe) the plans
  use (`BlockShape`, `BlockTime`), the levers applied by the trials' own functions
  (paratune.parallel.recompute / compile / float8); a compiled block warmed first, its compile
  time kept apart (`BlockTime.compile_s`). `layers` checkpointing is no shape of its own: each
  block of it is either a `none` or a `full` block, so the time model composes it from those two;
- the embedding and the LM head (vocab/tp) with the standard loss at the same (micro_batch,
  seq_len, tp) (no lever changes them: checkpointing and compile act on the decoder blocks,
  float8 leaves the LM head in bf16), and the head with each other loss form the plans use
  (`HeadShape`: vocab_parallel under tp, chunked at tp 1);
- collective curves on the real process group (all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor, send/recv) for each group size and rank layout the plans use (the
  world, tp groups of consecutive ranks, dp groups of strided ranks), fitted to latency + bytes x
  seconds-per-byte (`Curve`);
- the optimizer step against the local parameter count, fitted to a + b x n (`LinearFit`);
- the host link (device -> host copy) that offload plans pay.

`profile_requests_for` says what a sweep's plans need profiled; `ProfileStore` keeps profiles
under PARATUNE_HOME/profiles keyed by what changes the numbers (model config, precision, device,
cluster shape, worker env), so later sweeps reuse them; paratune.cluster.profiling measures and fits
them, paratune.costs.timemodel composes a plan's step time from one. Neither torch nor Ray is imported here.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from paratune.levers import Checkpointing, Float8Recipe, loss_form
from paratune.config.plan import Plan, Precision

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# A loss form as the head runs it (paratune.levers.loss_form: `auto` resolved).
HeadLoss = Literal["standard", "vocab_parallel", "chunked"]
# What a lever costs a block against none of it when a profile never measured the pair (the time
# model says so in its note): full recompute runs the forward twice (~4/3 of forward + backward),
# selective only the cheap ops again (CPU probe: +7% step); selective_op (torchtitan's op policy)
# those and every second matmul of the forward (k, o, up of a Llama block: ~36% of its forward
# matmul FLOPs at Llama-3-8B's widths, ~0.12 of forward + backward): 1.07 + 0.12; compile and
# float8 assumed neutral;
# LoRA (`peft`: the plan's adapters as JSON, "" none) drops the frozen weights' gradient matmuls,
# 2 of forward + backward's 6 FLOPs per weight (keyed "lora" for any adapters).
LEVER_PRIORS: dict[str, dict[Any, float]] = {
    "checkpointing": {"none": 1.0, "selective": 1.07, "selective_op": 1.19, "full": 4 / 3},
    "compile": {False: 1.0, True: 1.0},
    "float8": {"none": 1.0, "tensorwise": 1.0, "rowwise": 1.0},
    "peft": {"": 1.0, "lora": 4 / 6},
}
LEVER_FIELDS: tuple[str, ...] = ("checkpointing", "compile", "float8", "peft")


class ProfileError(ValueError):
    """A profile request or stored profile that cannot be used; the message names field and value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BlockShape(_Strict):
    """One decoder block's work as a rank sees it: tokens of its micro-batch, its tp slice."""

    micro_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)  # the rank's part of the sequence (seq_len / cp)
    tp: int = Field(1, ge=1)
    checkpointing: Checkpointing = "none"
    compile: bool = False
    float8: Float8Recipe = "none"
    peft: str = ""  # the plan's LoRA adapters (PeftSpec JSON): a frozen base's backward; "" none

    @field_validator("checkpointing")
    @classmethod
    def _one_mode_per_block(cls, value: str) -> str:
        if value == "layers":
            raise ValueError("checkpointing: 'layers' is no block shape (each of its blocks is a 'none' or a 'full' "
                             "block: profile those); allowed: 'none', 'selective', 'selective_op', 'full'")
        return value

    @property
    def key(self) -> str:
        levers = (":compiled" if self.compile else "") + (f":f8-{self.float8}" if self.float8 != "none" else "")
        if self.peft:
            spec = json.loads(self.peft)
            levers += f":lora-r{spec['r']}-{spec['target_modules'] or 'default'}".replace(" ", "")
        return f"mb{self.micro_batch}:s{self.seq_len}:tp{self.tp}:{self.checkpointing}{levers}"

    @property
    def levers(self) -> tuple:
        return tuple(getattr(self, f) for f in LEVER_FIELDS)

    @property
    def plain(self) -> "BlockShape":
        """The same shape with no lever: where the ends (embedding, head) are measured."""
        return BlockShape(micro_batch=self.micro_batch, seq_len=self.seq_len, tp=self.tp)


class HeadShape(_Strict):
    """The LM head with a loss form other than the standard one, as a rank runs it."""

    micro_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    tp: int = Field(1, ge=1)
    loss: HeadLoss = "standard"

    @model_validator(mode="after")
    def _form_fits_tp(self) -> "HeadShape":
        if self.loss == "vocab_parallel" and self.tp == 1:
            raise ValueError("loss: 'vocab_parallel' needs tp > 1, got tp 1; allowed: 'standard' or 'chunked'")
        if self.loss == "chunked" and self.tp > 1:
            raise ValueError(f"loss: 'chunked' needs tp 1, got tp {self.tp}; allowed: 'standard' or 'vocab_parallel'")
        return self


class GroupSpec(_Strict):
    """A process-group layout: `size` ranks, `stride` apart (1 = consecutive ranks, a tp group
    inside a node; tp = the dp ranks of a tp x dp layout; dp x tp = pipeline neighbours)."""

    size: int = Field(ge=2)
    stride: int = Field(1, ge=1)

    @property
    def layout(self) -> str:
        return "contiguous" if self.stride == 1 else "strided"

    def groups(self, world: int) -> list[list[int]]:
        """Every group of this layout over `world` ranks (each rank in exactly one)."""
        span = self.size * self.stride
        if world % span:
            raise ProfileError(f"groups: size {self.size} x stride {self.stride} = {span} does not divide "
                               f"world size {world}; allowed: size x stride dividing the world size")
        out = []
        for base in range(0, world, span):
            for offset in range(self.stride):
                out.append([base + offset + k * self.stride for k in range(self.size)])
        return out


class ProfileRequest(_Strict):
    """What to profile for one (env, world size, precision, model) of a sweep's plans."""

    model: str
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    precision: Precision = "fp32"
    blocks: list[BlockShape]
    heads: list[HeadShape] = Field(default_factory=list)  # loss forms other than standard
    groups: list[GroupSpec] = Field(default_factory=list)
    local_params: list[int] = Field(default_factory=list)  # optimizer step sizes (elements per rank)
    env: dict[str, str] = Field(default_factory=dict)
    world_size: int = Field(ge=1)
    gpus_per_node: int | None = Field(None, ge=1)
    cpus_per_worker: float | None = Field(None, gt=0)
    device_type: Literal["auto", "cpu", "cuda"] = "auto"
    reps: int = Field(4, ge=1, le=50)  # timed repetitions per measurement
    warmup: int = Field(1, ge=0, le=20)
    # What the repetitions give: `min` (default) is the work's own time, robust to a shared host's
    # bursts (others' processes only ever add time); `median` keeps typical interference in.
    statistic: Literal["min", "median"] = "min"
    sizes: list[int] | None = None  # collective message sizes in bytes (None: by device type)
    timeout_s: float = Field(900.0, gt=0)

    @field_validator("blocks")
    @classmethod
    def _some_blocks(cls, value: list[BlockShape]) -> list[BlockShape]:
        if not value:
            raise ValueError("blocks: got an empty list; allowed: at least one (micro_batch, seq_len, tp, "
                             "checkpointing) shape")
        return value

    @property
    def config_digest(self) -> str:
        return config_digest(self.model, self.model_overrides)

    def env_key(self) -> str:
        """What, beyond the model, changes speed on the same cluster: the env vars and host CPUs."""
        return json.dumps({"env": dict(sorted(self.env.items())), "cpus_per_worker": self.cpus_per_worker},
                          sort_keys=True)


def config_digest(model: str, overrides: dict[str, Any] | None = None) -> str:
    """A short digest of the model's full config (overrides and attention kernel included)."""
    return _config_digest(model, json.dumps(overrides or {}, sort_keys=True, default=str))


@lru_cache(maxsize=256)
def _config_digest(model: str, overrides_json: str) -> str:
    from paratune.model.build import build_config, config_key

    config = build_config(model, json.loads(overrides_json))
    return hashlib.sha256(config_key(config).encode()).hexdigest()[:16]


def _plan_env_key(plan: Plan) -> tuple:
    return (json.dumps(dict(sorted(plan.env.items()))), plan.cpus_per_worker, plan.num_workers, plan.precision,
            plan.model, json.dumps(plan.model_overrides, sort_keys=True, default=str), plan.device,
            plan.gpus_per_node)


def plan_groups(plan: Plan) -> list[GroupSpec]:
    """The process-group layouts a plan's collectives run on (ParallelDims: pp x dp x cp x tp)."""
    out = []
    dp = plan.dp_degree * plan.cp
    if plan.tp > 1:
        out.append(GroupSpec(size=plan.tp, stride=1))
    if dp > 1:
        out.append(GroupSpec(size=dp, stride=plan.tp))
    if plan.pp > 1:
        out.append(GroupSpec(size=plan.pp, stride=plan.num_workers // plan.pp))
    if plan.ep > 1:  # an ep group: ep consecutive dp ranks; an expert's copies: ranks ep apart
        out.append(GroupSpec(size=plan.ep, stride=plan.tp))
        if plan.expert_dp_degree > 1:
            out.append(GroupSpec(size=plan.expert_dp_degree, stride=plan.tp * plan.ep))
    return out


def peft_lever(plan: Plan) -> str:
    """A plan's LoRA as a block shape's `peft` lever: its adapters as JSON, "" without."""
    return plan.peft.model_dump_json() if plan.peft is not None else ""


def plan_blocks(plan: Plan) -> list[BlockShape]:
    """The block shapes a plan's step runs: one, or a `none` and a `full` one for `layers`."""
    modes = ("none", "full") if plan.activation_checkpointing == "layers" else (plan.activation_checkpointing,)
    peft = peft_lever(plan)
    return [BlockShape(micro_batch=plan.micro_batch, seq_len=plan.seq_len // plan.cp, tp=plan.tp, checkpointing=mode,
                       compile=plan.compile, float8=plan.float8, peft=peft) for mode in modes]


def head_loss(plan: Plan) -> str:
    """The loss form a plan's head runs: paratune.levers.loss_form, with `auto`'s fallbacks to the
    standard form where paratune.parallel.loss keeps the logits gathered (pp, cp, a tied head)."""
    form = loss_form(plan)
    if form == "vocab_parallel" and plan.loss == "auto":
        from paratune.model.build import build_config

        if plan.pp > 1 or plan.cp > 1 or getattr(build_config(plan.model, plan.model_overrides),
                                                  "tie_word_embeddings", False):
            return "standard"
    return form


def plan_heads(plan: Plan) -> list[HeadShape]:
    """The head a plan's last stage runs, when its loss form is not the standard one (that one is
    measured with every block shape)."""
    form = head_loss(plan)
    if form == "standard":
        return []
    return [HeadShape(micro_batch=plan.micro_batch, seq_len=plan.seq_len // plan.cp, tp=plan.tp, loss=form)]


def optimizer_params(plan: Plan) -> int:
    """Parameter elements one rank's optimizer steps under a plan (sharded by ZeRO/FSDP)."""
    from paratune.model.shapes import fsdp_shard_degree, local_params, model_shape, replicas

    from paratune.costs.moe import held_with_experts, shard_params

    shape = model_shape(plan)
    local, _ = local_params(plan, shape)
    if plan.ep > 1:  # E / ep experts, FSDP2-sharded over expert_dp (paratune.costs.moe)
        held, share = held_with_experts(plan, shape)
        local = held.local
        if plan.strategy == "fsdp" and share is not None:
            return max(1, int(shard_params(local, share.local, fsdp_shard_degree(plan), share)))
    if plan.peft is not None:  # LoRA: the optimizer steps the adapters only
        from paratune.model.adapters import adapted_params

        local = adapted_params(plan, held_with_experts(plan, shape)[0], math.ceil(shape.layers / plan.pp))[1].local
    if plan.strategy == "fsdp" and plan.fsdp is not None:
        local /= fsdp_shard_degree(plan)
    elif plan.strategy == "zero" and plan.zero is not None and plan.zero.stage >= 1:
        local /= replicas(plan)
    return max(1, int(local))


def profile_requests_for(plans: list[Plan], reps: int | None = None) -> list[ProfileRequest]:
    """One request per distinct (env, host CPUs, world size, precision, model) among the plans:
    NCCL/OMP settings change speed, so plans with a different env get their own profile."""
    by_key: dict[tuple, list[Plan]] = {}
    for plan in plans:
        by_key.setdefault(_plan_env_key(plan), []).append(plan)
    requests = []
    for group in by_key.values():
        first = group[0]
        # Each (shape, levers) once: a space sweeping compile x float8 x checkpointing asks for each
        # combination it has, no more (a compiled shape costs a compile on the workers).
        blocks = sorted({b for p in group for b in plan_blocks(p)},
                        key=lambda b: (b.tp, b.checkpointing, b.compile, b.float8, b.peft, b.seq_len, b.micro_batch))
        heads = sorted({h for p in group for h in plan_heads(p)}, key=lambda h: (h.tp, h.loss, h.seq_len, h.micro_batch))
        groups = sorted({g for p in group for g in plan_groups(p)}, key=lambda g: (g.size, g.stride))
        if first.num_workers > 1 and GroupSpec(size=first.num_workers) not in groups:
            groups.insert(0, GroupSpec(size=first.num_workers))
        params = sorted({optimizer_params(p) for p in group})
        if len(params) > 3:  # three points fit a + b·n: the smallest, the largest and one between
            params = [params[0], params[len(params) // 2], params[-1]]
        extra = {"reps": reps} if reps is not None else {}
        requests.append(ProfileRequest(
            model=first.model, model_overrides=first.model_overrides, precision=first.precision, blocks=blocks,
            heads=heads, groups=groups, local_params=params, env=dict(first.env), world_size=first.num_workers,
            gpus_per_node=first.gpus_per_node, cpus_per_worker=first.cpus_per_worker, device_type=first.device,
            **extra))
    return requests


# --------------------------------------------------------------------------- the result
class BlockTime(_Strict):
    shape: BlockShape
    block_s: float  # one decoder layer, forward + backward
    embed_s: float  # the embedding (vocab/tp), forward + backward
    head_s: float  # final norm + LM head (vocab/tp) + loss over the gathered logits, forward + backward
    compile_s: float | None = None  # compiled blocks: the first call's time beyond a steady one
    # How a looked-up block was derived when the profile has no entry with its levers (None:
    # measured, or interpolated over measured shapes with the same levers); never stored.
    derived: str | None = Field(None, exclude=True)


class HeadTime(_Strict):
    shape: HeadShape
    head_s: float  # final norm + LM head + this loss form, forward + backward


class Curve(_Strict):
    """One collective on one group layout: seconds = latency_s + bytes x seconds_per_byte.
    Bytes: the whole (unsharded) tensor for all-reduce, all-gather (its output) and
    reduce-scatter (its input); the message for send/recv (one way)."""

    op: CollectiveOp
    size: int
    stride: int = 1
    latency_s: float
    seconds_per_byte: float
    points: list[tuple[int, float]] = Field(default_factory=list)  # (bytes, median seconds)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + max(0.0, nbytes) * self.seconds_per_byte if nbytes > 0 else 0.0

    @property
    def bandwidth_gbps(self) -> float:
        return 1e-9 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf


class LinearFit(_Strict):
    """seconds = a + b x n, with the points it was fitted on."""

    a: float
    b: float
    points: list[tuple[float, float]] = Field(default_factory=list)

    def seconds(self, n: float) -> float:
        return self.a + self.b * n


class Profile(BaseModel):
    """Measured inputs of the step-time model for one model, precision, device, cluster shape and env."""

    model_config = ConfigDict(extra="forbid")

    version: int = 2  # 2: block shapes carry the levers; heads with other loss forms
    model: str
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    config_digest: str
    precision: Precision
    device_type: str  # cpu | cuda
    device_name: str  # "cpu" or torch.cuda.get_device_name()
    world_size: int
    gpus_per_node: int | None = None
    local_world_size: int = 1
    cpus_per_worker: float | None = None
    env: dict[str, str] = Field(default_factory=dict)
    blocks: list[BlockTime]
    heads: list[HeadTime] = Field(default_factory=list)
    collectives: list[Curve] = Field(default_factory=list)
    optimizer: LinearFit
    host_link_bytes_per_s: float | None = None
    profile_s: float = 0.0  # wall time of the measurement on the workers
    created_at: str = ""
    notes: list[str] = Field(default_factory=list)

    def env_key(self) -> str:
        return json.dumps({"env": dict(sorted(self.env.items())), "cpus_per_worker": self.cpus_per_worker},
                          sort_keys=True)

    # ---- lookups the time model uses ------------------------------------------------------
    def block(self, micro_batch: int, seq_len: int, tp: int, checkpointing: str = "none", compile: bool = False,
              float8: str = "none", peft: str = "") -> BlockTime:
        """The measured block at this shape and these levers; else interpolated in tokens over the
        measured ones with the same tp and levers (a + b x tokens), else from the nearest tp
        (x tp_measured/tp). With no entry for these levers at all: the block of the nearest lever
        set measured (fewest levers differing) at this shape, times each differing lever's ratio
        measured on shapes profiled with and without it (else LEVER_PRIORS), and `derived` says so.
        `layers` checkpointing is composed by the caller from `none` and `full` blocks."""
        if checkpointing == "layers":
            raise ProfileError("checkpointing: 'layers' has no block of its own; allowed: 'none', 'selective', 'selective_op', "
                               "'full' (paratune.costs.timemodel composes 'layers' from 'none' and 'full' blocks)")
        want = BlockShape(micro_batch=micro_batch, seq_len=seq_len, tp=tp, checkpointing=checkpointing,
                          compile=compile, float8=float8, peft=peft)
        measured = {b.shape.levers for b in self.blocks}
        if want.levers in measured:
            return self._at_shape([b for b in self.blocks if b.shape.levers == want.levers], want)
        nearest = min(measured, key=lambda lv: (sum(a != b for a, b in zip(lv, want.levers)),
                                                lv != ("none", False, "none", ""), str(lv)))
        have = dict(zip(LEVER_FIELDS, nearest))
        base = self._at_shape([b for b in self.blocks if b.shape.levers == nearest], want.model_copy(update=have))
        factor, how = 1.0, []
        for field, had, wanted in zip(LEVER_FIELDS, nearest, want.levers):
            if had != wanted:
                ratio, source = self._lever_ratio(field, had, wanted, tp)
                factor *= ratio
                how.append(f"{field} {wanted!r} x{ratio:.3g} of {had!r} ({source})")
        note = f"block {want.key} not profiled: " + "; ".join(how)
        return base.model_copy(update={"shape": want, "block_s": base.block_s * factor, "compile_s": None,
                                       "derived": note})

    def _at_shape(self, same_levers: list[BlockTime], want: BlockShape) -> BlockTime:
        """`want` among blocks of its own levers: exact, else fitted in tokens at the nearest tp."""
        for b in same_levers:
            if b.shape == want:
                return b
        same = [b for b in same_levers if b.shape.tp == want.tp]
        scale = 1.0
        if not same:
            near_tp = min({b.shape.tp for b in same_levers}, key=lambda t: (abs(math.log(t / want.tp)), t))
            same = [b for b in same_levers if b.shape.tp == near_tp]
            scale = near_tp / want.tp
        tokens = want.micro_batch * want.seq_len
        xs = [b.shape.micro_batch * b.shape.seq_len for b in same]
        compiled = [b.compile_s for b in same if b.compile_s is not None]
        return BlockTime(shape=want, block_s=_fit_tokens(xs, [b.block_s for b in same], tokens) * scale,
                         embed_s=_fit_tokens(xs, [b.embed_s for b in same], tokens) * scale,
                         head_s=_fit_tokens(xs, [b.head_s for b in same], tokens) * scale,
                         compile_s=max(compiled) if compiled else None)

    def _lever_ratio(self, field: str, had: Any, wanted: Any, tp: int) -> tuple[float, str]:
        """block_s with `field` = wanted over block_s with `had`, all else equal, over the shapes
        measured both ways (the geometric mean, this tp's pairs first); else LEVER_PRIORS."""
        by_shape = {b.shape: b.block_s for b in self.blocks}
        pairs = []
        for shape, seconds in by_shape.items():
            if getattr(shape, field) != wanted:
                continue
            other = by_shape.get(shape.model_copy(update={field: had}))
            if other and seconds > 0:
                pairs.append((shape.tp != tp, seconds / other))
        if pairs:
            best = [r for off_tp, r in pairs if off_tp == min(o for o, _ in pairs)]
            return math.exp(sum(math.log(r) for r in best) / len(best)), f"measured on {len(best)} shape(s)"
        prior = LEVER_PRIORS[field]
        if field == "peft":  # any adapters: a frozen base
            wanted, had = ("lora" if wanted else ""), ("lora" if had else "")
        return prior[wanted] / prior[had], "not measured: prior"

    def head(self, micro_batch: int, seq_len: int, tp: int, loss: str = "standard") -> tuple[float, str | None]:
        """Seconds of norm + head + this loss form at this shape, and a note when not measured.
        Standard: the blocks' head_s; another form: fitted in tokens over that form at this tp,
        else the standard head's (said so)."""
        standard = self.block(micro_batch, seq_len, tp).head_s
        if loss == "standard":
            return standard, None
        same = [h for h in self.heads if h.shape.loss == loss and h.shape.tp == tp]
        if same:
            xs = [h.shape.micro_batch * h.shape.seq_len for h in same]
            return _fit_tokens(xs, [h.head_s for h in same], micro_batch * seq_len), None
        return standard, f"head with loss {loss!r} at tp {tp} not profiled: the standard head's time"

    def curve(self, op: str, size: int, stride: int = 1) -> Curve | None:
        """The measured curve for this op and group; else the same size in another layout; else
        the nearest size, its bandwidth term scaled by the ring factor ((n-1)/n)."""
        if size < 2:
            return None
        same_op = [c for c in self.collectives if c.op == op]
        if not same_op:
            return None
        for c in same_op:
            if c.size == size and c.stride == stride:
                return c
        for c in same_op:
            if c.size == size:
                return c
        near = min(same_op, key=lambda c: (abs(math.log(c.size / size)), c.size))
        factor = ((size - 1) / size) / ((near.size - 1) / near.size) if op != "send_recv" else 1.0
        return near.model_copy(update={"size": size, "stride": stride,
                                       "seconds_per_byte": near.seconds_per_byte * factor})

    def comm_seconds(self, op: str, size: int, nbytes: float, stride: int = 1) -> float:
        curve = self.curve(op, size, stride)
        return curve.seconds(nbytes) if curve is not None else 0.0


def _fit_tokens(xs: list[float], ys: list[float], tokens: float) -> float:
    """ys at `tokens`: a + b x tokens over the points (proportional with one point or no fixed part)."""
    if len(set(xs)) < 2:
        return ys[0] * tokens / xs[0]
    slope, intercept = _line(xs, ys)
    if intercept < 0:  # no fixed part: proportional to tokens
        slope, intercept = sum(ys) / sum(xs), 0.0
    return max(0.0, intercept + slope * tokens)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


# --------------------------------------------------------------------------- cache
class ProfileStore:
    """Profiles on disk, one JSON file each, keyed by what changes the numbers: the model config
    (overrides included), precision, device name, cluster shape (world size, GPUs per node) and
    the worker env (with the host CPUs per worker). A later sweep with the same key reuses it."""

    def __init__(self, root: str | Path | None = None):
        if root is None:
            from paratune.config.home import paratune_home

            root = paratune_home() / "profiles"
        self.root = Path(root)

    @staticmethod
    def key(config_digest: str, precision: str, device_name: str, world_size: int, gpus_per_node: int | None,
            env_key: str) -> str:
        text = json.dumps({"config": config_digest, "precision": precision, "device": device_name,
                           "world_size": world_size, "gpus_per_node": gpus_per_node, "env": env_key}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def key_for_request(self, request: ProfileRequest, device_name: str) -> str:
        return self.key(request.config_digest, request.precision, device_name, request.world_size,
                        request.gpus_per_node, request.env_key())

    def key_for_profile(self, profile: Profile) -> str:
        return self.key(profile.config_digest, profile.precision, profile.device_name, profile.world_size,
                        profile.gpus_per_node, profile.env_key())

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, request: ProfileRequest, device_name: str, require_cover: bool = True) -> Profile | None:
        """The stored profile for this request on this device, or None. With `require_cover`, only
        one that measured every block shape and group layout the request asks for."""
        path = self.path(self.key_for_request(request, device_name))
        if not path.is_file():
            return None
        profile = load_profile(path)
        if require_cover and not covers(profile, request):
            return None
        return profile

    def put(self, profile: Profile, device_name: str | None = None) -> Path:
        """Store a profile; `device_name`: the name a later `get` will ask by (a sweep asks by its
        device-table name, e.g. h100-80gb; the profile records torch's device name)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.key_for_profile(profile) if device_name is None else self.key(
            profile.config_digest, profile.precision, device_name, profile.world_size, profile.gpus_per_node,
            profile.env_key())
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(profile.model_dump_json(indent=1))
        tmp.replace(path)
        return path

    def all(self) -> list[Profile]:
        return [load_profile(p) for p in sorted(self.root.glob("*.json"))] if self.root.is_dir() else []


def covers(profile: Profile, request: ProfileRequest) -> bool:
    """Whether a profile measured everything a request needs (block shapes with their levers, heads
    with their loss forms, group layouts)."""
    shapes = {b.shape for b in profile.blocks}
    heads = {h.shape for h in profile.heads}
    layouts = {(c.size, c.stride) for c in profile.collectives}
    return all(b in shapes for b in request.blocks) and all(h in heads for h in request.heads) and \
        all((g.size, g.stride) in layouts for g in request.groups if g.size <= profile.world_size)


def load_profile(path: str | Path) -> Profile:
    """A stored profile (JSON), or a ProfileError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile: {path} does not exist; allowed: a JSON file written by `paratune profile`")
    try:
        return Profile.model_validate_json(path.read_text())
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError or bad JSON
        raise ProfileError(f"profile: {path} is not a paratune profile: {str(err).splitlines()[0]}") from None


def load_profiles(path: str | Path) -> list[Profile]:
    """A profile file, a JSON list of profiles (what `paratune profile --out` writes), or a folder."""
    path = Path(path)
    if path.is_dir():
        return [load_profile(p) for p in sorted(path.glob("*.json"))]
    if not path.is_file():
        raise ProfileError(f"profile: {path} does not exist; allowed: a file written by `paratune profile --out`")
    data = json.loads(path.read_text())
    items = data if isinstance(data, list) else [data]
    try:
        return [Profile.model_validate(item) for item in items]
    except Exception as err:  # noqa: BLE001
        raise ProfileError(f"profile: {path} is not a paratune profile: {str(err).splitlines()[0]}") from None
