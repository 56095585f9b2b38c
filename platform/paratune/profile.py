"""Profile what a sweep's plans need, on the workers they will run on: the inputs of the step-time model.

A roofline with a few global constants cannot tell ZeRO-2 from ZeRO-3 at the same micro-batch,
and misses what the device really does at a given shape. Following the predictors that reach a
few percent (Proteus, vTrain, Echo: per-layer timings measured at several batch sizes on the real
device, collective bandwidth measured on the real network), a profile measures, on every rank of
a real worker group at the same time (so CPU ranks share the cores as in a trial; GPU ranks each
have their own GPU):

- one decoder layer of the real transformers model at the tensor-parallel-local shape (heads/tp,
  kv heads/tp, intermediate/tp, the same hidden size and head dim), forward + backward, for every
  (micro_batch, seq_len, tp, checkpointing) the plans use, in the plan precision (bf16 autocast as
  the trials use), warm-up excluded, device synchronised before each clock read, the minimum (or
  the median) of a few repetitions;
- the embedding and the LM head (vocab/tp) with the loss, at the same shapes;
- collective curves on the real process group (all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor, send/recv) at a few sizes for each group size and rank layout the plans
  use (the world, tp groups of consecutive ranks, dp groups of strided ranks), fitted to
  latency + bytes x seconds-per-byte;
- the optimizer step (torch AdamW with clipping and zero_grad, as the trials step) against the
  local parameter count, fitted to a + b x n;
- the host link (device -> host copy) that offload plans pay.

`run_profile` runs it as one Ray Train job (or through a `runner` that already holds a worker
group); `ProfileStore` keeps profiles under PARATUNE_HOME/profiles keyed by what changes the
numbers (model config, precision, device, cluster shape, worker env), so later sweeps reuse them.
paratune.timemodel composes a plan's step time from a profile.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paratune.plan import Checkpointing, Plan, Precision

# A profile's collectives (world group and the sub-groups it measures) time out after this.
PROFILE_COMM_TIMEOUT_S = 300.0

PROFILE_FUNCTION = "paratune.profile:collect_profile"
Runner = Callable[[str, dict], dict]  # (function path, payload) -> rank 0's result
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# Message sizes (bytes): fewer and smaller on CPU, where gloo moves a few GB/s at best.
CPU_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20)
GPU_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 64 * 2**20, 256 * 2**20)


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
    from paratune.estimate import _fsdp_shard_degree, _local_params, _replicas, model_shape

    local, _ = _local_params(plan, model_shape(plan))
    if plan.strategy == "fsdp" and plan.fsdp is not None:
        local /= _fsdp_shard_degree(plan)
    elif plan.strategy == "zero" and plan.zero is not None and plan.zero.stage >= 1:
        local /= _replicas(plan)
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


# --------------------------------------------------------------------------- worker side
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device, warmup: int, reps: int, statistic: str = "median") -> float:
    """Median (or min) seconds of `fn` over `reps` runs after `warmup` untimed ones, synchronised."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times) if statistic == "min" else statistics.median(times)


def _local_config(request: ProfileRequest, tp: int, layers: int):
    """The config of one rank's tp slice: heads, kv heads, intermediate and vocab over tp, the same
    hidden size and head dim, `layers` decoder blocks."""
    from paratune.models import build_config, ffn_width_key

    full = build_config(request.model, request.model_overrides)
    heads = full.num_attention_heads
    kv = getattr(full, "num_key_value_heads", None) or heads
    head_dim = getattr(full, "head_dim", None) or full.hidden_size // heads
    overrides = dict(request.model_overrides)
    overrides["num_hidden_layers"] = layers
    if tp > 1:
        ffn = ffn_width_key(full.to_dict())  # intermediate_size, OPT's ffn_dim, GPT-2's n_inner
        overrides.update(num_attention_heads=max(1, heads // tp), vocab_size=math.ceil(full.vocab_size / tp),
                         head_dim=head_dim)
        if getattr(full, ffn, None):
            overrides[ffn] = max(1, getattr(full, ffn) // tp)
        if hasattr(full, "num_key_value_heads"):
            overrides["num_key_value_heads"] = max(1, kv // tp)
    return build_config(request.model, overrides), full.vocab_size


def _profile_block_shapes(request: ProfileRequest, device, barrier: Callable[[], None]) -> list[dict]:
    """Forward + backward of one decoder layer, the embedding and the head with the loss, for
    every requested shape: the real transformers modules, the trials' precision handling."""
    import torch

    from paratune.parallel import enable_full_recompute
    from paratune.parallel.pp import StageModule, causal_lm_loss

    out = []
    built: dict[tuple[int, str], tuple] = {}
    for shape in request.blocks:
        key = (shape.tp, shape.checkpointing)
        if key not in built:
            config, full_vocab = _local_config(request, shape.tp, 1)
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).to(device)
            model.train()
            if shape.checkpointing == "full":
                enable_full_recompute(model)
            bf16 = request.precision == "bf16"
            block = StageModule(model, (0, 1), first=False, last=False)
            embed = StageModule(model, (0, 0), first=True, last=False)
            head = StageModule(model, (0, 0), first=False, last=True)
            for stage in (block, embed, head):
                stage.autocast = bf16
            built[key] = (config, full_vocab, block, embed, head)
        config, full_vocab, block, embed, head = built[key]
        mb, seq, hidden = shape.micro_batch, shape.seq_len, config.hidden_size
        x = torch.randn(mb, seq, hidden, device=device, requires_grad=True)
        grad = torch.randn(mb, seq, hidden, device=device)
        ids = torch.randint(0, config.vocab_size, (mb, seq), device=device)
        labels = torch.randint(0, full_vocab, (mb, seq), device=device)

        def run_block() -> None:
            block(x).backward(grad)
            block.zero_grad(set_to_none=True)

        def run_embed() -> None:
            embed(ids).backward(grad)
            embed.zero_grad(set_to_none=True)

        def run_head() -> None:
            logits = head(x)
            if shape.tp > 1:  # tensor parallelism gathers the vocab-split logits: the loss sees all
                logits = torch.cat([logits] * shape.tp, dim=-1)[..., :full_vocab]
            causal_lm_loss(logits, labels).backward()
            head.zero_grad(set_to_none=True)

        times = {}
        for name, fn in (("block_s", run_block), ("embed_s", run_embed), ("head_s", run_head)):
            barrier()  # every rank computes at once, sharing the host as in a trial
            times[name] = _median_time(fn, device, request.warmup, request.reps, request.statistic)
        out.append({"shape": shape.model_dump(), **times})
    return out


def _profile_collectives(request: ProfileRequest, rank: int, world: int, device, sizes: list[int]) -> list[dict]:
    """Each op on each group layout at each size, every group of a layout at once; the median
    per rank, then the slowest rank's (a collective ends when its last rank is done)."""
    import torch
    import torch.distributed as dist

    rows = []
    for spec in request.groups:
        if spec.size > world:
            continue
        groups = spec.groups(world)
        mine_ranks = next(g for g in groups if rank in g)
        if spec.size == world:
            pg = None  # the default group
        else:
            # Every rank creates every group, with the world group's timeout (c10d's default is 30 min).
            made = [dist.new_group(ranks=g, timeout=timedelta(seconds=PROFILE_COMM_TIMEOUT_S)) for g in groups]
            pg = made[groups.index(mine_ranks)]
        me = mine_ranks.index(rank)
        n = spec.size
        for op in COLLECTIVE_OPS:
            for nbytes in sizes:
                elems = max(n, (nbytes // 4) // n * n)
                if op == "all_reduce":
                    t = torch.empty(elems, device=device)

                    def fn() -> None:
                        dist.all_reduce(t, group=pg)
                elif op == "all_gather":
                    inp = torch.empty(elems // n, device=device)
                    outp = torch.empty(elems, device=device)

                    def fn() -> None:
                        dist.all_gather_into_tensor(outp, inp, group=pg)
                elif op == "reduce_scatter":
                    inp = torch.empty(elems, device=device)
                    outp = torch.empty(elems // n, device=device)

                    def fn() -> None:
                        dist.reduce_scatter_tensor(outp, inp, group=pg)
                else:  # one-way message between neighbours of the group (ping-pong / 2)
                    t = torch.empty(elems, device=device)
                    partner = mine_ranks[me ^ 1] if (me ^ 1) < n else None

                    def fn() -> None:
                        if partner is None:
                            return
                        if me % 2 == 0:
                            dist.send(t, partner)
                            dist.recv(t, partner)
                        else:
                            dist.recv(t, partner)
                            dist.send(t, partner)
                reps = request.reps if nbytes <= 4 * 2**20 else max(2, request.reps - 1)
                dist.barrier()
                seconds = _median_time(fn, device, 1, reps, request.statistic)
                if op == "send_recv":
                    seconds /= 2
                rows.append({"op": op, "size": n, "stride": spec.stride, "bytes": elems * 4, "seconds": seconds})
    if rows:
        t = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for r, s in zip(rows, t.tolist()):
            r["seconds"] = s
    return rows


def _profile_optimizer(request: ProfileRequest, device, barrier: Callable[[], None]) -> list[tuple[float, float]]:
    """Clip + AdamW step + zero_grad, as the trials end a step, on n parameters (in tensors the
    size of a model's: ~10 per decoder layer's worth), for each requested n."""
    import torch

    from paratune.parallel import ADAM_BETAS, ADAM_EPS

    points = []
    for n in request.local_params:
        pieces = max(1, min(64, n // 65_536))
        sizes = [n // pieces + (1 if i < n % pieces else 0) for i in range(pieces)]
        params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in sizes]
        grads = [torch.randn(s, device=device) * 1e-3 for s in sizes]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=ADAM_BETAS, eps=ADAM_EPS)

        def step() -> None:
            for p, g in zip(params, grads):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        barrier()
        points.append((float(n), _median_time(step, device, max(1, request.warmup), request.reps, request.statistic)))
        del params, grads, opt
    return points


def _host_link(device) -> float | None:
    """Bytes/s of a device -> host copy of 64 MiB (what offload pays); on CPU a host memcpy."""
    import torch

    src = torch.empty(16 * 2**20, device=device)
    dst = torch.empty(16 * 2**20, pin_memory=device.type == "cuda")
    seconds = _median_time(lambda: dst.copy_(src), device, 1, 3)
    return src.numel() * 4 / seconds if seconds > 0 else None


def collect_profile(payload: dict, rank: int, world: int, local_world: int, device) -> dict:
    """Worker side, run by every rank of a worker group at the same time; rank 0's return value
    is the profile (as a dict). Block and optimizer times are the slowest rank's."""
    import torch
    import torch.distributed as dist

    request = ProfileRequest.model_validate(payload)
    t0 = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized() and world > 1

    def barrier() -> None:
        if distributed:
            dist.barrier()

    torch.manual_seed(1234 + rank)
    blocks = _profile_block_shapes(request, device, barrier)
    sizes = list(request.sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES))
    collectives = _profile_collectives(request, rank, world, device, sizes) if distributed else []
    optimizer = _profile_optimizer(request, device, barrier)
    host = _host_link(device)
    if distributed:  # the slowest rank's times: a step waits for its last rank
        flat = [v for b in blocks for v in (b["block_s"], b["embed_s"], b["head_s"])] + [s for _, s in optimizer]
        t = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = iter(t.tolist())
        for b in blocks:
            b["block_s"], b["embed_s"], b["head_s"] = next(values), next(values), next(values)
        optimizer = [(n, next(values)) for n, _ in optimizer]
    return {"blocks": blocks, "collectives": collectives, "optimizer": optimizer, "host_link_bytes_per_s": host,
            "device_type": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "local_world_size": local_world, "profile_s": time.perf_counter() - t0,
            "env_seen": {k: os.environ.get(k) for k in request.env}}


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


# --------------------------------------------------------------------------- driver side
def _profile_worker_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker for a profile: rank 0's return value reaches the driver."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    return collect_profile(config["request"], ctx.get_world_rank(), ctx.get_world_size(),
                           ctx.get_local_world_size(), ray.train.torch.get_device())


def workers_plan(request: ProfileRequest) -> Plan:
    """A plan with the request's workers, env, host CPUs and device, for paratune.launch (worker
    env, resources, backend): the profile runs where and as the trials run."""
    return Plan(model=request.model, model_overrides=request.model_overrides, num_workers=request.world_size,
                global_batch=request.world_size, micro_batch=1, env=request.env, precision=request.precision,
                cpus_per_worker=request.cpus_per_worker, device=request.device_type,
                gpus_per_node=request.gpus_per_node)


def _run_with_ray(request: ProfileRequest, ray_address: str | None, storage_path: str | None) -> dict:
    import uuid

    from paratune.launch import (Deadline, build_trainer, ensure_ray, fit, placement_groups, process_group_backend,
                                 remove_leaked_placement_groups, worker_demand)

    ensure_ray(ray_address)
    plan = workers_plan(request)
    workers = worker_demand(plan)
    before = set(placement_groups())
    trainer = build_trainer(  # the env in place before the process group starts, as for a trial
        _profile_worker_loop, {"request": request.model_dump(mode="json")},
        name=f"profile-{uuid.uuid4().hex[:8]}", workers=workers, backend=process_group_backend(plan, workers.use_gpu),
        comm_timeout_s=PROFILE_COMM_TIMEOUT_S, storage_path=storage_path, deadline=Deadline(request.timeout_s))
    result, error = fit(trainer)  # an error: reported with its cause below
    out = result.return_value if result is not None else None
    if error is not None or out is None:
        remove_leaked_placement_groups(before)
        raise ProfileError(f"profile of {request.model} on {request.world_size} workers (env {request.env}) "
                           f"failed: {type(error).__name__ if error else 'no result'}: {error}")
    return out


def run_profile(request: ProfileRequest, runner: Runner | None = None, *, ray_address: str | None = None,
                storage_path: str | None = None) -> Profile:
    """Measure a profile on the request's workers. By default one Ray Train job, like a trial
    (the env in place before the process group starts); `runner(function_path, payload)` runs
    `collect_profile` on an already running worker group instead and returns rank 0's result."""
    payload = request.model_dump(mode="json")
    out = runner(PROFILE_FUNCTION, payload) if runner is not None else _run_with_ray(request, ray_address, storage_path)
    return profile_from_result(request, out)


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
