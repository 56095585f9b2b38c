"""Measuring a profile: the timing every rank of a worker group runs, and the Ray Train job that runs it.

On every rank of a real worker group at the same time (so CPU ranks share the cores as in a
trial; GPU ranks each have their own GPU), `collect_profile` times one decoder layer, the
embedding and the LM head with the loss (the real transformers modules at the tensor-parallel-local
shape, in the plan precision: bf16 autocast as the trials use), the collectives on each requested
group layout at a few message sizes, the optimizer step (torch AdamW with clipping and zero_grad,
as the trials step) and the host link; warm-up excluded, the device synchronised before each
clock read, the minimum (or the median) of a few repetitions, the slowest rank's figure.

`run_profile` runs it as one Ray Train job (paratune.launch, like a trial), or through a
`runner` that already holds a worker group (the sweep's pool), and fits the records
(paratune.profile).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

from paratune.plan import Plan
from paratune.profile import COLLECTIVE_OPS, Profile, ProfileError, ProfileRequest, profile_from_result

# A profile's collectives (world group and the sub-groups it measures) time out after this.
PROFILE_COMM_TIMEOUT_S = 300.0

PROFILE_FUNCTION = "paratune.profiling:collect_profile"
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

    from paratune.parallel.recompute import enable_full_recompute
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
