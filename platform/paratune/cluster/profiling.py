"""Measuring a profile: the timing every rank of a worker group runs, and the Ray Train job that runs it.

On every rank of a real worker group at the same time (so CPU ranks share the cores as in a
trial; GPU ranks each have their own GPU), `collect_profile` times one decoder layer, the
embedding and the LM head with the loss (the real transformers modules at the tensor-parallel-local
shape, in the plan precision: bf16 autocast as the trials use), the collectives on each requested
group layout at a few message sizes, the optimizer step (torch AdamW with clipping and zero_grad,
as the trials step) and the host link; warm-up excluded, the device synchronised before each
clock read, the minimum (or the median) of a few repetitions, the slowest rank's figure.

The lever values a block shape carries (checkpointing, compile, float8, LoRA's frozen base) and the
head's loss form are applied through the trials' own path (paratune.parallel.runner.apply_levers, every
stage) on a model built as a trial builds it.

`run_profile` runs it as one Ray Train job (paratune.cluster.launch, like a trial), or through a
`runner` that already holds a worker group (the sweep's pool), and fits the curves and the
optimizer line (`profile_from_result`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable

from paratune.config.sizes import config_sizes
from paratune.config.plan import Plan
from paratune.costs.profile import (
    COLLECTIVE_OPS,
    LEVER_FIELDS,
    BlockShape,
    BlockTime,
    Curve,
    HeadShape,
    HeadTime,
    LinearFit,
    Profile,
    ProfileError,
    ProfileRequest,
)

# A profile's collectives (world group and the sub-groups it measures) time out after this.
PROFILE_COMM_TIMEOUT_S = 300.0

PROFILE_FUNCTION = "paratune.cluster.profiling:collect_profile"
Runner = Callable[[str, dict], dict]  # (function path, payload) -> rank 0's result
# Message sizes (bytes): fewer and smaller on CPU, where gloo moves a few GB/s at best.
CPU_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20)
GPU_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 64 * 2**20, 256 * 2**20)


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
    from paratune.model.build import build_config, ffn_width_key

    full = build_config(request.model, request.model_overrides)
    sizes = config_sizes(full)
    heads, kv, head_dim = sizes.heads, sizes.kv_heads, sizes.head_dim
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


def lever_plan(request: ProfileRequest, shape: BlockShape | None = None, loss: str = "standard") -> Plan:
    """A one-rank plan carrying a block shape's levers (and a loss form): what the lever functions
    of paratune.parallel read, so the profile's block runs what a trial's does."""
    levers = {} if shape is None else {"activation_checkpointing": shape.checkpointing, "compile": shape.compile,
                                       "float8": shape.float8, "peft": json.loads(shape.peft) if shape.peft else None}
    return Plan(model=request.model, model_overrides=request.model_overrides, num_workers=1, global_batch=1,
                micro_batch=1, precision=request.precision, device=request.device_type, loss=loss, **levers)


def _build_levered(request: ProfileRequest, tp: int, layers: int, plan: Plan, device):
    """The rank's tp slice with `layers` decoder blocks, built as a trial builds its model: on the
    meta device, the plan's levers applied at the trials' call sites (float8 and the loss form,
    checkpointing, compile), then materialized. (config, full vocab size, model)."""
    import torch

    from paratune.model.adapters import add_adapters, prepare_init
    from paratune.model.materialize import ModelInit, build_meta, materialize
    from paratune.levers import APPLY_STAGES
    from paratune.parallel.runner import apply_levers

    config, full_vocab = _local_config(request, tp, layers)
    torch.manual_seed(0)
    model = add_adapters(build_meta(config), plan)  # LoRA: the frozen base, as build_runner adds it
    init = ModelInit(model, config, seed=0)
    prepare_init(init, plan)
    for stage in APPLY_STAGES:
        apply_levers(model, plan, stage)
    materialize(model, init, device)
    model.train()
    return config, full_vocab, model


def _first_call_s(fn: Callable[[], None], device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _profile_block_shapes(request: ProfileRequest, device, barrier: Callable[[], None],
                          notes: list[str]) -> list[dict]:
    """Forward + backward of one decoder layer for every requested shape with its levers, and the
    embedding and the standard head once per (micro_batch, seq_len, tp) (no lever changes them):
    the real transformers modules, the trials' precision handling. A compiled block's first call
    (the compile, or the dynamic-shape recompile of a second shape) is timed apart, as compile_s;
    each compiled lever set starts from a reset Dynamo cache.
    A lever the runtime does not implement yet leaves its shapes out, with a note."""
    import torch

    from paratune.parallel.pp import StageModule, causal_lm_loss

    out = []
    built: dict[tuple, tuple | None] = {}
    ends: dict[tuple[int, int, int], tuple[float, float]] = {}
    for shape in request.blocks:
        key = (shape.tp, shape.levers)
        if key not in built:
            if shape.compile:  # earlier lever sets' graphs must not count against Dynamo's recompile limit
                torch._dynamo.reset()
            try:
                config, full_vocab, model = _build_levered(request, shape.tp, 1, lever_plan(request, shape), device)
            except NotImplementedError as err:
                built[key] = None
                notes.append(f"blocks with {dict(zip(LEVER_FIELDS, shape.levers))} not "
                             f"profiled: {err}")
                continue
            stages = [StageModule(model, (0, 1), first=False, last=False),
                      StageModule(model, (0, 0), first=True, last=False), StageModule(model, (0, 0), first=False, last=True)]
            for stage in stages:
                stage.autocast = request.precision == "bf16"
            built[key] = (config, full_vocab, *stages)
        if built[key] is None:
            continue
        config, full_vocab, block, embed, head = built[key]
        mb, seq, hidden = shape.micro_batch, shape.seq_len, config.hidden_size
        x = torch.randn(mb, seq, hidden, device=device, requires_grad=True)
        grad = torch.randn(mb, seq, hidden, device=device)
        ids = torch.randint(0, config_sizes(config).vocab, (mb, seq), device=device)
        labels = torch.randint(0, full_vocab, (mb, seq), device=device)

        def run_block() -> None:
            block(x).backward(grad)
            block.zero_grad(set_to_none=True)

        def run_embed() -> None:
            out = embed(ids)
            if out.requires_grad:  # a frozen embedding (LoRA) has no backward in a trial either
                out.backward(grad)
            embed.zero_grad(set_to_none=True)

        def run_head() -> None:
            logits = head(x)
            if shape.tp > 1:  # tensor parallelism gathers the vocab-split logits: the loss sees all
                logits = torch.cat([logits] * shape.tp, dim=-1)[..., :full_vocab]
            causal_lm_loss(logits, labels).backward()
            head.zero_grad(set_to_none=True)

        row: dict[str, Any] = {"shape": shape.model_dump()}
        barrier()  # every rank computes at once, sharing the host as in a trial
        # A compiled block past Dynamo's recompile limit would silently run eager: fail instead.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True) if shape.compile else nullcontext():
            if shape.compile:  # warmed before timing: the first call compiles
                row["compile_s"] = _first_call_s(run_block, device)
            row["block_s"] = _median_time(run_block, device, request.warmup, request.reps, request.statistic)
        if shape.compile:
            row["compile_s"] = max(0.0, row["compile_s"] - row["block_s"])
        at = (mb, seq, shape.tp)
        if at not in ends:
            barrier()
            embed_s = _median_time(run_embed, device, request.warmup, request.reps, request.statistic)
            barrier()
            ends[at] = (embed_s, _median_time(run_head, device, request.warmup, request.reps, request.statistic))
        row["embed_s"], row["head_s"] = ends[at]
        out.append(row)
    return out


def _profile_heads(request: ProfileRequest, device, barrier: Callable[[], None], notes: list[str]) -> list[dict]:
    """The head with each non-standard loss form requested. chunked (tp 1): the trials' own model
    path (model(inputs_embeds=..., labels=...).loss, its decoder blocks removed after building)
    with the form applied by paratune.parallel.loss. vocab_parallel (tp > 1): its local work, the head at vocab/tp and the
    loss over the rank's vocabulary slice (no logits gathered); its all-reduces of per-token
    statistics are the time model's, on the measured tp curve (a rank alone has no tp mesh)."""
    import torch

    from paratune.parallel.pp import StageModule, causal_lm_loss

    out = []
    autocast = request.precision == "bf16"
    for shape in request.heads:
        plan = lever_plan(request, loss=shape.loss if shape.loss == "chunked" else "standard")
        try:
            config, _, model = _build_levered(request, shape.tp, 1, plan, device)
        except NotImplementedError as err:
            notes.append(f"head with loss {shape.loss!r} not profiled: {err}")
            continue
        mb, seq = shape.micro_batch, shape.seq_len
        x = torch.randn(mb, seq, config.hidden_size, device=device, requires_grad=True)
        labels = torch.randint(0, config_sizes(config).vocab, (mb, seq), device=device)
        head = None if shape.loss == "chunked" else StageModule(model, (0, 0), first=False, last=True)
        if head is not None:
            head.autocast = autocast
        if shape.loss == "chunked":  # the model's own forward without its block: norm, head, loss
            from paratune.model.build import block_stacks

            for _, stack in block_stacks(model):
                del stack[:]

        def run_chunked() -> None:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(inputs_embeds=x, labels=labels).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        def run_vocab_parallel() -> None:
            causal_lm_loss(head(x), labels).backward()
            head.zero_grad(set_to_none=True)

        barrier()
        fn = run_chunked if shape.loss == "chunked" else run_vocab_parallel
        out.append({"shape": shape.model_dump(),
                    "head_s": _median_time(fn, device, request.warmup, request.reps, request.statistic)})
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

    from paratune.parallel.runner import ADAM_BETAS, ADAM_EPS

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
    notes: list[str] = []
    blocks = _profile_block_shapes(request, device, barrier, notes)
    heads = _profile_heads(request, device, barrier, notes)
    sizes = list(request.sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES))
    collectives = _profile_collectives(request, rank, world, device, sizes) if distributed else []
    optimizer = _profile_optimizer(request, device, barrier)
    host = _host_link(device)
    if distributed:  # the slowest rank's times: a step waits for its last rank
        fields = ("block_s", "embed_s", "head_s", "compile_s")
        flat = [b.get(f, 0.0) for b in blocks for f in fields] + [h["head_s"] for h in heads] + [s for _, s in optimizer]
        t = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = iter(t.tolist())
        for b in blocks:
            for f in fields:
                value = next(values)
                if f in b:
                    b[f] = value
        for h in heads:
            h["head_s"] = next(values)
        optimizer = [(n, next(values)) for n, _ in optimizer]
    return {"blocks": blocks, "heads": heads, "notes": notes, "collectives": collectives, "optimizer": optimizer, "host_link_bytes_per_s": host,
            "device_type": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "local_world_size": local_world, "profile_s": time.perf_counter() - t0,
            "env_seen": {k: os.environ.get(k) for k in request.env}}


# --------------------------------------------------------------------------- driver side
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
    notes = list(out.get("notes", []))  # e.g. a lever the runtime does not implement yet
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
                          head_s=b["head_s"], compile_s=b.get("compile_s")) for b in out["blocks"]],
        heads=[HeadTime(shape=HeadShape(**h["shape"]), head_s=h["head_s"]) for h in out.get("heads", [])],
        collectives=curves, optimizer=fit_linear([tuple(p) for p in out.get("optimizer", [])]),
        host_link_bytes_per_s=out.get("host_link_bytes_per_s"), profile_s=float(out.get("profile_s", 0.0)),
        created_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), notes=notes)


def _profile_worker_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker for a profile: rank 0's return value reaches the driver."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    return collect_profile(config["request"], ctx.get_world_rank(), ctx.get_world_size(),
                           ctx.get_local_world_size(), ray.train.torch.get_device())


def workers_plan(request: ProfileRequest) -> Plan:
    """A plan with the request's workers, env, host CPUs and device, for paratune.cluster.launch (worker
    env, resources, backend): the profile runs where and as the trials run."""
    return Plan(model=request.model, model_overrides=request.model_overrides, num_workers=request.world_size,
                global_batch=request.world_size, micro_batch=1, env=request.env, precision=request.precision,
                cpus_per_worker=request.cpus_per_worker, device=request.device_type,
                gpus_per_node=request.gpus_per_node)


def _run_with_ray(request: ProfileRequest, ray_address: str | None, storage_path: str | None) -> dict:
    import uuid

    from paratune.cluster.launch import (
        Deadline,
        build_trainer,
        ensure_ray,
        fit,
        placement_groups,
        process_group_backend,
        remove_leaked_placement_groups,
        return_value,
        worker_demand,
    )

    ensure_ray(ray_address)
    plan = workers_plan(request)
    workers = worker_demand(plan)
    before = set(placement_groups())
    trainer = build_trainer(  # the env in place before the process group starts, as for a trial
        _profile_worker_loop, {"request": request.model_dump(mode="json")},
        name=f"profile-{uuid.uuid4().hex[:8]}", workers=workers, backend=process_group_backend(plan, workers.use_gpu),
        comm_timeout_s=PROFILE_COMM_TIMEOUT_S, storage_path=storage_path, deadline=Deadline(request.timeout_s))
    result, error = fit(trainer)  # an error: reported with its cause below
    out = return_value(result)
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
