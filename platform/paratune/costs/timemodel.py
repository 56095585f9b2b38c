"""Step time per plan, composed from a measured profile and refitted on measured trials.

Why not the roofline (paratune.costs.estimate.Roofline): with a few global constants it predicts every
data-parallel strategy at the same micro-batch at the same time, and misses what the device
really does at a given shape. Here each term comes from a measurement of the real thing on the
real workers (paratune.costs.profile), composed the way each framework schedules its work:

- compute: (layers on the rank's stage) x the measured block forward+backward at
  (micro_batch, seq_len/cp, tp, checkpointing, compile, float8 recipe) (`layers` checkpointing:
  its recomputed blocks at the `full` block's time, the others at `none`'s), + the embedding on
  the first stage and the LM head with the plan's loss form on the last, per micro-batch; x the
  micro-batches, plus the pipeline's fill and drain ((pp-1) stage-times; /2 interleaved: a
  bubble of (pp-1)/(m+pp-1)); a lever the profile did not measure is derived (Profile.block) and
  the prediction's note says so;
- tp: the per-layer all-reduces of micro_batch x seq x hidden activations (2 forward, 2 backward,
  2 more in each block whose forward is recomputed whole; selective recompute saves the
  collectives' outputs; all-gather + reduce-scatter under sequence parallelism), the embedding's
  and the LM head's (standard: logits gathered; vocab_parallel: 3 all-reduces of per-token fp32
  statistics instead; DeepSpeed AutoTP all-reduces the logits), on the measured tp-group curve,
  exposed (the next op waits on them);
- pp: activations forward and their gradients back at each stage boundary (send/recv curve);
- dp: DDP all-reduces its gradient buckets (the first 1 MiB, then bucket_cap_mb) once per step;
  FSDP2 all-gathers every unit each micro-batch (twice for blocks that reshard after forward; the
  root never does; a block's weights in 1 byte with the float8 all-gather) and reduce-scatters its gradients each micro-batch; DeepSpeed ZeRO-1/2
  reduce(-scatter) gradients in reduce buckets (ZeRO-1 at the boundary, ZeRO-2 every micro-batch)
  and all-gather the updated partition in allgather buckets; ZeRO-3 gathers every module above
  its persistence threshold once per micro-batch (its default reuse distance keeps them for
  backward) and reduce-scatters in reduce buckets. On GPUs the overlap is modelled (DDP: all but
  the last bucket under backward; FSDP2: prefetch hides all but the first gather); on CPU compute
  and communication share the cores, so everything counts and the exposed fraction is a refit
  coefficient;
- ep: each MoE layer's all-to-all (dispatch and combine, forward and backward) on the ep group's
  curve, exposed; the experts' own data-parallel collectives on their expert_dp group (`compose`);
- optimizer: the measured clip + AdamW + zero_grad line at the rank's local parameter count;
- offload: shapes.offload_bytes over the measured host link.

Refit (`observe`): non-negative least squares of measured step time (relative errors) on the
terms' multipliers, a fixed cost per step and per micro-batch, and a per-framework cost per
micro-batch (DDP, FSDP2, DeepSpeed, ZeRO-3's hooks, DTensor TP, AutoTP, the pipeline schedule:
overheads a block profile cannot see), regularised toward the profile's own prediction
(multipliers 1, overheads 0) so that 1-3 trials cannot wreck it.
"""

from __future__ import annotations

import json
import math
import statistics
from functools import lru_cache

from paratune.levers import tp_comm_hidden
from paratune.costs.moe import DEFAULT_IMBALANCE
from paratune.config.plan import Plan
from paratune.costs.predict import StepPrediction
from paratune.costs.profile import BlockTime, Profile, head_loss, peft_lever

MULTIPLIERS = ("compute", "tp_comm", "pp_comm", "dp_comm", "optimizer", "offload", "ep_comm")
FAMILIES = ("ddp", "fsdp", "deepspeed", "zero3", "dtensor_tp", "autotp", "pipeline")
OVERHEAD_UNIT_S = 0.01  # an overhead coefficient of 1 = 10 ms
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
ZERO3_PERSISTENCE = 100_000  # DeepSpeed stage3_param_persistence_threshold default (elements)
ZERO3_MAX_REUSE = 1_000_000_000  # stage3_max_reuse_distance default: gathered params kept for backward
PRIOR_BAND = 0.10  # the stated error band before 3 trials (the profile's own prediction)
MIN_BAND = 0.02
# Regularisation toward the prior, as a Gaussian prior against trial noise: with a trial's
# relative error ~15% (sigma_e: step-time spread on a shared host plus what the terms miss), multipliers within ~0.25 of 1, the shared fixed costs (per step,
# per micro-batch) within ~1 unit (10 ms) and each framework's within ~5 units (50 ms) of 0
# (sigma_c): weight = (sigma_e / sigma_c)^2. An odd trial is then mostly put down to its own
# framework, not to every plan; a few dozen trials outweigh the prior.
TRIAL_NOISE = 0.15
HUBER = 0.15  # relative error past which a trial counts linearly in the refit (robust to outliers)
MULTIPLIER_WEIGHT = (TRIAL_NOISE / 0.25) ** 2
SHARED_OVERHEAD_WEIGHT = (TRIAL_NOISE / 1.0) ** 2
OVERHEAD_WEIGHT = (TRIAL_NOISE / 5.0) ** 2


# --------------------------------------------------------------------------- model pieces
@lru_cache(maxsize=32)
def _module_sizes(config_json: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Parameter counts of the modules that own parameters directly: the largest block's (MoE
    models with dense first layers, DeepSeek-V3: a dense block is not the typical one), the rest's."""
    import torch
    from transformers import AutoModelForCausalLM

    from paratune.model.build import config_from_key, decoder_blocks

    config = config_from_key(config_json)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = decoder_blocks(model)
    largest = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()))
    in_block = {id(m) for m in largest.modules()}
    in_any_block = {id(m) for b in blocks for m in b.modules()}
    block, rest, seen = [], [], set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        n = sum(p.numel() for p in own)
        if not n:
            continue
        if id(module) in in_block:
            block.append(n)
        elif id(module) not in in_any_block:
            rest.append(n)
    return tuple(block), tuple(rest)


def module_sizes(plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from paratune.model.build import build_config, config_key

    return _module_sizes(config_key(build_config(plan.model, plan.model_overrides)))


def families(plan: Plan) -> list[str]:
    """The frameworks that run a plan's step (each has a per-micro-batch cost of its own)."""
    out = []
    dp = plan.dp_degree * plan.cp
    if plan.strategy == "zero":
        out.append("deepspeed")
        if plan.zero is not None and plan.zero.stage == 3:
            out.append("zero3")
        if plan.tp > 1:
            out.append("autotp")
        return out
    model_parallel = plan.tp > 1 or plan.pp > 1 or plan.cp > 1
    if not model_parallel or dp > 1:  # the nd path has no dp wrapper when dp x cp == 1
        if plan.strategy == "ddp" and plan.pp == 1:
            out.append("ddp")
        else:  # FSDP2 (fully_shard or replicate), also DDP semantics under pipeline schedules
            out.append("fsdp")
    if plan.tp > 1:
        out.append("dtensor_tp")
    if plan.pp > 1:
        out.append("pipeline")
    return out


def _buckets(total_bytes: float, bucket_bytes: float, first_bytes: float | None = None) -> list[float]:
    """Sizes of the buckets a gradient of `total_bytes` is reduced in."""
    out, left = [], float(total_bytes)
    if first_bytes and left > 0:
        out.append(min(left, first_bytes))
        left -= out[-1]
    bucket_bytes = max(1.0, float(bucket_bytes))
    while left > 0:
        out.append(min(left, bucket_bytes))
        left -= out[-1]
    return out


def _stage_layers(plan: Plan, layers: int) -> list[tuple[int, bool, bool]]:
    """Per pipeline rank: (decoder layers it holds, holds the embedding, holds the head)."""
    from paratune.parallel.pp import stage_layer_ranges

    if plan.pp == 1:
        return [(layers, True, True)]
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    stages = stage_layer_ranges(layers, plan.pp * v)
    out = []
    for rank in range(plan.pp):
        mine = [rank + k * plan.pp for k in range(v)]
        out.append((sum(stages[i][1] - stages[i][0] for i in mine), 0 in mine, plan.pp * v - 1 in mine))
    return out


def _recomputed_layers(plan: Plan, layers: int) -> list[int]:
    """Per pipeline rank: how many of its blocks recompute their forward whole. `layers`: every
    checkpoint_every-th block of the model, counted from the first (transformers' every_n_layers:
    block i when i % N == 0)."""
    from paratune.parallel.pp import stage_layer_ranges

    ac = plan.activation_checkpointing
    every = 1 if ac == "full" else plan.checkpoint_every if ac == "layers" else 0
    v = 2 if plan.pp_schedule == "interleaved_1f1b" and plan.pp > 1 else 1
    stages = stage_layer_ranges(layers, plan.pp * v)
    if not every:
        return [0] * plan.pp
    return [sum(sum(1 for i in range(*stages[rank + k * plan.pp]) if i % every == 0) for k in range(v))
            for rank in range(plan.pp)]


def plan_blocks_times(plan: Plan, profile: Profile) -> tuple[BlockTime, BlockTime]:
    """(the block a plan's step runs, the one it runs where the forward is recomputed whole):
    the same one unless checkpointing is `layers` (then `none`'s and `full`'s)."""
    mb, seq, ac = plan.micro_batch, plan.seq_len // plan.cp, plan.activation_checkpointing
    peft = peft_lever(plan)  # LoRA: a frozen base's backward
    plain = profile.block(mb, seq, plan.tp, "none" if ac == "layers" else ac, plan.compile, plan.float8, peft)
    if ac != "layers":
        return plain, plain
    return plain, profile.block(mb, seq, plan.tp, "full", plan.compile, plan.float8, peft)


def lever_notes(plan: Plan, profile: Profile) -> list[str]:
    """What the profile did not measure for this plan's levers and loss form, and what stood in."""
    notes = [b.derived for b in plan_blocks_times(plan, profile) if b.derived]
    _, head_note = profile.head(plan.micro_batch, plan.seq_len // plan.cp, plan.tp, head_loss(plan))
    return list(dict.fromkeys(notes + ([head_note] if head_note else [])))


def compile_seconds(plan: Plan, profile: Profile) -> float | None:
    """What the first step of a compiled plan spends compiling on fresh workers: the profile's cold
    compile of a block with the plan's tp and levers (the largest compile_s among them: the
    profile's later shapes paid only a dynamic-shape recompile, or nothing); `layers`
    checkpointing compiles two graphs, with and without recompute. A reused worker group with
    warm caches pays less. None when the plan does not compile or no such block was profiled."""
    if not plan.compile:
        return None
    total = 0.0
    for bt in {b.shape.checkpointing: b for b in plan_blocks_times(plan, profile)}.values():
        cold = [b.compile_s for b in profile.blocks if b.compile_s is not None and b.shape.tp == plan.tp
                and b.shape.levers == bt.shape.levers]
        if not cold:
            return None
        total += max(cold)
    return total


def compose(plan: Plan, profile: Profile, imbalance: float = DEFAULT_IMBALANCE) -> dict[str, float]:
    """The plan's terms in seconds (MULTIPLIERS, each at multiplier 1) and its overhead features
    (micro-batches, steps, per-framework micro-batches; in OVERHEAD_UNIT_S units).

    Expert parallelism (paratune.costs.moe): the profiled block has every expert local and runs
    each token's top_k rows itself, which is the mean rank's expert work under ep; the busiest
    rank's is `imbalance` x that, so the block time grows by the routed experts' FLOPs share x
    (imbalance - 1) (the profile times the block whole, not its experts apart: a rate of their
    own would need the profiler to time the experts module alone). The all-to-all (ep_comm,
    exposed: 4 exchanges per MoE layer and micro-batch) is timed on the ep group's all-gather
    curve (an all-gather of an S-byte output moves what an all-to-all of an S-byte buffer does,
    (n-1)/n of it over each rank's link; the profile has no all-to-all curve); the experts'
    gathers and reduce-scatters (FSDP2) or their all-reduce (DDP, once per step) run on the
    expert_dp group (ranks ep apart), the dense part's on dp as without ep."""
    from paratune.costs.efficiency import fsdp_copy_seconds_per_micro_batch
    from paratune.costs.estimate import data_parallel_comm
    from paratune.costs.moe import expert_flops_share, expert_layout, held_with_experts
    from paratune.model.shapes import fsdp_shard_degree, local_params, model_shape, offload_bytes, replicas

    shape = model_shape(plan)
    m, t, p = plan.grad_accum, plan.tp, plan.pp
    mb, seq = plan.micro_batch, plan.seq_len // plan.cp
    act = 2 if plan.precision == "bf16" else 4  # bytes of an activation element (autocast: bf16)
    gpu = profile.device_type == "cuda"
    bt, recomputed_bt = plan_blocks_times(plan, profile)
    form = head_loss(plan)
    head_s = bt.head_s if form == "standard" else profile.head(mb, seq, t, form)[0]
    stages = _stage_layers(plan, shape.layers)
    recomputed = _recomputed_layers(plan, shape.layers)

    # ---- compute: the slowest pipeline rank's micro-batch, times the schedule's length
    per_rank = [(n - k) * bt.block_s + k * recomputed_bt.block_s + (bt.embed_s if emb else 0.0)
                + (head_s if head else 0.0) for (n, emb, head), k in zip(stages, recomputed)]
    t_mb = max(per_rank)
    if gpu:  # FSDP2's copies around its collectives, on the compute stream (the roofline's term)
        t_mb += fsdp_copy_seconds_per_micro_batch(plan, profile.device_name, shape)
    if plan.ep > 1 and imbalance > 1.0:  # the busiest rank's experts (see above)
        t_mb *= 1 + expert_flops_share(plan) * (imbalance - 1.0)
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    slots = m + (p - 1) / v  # (m + p - 1) stage slots; interleaving halves the fill and drain
    compute = t_mb * slots

    # ---- tensor parallel: exposed per micro-batch on the stage, like compute
    tp_comm = 0.0
    if t > 1:
        ar = lambda nbytes: profile.comm_seconds("all_reduce", t, nbytes, 1)  # noqa: E731
        if plan.sequence_parallel:
            ar = lambda nbytes: (profile.comm_seconds("all_gather", t, nbytes, 1)  # noqa: E731
                                 + profile.comm_seconds("reduce_scatter", t, nbytes, 1))
        act_bytes = mb * seq * shape.hidden * act
        # 4 per block, 2 more in each block whose forward is recomputed whole (selective keeps them)
        layer_collectives = max(4 * n + 2 * k for (n, _, _), k in zip(stages, recomputed))
        logits = mb * seq * shape.vocab * act
        if plan.strategy == "zero":  # AutoTP: the head is LinearAllreduce (logits all-reduced), embedding whole
            ends = profile.comm_seconds("all_reduce", t, logits, 1)
        elif form == "vocab_parallel":  # loss_parallel: max, sum of exp and the target's logit all-reduced
            ends = 2 * ar(act_bytes) + 3 * profile.comm_seconds("all_reduce", t, mb * seq * 4, 1)
        else:  # vocab-parallel embedding (all-reduced), colwise head (logits gathered, input grad reduced)
            ends = 2 * ar(act_bytes) + profile.comm_seconds("all_gather", t, logits, 1)
        tp_comm = (layer_collectives * ar(act_bytes) + ends) * slots
        tp_comm *= 1 - tp_comm_hidden(plan)  # the levers' (async TP: the forward's, micro-pipelined into its matmuls)

    # ---- pipeline: activations forward, gradients back, at each boundary, per micro-batch
    pp_comm = 0.0
    if p > 1:
        act_bytes = mb * seq * shape.hidden * act / (t if plan.sequence_parallel else 1)
        pp_comm = 2 * v * m * profile.comm_seconds("send_recv", p, act_bytes, plan.num_workers // p)

    # ---- data parallel: the collectives estimate.data_parallel_comm describes, on the measured curves
    local, layer = local_params(plan, shape)
    held, share = held_with_experts(plan, shape)
    expert_local = expert_layer = 0.0
    ep_comm = 0.0
    if share is not None:  # the dense part on dp below; the experts (E / ep) on expert_dp after it
        layout = expert_layout(plan)
        expert_local = share.local
        expert_layer = layout.total / max(1, len(layout.per_layer)) / share.ep  # the mean block's
        local, layer = held.local - expert_local, layer - expert_layer * share.ep
        moe_here = min(max(n for n, _, _ in stages), layout.moe_layers)
        rows = mb * seq * layout.top_k * shape.hidden * act * imbalance  # one exchange's buffer, busiest rank
        ep_comm = 4 * moe_here * m * profile.comm_seconds("all_gather", plan.ep, rows, t)
    # LoRA: only the adapters have gradients to reduce; FSDP2 still gathers the frozen base.
    g_local, g_layer = local, layer
    if plan.peft is not None:
        from paratune.model.adapters import adapted_params

        _, trained = adapted_params(plan, held, max(n for n, _, _ in stages))
        g_local, g_layer = trained.local, trained.layer
    dp = replicas(plan)
    d = data_parallel_comm(plan)
    stride = t
    dp_comm = 0.0
    if dp > 1:
        AR = lambda nbytes, size=dp: profile.comm_seconds("all_reduce", size, nbytes, stride)  # noqa: E731
        AG = lambda nbytes, size=dp: profile.comm_seconds("all_gather", size, nbytes, stride)  # noqa: E731
        RS = lambda nbytes, size=dp: profile.comm_seconds("reduce_scatter", size, nbytes, stride)  # noqa: E731
        backward_last = t_mb * 2 / 3  # backward is ~2/3 of a micro-batch's compute
        if d.scheme == "all_reduce":
            if d.ddp_buckets:
                cap = (plan.ddp.bucket_cap_mb if plan.ddp else 25.0) * 2**20
                buckets = _buckets(d.grad_bytes * g_local, cap, DDP_FIRST_BUCKET_BYTES)
            else:  # FSDP2 replicate: one all-reduce per unit
                blocks_here = max(n for n, _, _ in _stage_layers(plan, shape.layers))
                buckets = [d.grad_bytes * g_layer] * blocks_here + [d.grad_bytes * max(0.0, g_local - blocks_here * g_layer)]
            times = [AR(b) for b in buckets if b > 0]
            dp_comm = (times[-1] + max(0.0, sum(times[:-1]) - backward_last)) if gpu else sum(times)
            if share is not None and share.expert_dp > 1:  # the experts all-reduced once per step, after backward
                dp_comm += profile.comm_seconds("all_reduce", share.expert_dp, d.grad_bytes * expert_local, stride * share.ep)
        elif d.scheme == "fsdp":
            shard = fsdp_shard_degree(plan)
            pb = d.param_bytes  # FSDP2 gathers in its param dtype (bf16 under mixed precision)
            blocks_here = max(n for n, _, _ in _stage_layers(plan, shape.layers))
            root = max(0.0, local - blocks_here * layer)
            block_pb = 1 if plan.float8_all_gather else pb  # float8 weights gathered as bytes
            ag_block, ag_root = AG(block_pb * layer, shard), AG(pb * root, shard)
            g_root = max(0.0, g_local - blocks_here * g_layer)
            rs = blocks_here * RS(d.grad_bytes * g_layer, shard) + RS(d.grad_bytes * g_root, shard)
            if share is not None and share.expert_dp > 1:  # each block's experts over their copies
                edp, estride = share.expert_dp, stride * share.ep
                ag_block += profile.comm_seconds("all_gather", edp, block_pb * expert_layer, estride)
                rs += blocks_here * profile.comm_seconds("reduce_scatter", edp, d.grad_bytes * expert_layer, estride)
            per_mb = d.gathers_per_micro_batch * blocks_here * ag_block + ag_root + rs
            if shard < dp:  # hybrid: the shards' gradients all-reduced across replicas once per step
                extra = AR(4 * g_local / shard, dp // shard)
            else:
                extra = 0.0
            if gpu:  # prefetch hides all but the first gather; the rest under compute
                hidden = max(0.0, per_mb - ag_root - t_mb)
                dp_comm = m * (ag_root + hidden) + extra
            else:
                dp_comm = m * per_mb + extra
        else:
            z = plan.zero
            pb = d.param_bytes
            # LoRA: the adapters' gradients reduced, their updated partitions gathered (ZeRO 1-2)
            red = _buckets(d.grad_bytes * g_local, d.grad_bytes * (z.reduce_bucket_size if z else 5e8))
            gat = _buckets(pb * g_local, pb * (z.allgather_bucket_size if z else 5e8))
            if not d.gathers_per_micro_batch:  # ZeRO 0-2: reduce buckets; the partition gathered once
                reduce = AR if d.gradients == "all_reduce" else RS
                grads = sum(reduce(b) for b in red)
                dp_comm = (m * grads if d.grads_every_micro_batch else grads) + (
                    d.gathers_per_step * sum(AG(b) for b in gat) if d.gathers_per_step else 0.0)
            else:  # ZeRO-3: every module above the persistence threshold, each micro-batch
                block_sizes, rest_sizes = module_sizes(plan)
                blocks_here = max(n for n, _, _ in _stage_layers(plan, shape.layers))
                gathered = [s / t for s in block_sizes if s > ZERO3_PERSISTENCE] * blocks_here
                gathered += [s / t for s in rest_sizes if s > ZERO3_PERSISTENCE]
                # its default reuse distance keeps them for backward: one pass (the volume counts two)
                passes = 1 if shape.total < ZERO3_MAX_REUSE else 2
                per_mb = passes * sum(AG(pb * s) for s in gathered) + sum(RS(b) for b in red)
                dp_comm = m * per_mb
            if gpu and z is not None and z.overlap_comm:
                dp_comm = max(0.0, dp_comm - m * backward_last)

    # ---- optimizer and offload
    from paratune.costs.profile import optimizer_params

    optimizer = profile.optimizer.seconds(optimizer_params(plan))
    host = profile.host_link_bytes_per_s or 25e9
    offload = offload_bytes(plan, shape) / host
    terms = {"compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm, "dp_comm": dp_comm,
             "optimizer": optimizer, "offload": offload, "ep_comm": ep_comm,
             "overhead:step": 1.0, "overhead:micro_batch": float(m)}
    for fam in FAMILIES:
        terms[f"overhead:{fam}"] = float(m) if fam in families(plan) else 0.0
    return terms


FEATURES = MULTIPLIERS + ("overhead:step", "overhead:micro_batch") + tuple(f"overhead:{f}" for f in FAMILIES)


def _row(terms: dict[str, float]) -> list[float]:
    """Feature vector in seconds at coefficient 1 (overheads in OVERHEAD_UNIT_S units)."""
    return [terms[k] if k in MULTIPLIERS else terms[k] * OVERHEAD_UNIT_S for k in FEATURES]


PRIOR = [1.0 if k in MULTIPLIERS else 0.0 for k in FEATURES]


def prior_weights(multiplier: float = MULTIPLIER_WEIGHT, shared: float = SHARED_OVERHEAD_WEIGHT,
                  family: float = OVERHEAD_WEIGHT) -> list[float]:
    return [multiplier if k in MULTIPLIERS else shared if k in ("overhead:step", "overhead:micro_batch") else family
            for k in FEATURES]


def fit_coefficients(rows: list[list[float]], measured: list[float], prior: list[float] | None = None,
                     weights: list[float] | None = None, huber: float = HUBER) -> list[float]:
    """Non-negative least squares of relative error (sum ((x·c)/y - 1)^2), plus
    weight x (c - prior)^2 per coefficient: with no trials the prior, with many the data.

    Robust (Huber, by iteratively reweighted least squares): a trial more than `huber` off is
    down-weighted by huber/|error|, so one straggling or disturbed measurement (a busy host, a
    slow node) pulls the coefficients linearly, not quadratically."""
    import numpy as np
    from scipy.optimize import nnls

    prior_arr = np.array(prior or PRIOR, dtype=float)
    if not rows:
        return [float(x) for x in prior_arr]
    X = np.array(rows, dtype=float) / np.array(measured, dtype=float)[:, None]
    reg_w = np.sqrt(np.array(weights or prior_weights()))
    reg = np.diag(reg_w)
    sample_w = np.ones(len(rows))
    sol = prior_arr
    for _ in range(6):
        sw = np.sqrt(sample_w)[:, None]
        A = np.vstack([X * sw, reg])
        b = np.concatenate([sw[:, 0], reg_w * prior_arr])
        sol, _ = nnls(A, b, maxiter=50 * A.shape[1])
        residual = np.abs(X @ sol - 1.0)
        new_w = np.minimum(1.0, huber / np.maximum(residual, 1e-12))
        if np.allclose(new_w, sample_w, atol=1e-3):
            break
        sample_w = new_w
    return [float(x) for x in sol]


def _env_key(env: dict[str, str]) -> str:
    return json.dumps(dict(sorted(env.items())), sort_keys=True)


class StepTimeModel:
    """Step time of plans from profiles (one per env), refitted on every measured trial: the
    calibrated paratune.costs.predict.TimePredictor.

    `error_band()`: before 3 trials, PRIOR_BAND (10%) or the largest pre-refit error seen so far,
    whichever is larger; from 3 trials, the 80th percentile of the leave-one-out relative errors
    (each observed trial predicted by a refit on the others), never below 2%."""

    def __init__(self, profiles: list[Profile]):
        if not profiles:
            raise ValueError("profiles: got none; allowed: at least one Profile (paratune profile SPACE)")
        self.profiles = list(profiles)
        # With several envs, each gets a compute multiplier of its own on top of the shared one:
        # a profile taken under one env can be biased unlike another's (CPU: threads per worker
        # oversubscribing the cores in the profile but less so in a trial), and one shared
        # multiplier would split the difference, wrong for both.
        self.env_keys = sorted({_env_key(p.env) for p in self.profiles}) if len(
            {_env_key(p.env) for p in self.profiles}) > 1 else []
        self.features = list(FEATURES) + [f"compute@{k}" for k in self.env_keys]
        self.prior = list(PRIOR) + [0.0] * len(self.env_keys)
        self.weights = prior_weights() + [MULTIPLIER_WEIGHT] * len(self.env_keys)
        self.coef = list(self.prior)
        # MoE routing's max / mean tokens per expert (expert-parallel plans, `compose`): the
        # assumption until the sweep sets a trial's measured `routing_balance` here.
        self.imbalance = DEFAULT_IMBALANCE
        self.samples: list[tuple[Plan, float, list[float]]] = []  # plan, measured s, feature row
        self.errors: list[float] = []  # pre-refit relative errors, in order

    # ---- which profile
    def profile_for(self, plan: Plan) -> tuple[Profile, str | None]:
        """The profile measured with the plan's env (and world size, precision, model); else the
        nearest one (fewest differing settings), with a note saying so."""
        from paratune.costs.profile import config_digest

        want_env = _env_key(plan.env)

        def distance(prof: Profile) -> tuple:
            env_diff = sum(1 for k in set(plan.env) | set(prof.env) if plan.env.get(k) != prof.env.get(k))
            return (prof.config_digest != plan_digest, prof.world_size != plan.num_workers,
                    prof.precision != plan.precision, env_diff, prof.cpus_per_worker != plan.cpus_per_worker)

        plan_digest = config_digest(plan.model, plan.model_overrides)
        best = min(self.profiles, key=distance)
        if distance(best) == (False, False, False, 0, False):
            return best, None
        what = []
        if best.config_digest != plan_digest:
            what.append(f"model {best.model}")
        if best.world_size != plan.num_workers:
            what.append(f"world size {best.world_size}")
        if best.precision != plan.precision:
            what.append(f"precision {best.precision}")
        if _env_key(best.env) != want_env or best.cpus_per_worker != plan.cpus_per_worker:
            what.append(f"env {best.env}")
        return best, f"no profile for this plan's env {plan.env}: used the nearest ({', '.join(what)})"

    def _features(self, plan: Plan) -> tuple[list[float], dict[str, float], Profile, str | None]:
        profile, note = self.profile_for(plan)
        terms = compose(plan, profile, self.imbalance)
        env = _env_key(profile.env)
        row = _row(terms) + [terms["compute"] if k == env else 0.0 for k in self.env_keys]
        return row, terms, profile, note

    # ---- the public API
    def predict(self, plan: Plan) -> StepPrediction:
        row, _, profile, note = self._features(plan)
        note = "; ".join(([note] if note else []) + lever_notes(plan, profile)) or None
        parts = {k: c * x for k, c, x in zip(self.features, self.coef, row) if c * x != 0.0}
        step = max(1e-9, sum(parts.values()))
        return StepPrediction(step_s=step, tokens_per_s_per_gpu=plan.tokens_per_step / step / plan.num_workers,
                              parts=parts, profile_env=dict(profile.env), note=note)

    def compile_seconds(self, plan: Plan) -> float | None:
        """The plan's first-step compile time from its profile (paratune.costs.timemodel.compile_seconds)."""
        return compile_seconds(plan, self.profile_for(plan)[0])

    def observe(self, plan: Plan, measured_step_s: float, routing_balance: float | None = None) -> dict[str, float]:
        """The prediction made before this trial (and its relative error), then refit on it; a
        measured routing balance becomes the imbalance of later predictions (the largest seen)."""
        if not measured_step_s or measured_step_s <= 0 or not math.isfinite(measured_step_s):
            raise ValueError(f"measured_step_s: got {measured_step_s!r}; allowed: a positive number of seconds")
        before = self.predict(plan)
        if routing_balance is not None and routing_balance >= 1.0:
            self.imbalance = max(self.imbalance, float(routing_balance))
        error = before.step_s / measured_step_s - 1
        row, _, _, _ = self._features(plan)
        self.samples.append((plan, float(measured_step_s), row))
        self.errors.append(error)
        self.coef = fit_coefficients([r for _, _, r in self.samples], [y for _, y, _ in self.samples],
                                     self.prior, self.weights)
        return {"predicted_step_time_s": before.step_s, "step_time_prediction_error": error,
                "predicted_tokens_per_s_per_gpu": before.tokens_per_s_per_gpu,
                "time_model_fitted_on": float(len(self.samples) - 1)}

    def loo_errors(self, limit: int = 200) -> list[float]:
        """Leave-one-out relative errors over the last `limit` observed trials."""
        samples = self.samples[-limit:]
        out = []
        for i, (_, measured, row) in enumerate(samples):
            others = samples[:i] + samples[i + 1:]
            coef = fit_coefficients([r for _, _, r in others], [y for _, y, _ in others], self.prior, self.weights)
            out.append(sum(c * x for c, x in zip(coef, row)) / measured - 1)
        return out

    def error_band(self) -> float:
        if len(self.samples) < 3:
            return max([PRIOR_BAND] + [abs(e) for e in self.errors])
        errors = sorted(abs(e) for e in self.loo_errors())
        k = min(len(errors) - 1, math.ceil(0.8 * len(errors)) - 1)
        return max(MIN_BAND, errors[k])

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {"time_model_trials": float(len(self.samples)),
                                 "time_model_error_band": self.error_band()}
        if self.errors:
            out["step_time_prediction_error_median_abs"] = statistics.median(abs(e) for e in self.errors)
        for k, c in zip(self.features, self.coef):
            out[f"time_model_coef:{k}"] = c
        return out
