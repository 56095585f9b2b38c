"""The profile's records: what to profile for a sweep's plans, what was measured, its fits and its store.

A roofline with a few global constants cannot tell ZeRO-2 from ZeRO-3 at the same micro-batch,
and misses what the device really does at a given shape. Following the predictors that reach a
few percent (Proteus, vTrain, Echo: per-layer timings measured at several batch sizes on the real
device, collective bandwidth measured on the real network), a profile (measured on the plans'
own workers by paratune.profiling) holds:

- one decoder layer of the real transformers model at the tensor-parallel-local shape, forward +
  backward, for every (micro_batch, seq_len, tp, checkpointing) the plans use (`BlockTime`);
- the embedding and the LM head (vocab/tp) with the loss, at the same shapes;
- collective curves on the real process group (all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor, send/recv) for each group size and rank layout the plans use (the
  world, tp groups of consecutive ranks, dp groups of strided ranks), fitted to latency + bytes x
  seconds-per-byte (`Curve`);
- the optimizer step against the local parameter count, fitted to a + b x n (`LinearFit`);
- the host link (device -> host copy) that offload plans pay.

`profile_requests_for` says what a sweep's plans need profiled; `ProfileStore` keeps profiles
under PARATUNE_HOME/profiles keyed by what changes the numbers (model config, precision, device,
cluster shape, worker env), so later sweeps reuse them. paratune.timemodel composes a plan's
step time from a profile. Neither torch nor Ray is imported here.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paratune.plan import Checkpointing, Plan, Precision

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


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

    @property
    def key(self) -> str:
        return f"mb{self.micro_batch}:s{self.seq_len}:tp{self.tp}:{self.checkpointing}"


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
    from paratune.models import build_config, config_key

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
    return out


def plan_blocks(plan: Plan) -> list[BlockShape]:
    return [BlockShape(micro_batch=plan.micro_batch, seq_len=plan.seq_len // plan.cp, tp=plan.tp,
                       checkpointing=plan.activation_checkpointing)]


def optimizer_params(plan: Plan) -> int:
    """Parameter elements one rank's optimizer steps under a plan (sharded by ZeRO/FSDP)."""
    from paratune.shapes import fsdp_shard_degree, local_params, model_shape, replicas

    local, _ = local_params(plan, model_shape(plan))
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
        blocks = sorted({b for p in group for b in plan_blocks(p)},
                        key=lambda b: (b.tp, b.checkpointing, b.seq_len, b.micro_batch))
        groups = sorted({g for p in group for g in plan_groups(p)}, key=lambda g: (g.size, g.stride))
        if first.num_workers > 1 and GroupSpec(size=first.num_workers) not in groups:
            groups.insert(0, GroupSpec(size=first.num_workers))
        params = sorted({optimizer_params(p) for p in group})
        if len(params) > 3:  # three points fit a + b·n: the smallest, the largest and one between
            params = [params[0], params[len(params) // 2], params[-1]]
        extra = {"reps": reps} if reps is not None else {}
        requests.append(ProfileRequest(
            model=first.model, model_overrides=first.model_overrides, precision=first.precision, blocks=blocks,
            groups=groups, local_params=params, env=dict(first.env), world_size=first.num_workers,
            gpus_per_node=first.gpus_per_node, cpus_per_worker=first.cpus_per_worker, device_type=first.device,
            **extra))
    return requests


# --------------------------------------------------------------------------- the result
class BlockTime(_Strict):
    shape: BlockShape
    block_s: float  # one decoder layer, forward + backward
    embed_s: float  # the embedding (vocab/tp), forward + backward
    head_s: float  # final norm + LM head (vocab/tp) + loss over the gathered logits, forward + backward


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

    version: int = 1
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
    def block(self, micro_batch: int, seq_len: int, tp: int, checkpointing: str) -> BlockTime:
        """The measured block at this shape; else interpolated in tokens over the measured ones of
        the same (tp, checkpointing) (a + b x tokens), else derived from the nearest tp /
        checkpointing (x tp_measured/tp; full recompute ~ 4/3 of no recompute)."""
        want = BlockShape(micro_batch=micro_batch, seq_len=seq_len, tp=tp, checkpointing=checkpointing)
        for b in self.blocks:
            if b.shape == want:
                return b
        same = [b for b in self.blocks if b.shape.tp == tp and b.shape.checkpointing == checkpointing]
        scale = 1.0
        if not same:
            same = [b for b in self.blocks if b.shape.checkpointing == checkpointing] or list(self.blocks)
            near_tp = min({b.shape.tp for b in same}, key=lambda t: (abs(math.log(t / tp)), t))
            same = [b for b in same if b.shape.tp == near_tp]
            scale = near_tp / tp
            ckpt = {b.shape.checkpointing for b in same}
            if checkpointing not in ckpt:
                scale *= 4 / 3 if checkpointing == "full" else 3 / 4
        tokens = micro_batch * seq_len

        def fit(field: str) -> float:
            xs = [b.shape.micro_batch * b.shape.seq_len for b in same]
            ys = [getattr(b, field) for b in same]
            if len(set(xs)) < 2:
                return ys[0] * tokens / xs[0]
            slope, intercept = _line(xs, ys)
            if intercept < 0:  # no fixed part: proportional to tokens
                slope, intercept = sum(ys) / sum(xs), 0.0
            return max(0.0, intercept + slope * tokens)

        return BlockTime(shape=want, block_s=fit("block_s") * scale, embed_s=fit("embed_s") * scale,
                         head_s=fit("head_s") * scale)

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


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency, seconds per byte) >= 0 minimising the *relative* error over the points, so the
    small messages (latency bound) count as much as the large ones (bandwidth bound)."""
    import numpy as np

    if not points:
        raise ProfileError("collectives: no measured points to fit")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([max(p[1], 1e-9) for p in points], dtype=float)
    if len(points) == 1:
        return 0.0, float(y[0] / x[0])
    from scipy.optimize import nnls

    A = np.stack([1 / y, x / y], axis=1)
    sol, _ = nnls(A, np.ones_like(y))
    latency, spb = float(sol[0]), float(sol[1])
    if spb <= 0:  # noisy points (a busy host) can flatten the line: the largest message's own rate
        big = int(np.argmax(x))
        latency = min(latency, float(y.min()))
        spb = max(float(y[big]) - latency, 0.5 * float(y[big])) / float(x[big])
    return latency, spb


def fit_linear(points: list[tuple[float, float]]) -> LinearFit:
    """a + b x n with a, b >= 0 (relative least squares), for the optimizer step."""
    import numpy as np
    from scipy.optimize import nnls

    if not points:
        return LinearFit(a=0.0, b=0.0)
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([max(p[1], 1e-9) for p in points], dtype=float)
    if len(points) == 1:
        return LinearFit(a=0.0, b=float(y[0] / x[0]), points=[tuple(p) for p in points])
    sol, _ = nnls(np.stack([1 / y, x / y], axis=1), np.ones_like(y))
    a, b = float(sol[0]), float(sol[1])
    if b <= 0:  # flattened by noise: the largest point's own rate for the growing part
        big = int(np.argmax(x))
        a = min(a, float(y.min()))
        b = max(float(y[big]) - a, 0.5 * float(y[big])) / float(x[big])
    return LinearFit(a=a, b=b, points=[tuple(p) for p in points])


def profile_from_result(request: ProfileRequest, out: dict) -> Profile:
    """The Profile (curves and the optimizer line fitted) from collect_profile's raw result."""
    points: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
    for row in out.get("collectives", []):
        points.setdefault((row["op"], row["size"], row["stride"]), []).append((int(row["bytes"]), float(row["seconds"])))
    curves = []
    for (op, size, stride), pts in sorted(points.items()):
        latency, spb = fit_latency_bandwidth(pts)
        curves.append(Curve(op=op, size=size, stride=stride, latency_s=latency, seconds_per_byte=spb, points=pts))
    notes = []
    for key, value in (out.get("env_seen") or {}).items():
        if value != request.env.get(key):
            notes.append(f"env {key}: the workers saw {value!r}, the plans set {request.env.get(key)!r}")
    return Profile(
        model=request.model, model_overrides=request.model_overrides, config_digest=request.config_digest,
        precision=request.precision, device_type=out["device_type"], device_name=out["device_name"],
        world_size=request.world_size, gpus_per_node=request.gpus_per_node,
        local_world_size=int(out.get("local_world_size", 1)), cpus_per_worker=request.cpus_per_worker,
        env=dict(request.env),
        blocks=[BlockTime(shape=BlockShape(**b["shape"]), block_s=b["block_s"], embed_s=b["embed_s"],
                          head_s=b["head_s"]) for b in out["blocks"]],
        collectives=curves, optimizer=fit_linear([tuple(p) for p in out.get("optimizer", [])]),
        host_link_bytes_per_s=out.get("host_link_bytes_per_s"), profile_s=float(out.get("profile_s", 0.0)),
        created_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), notes=notes)


# --------------------------------------------------------------------------- cache
class ProfileStore:
    """Profiles on disk, one JSON file each, keyed by what changes the numbers: the model config
    (overrides included), precision, device name, cluster shape (world size, GPUs per node) and
    the worker env (with the host CPUs per worker). A later sweep with the same key reuses it."""

    def __init__(self, root: str | Path | None = None):
        if root is None:
            from paratune.launch import paratune_home

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
    """Whether a profile measured everything a request needs (shapes and group layouts)."""
    shapes = {b.shape for b in profile.blocks}
    layouts = {(c.size, c.stride) for c in profile.collectives}
    return all(b in shapes for b in request.blocks) and \
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
