"""What a plan lays on each rank: the model's parameter counts by place, and the shares a rank holds.

ModelShape (exact counts from the real architecture on the meta device) and the plan's view of
it, shared by the memory model (paratune.costs.memory), the roofline (paratune.costs.estimate), the
activation trace (paratune.costs.activations) and the profile-composed time model (paratune.costs.timemodel):
`replicas` (ranks that share gradients), `local_params` (a rank's model-parallel slice),
`fsdp_shard_degree`, `fully_sharded`, `compute_precision`, `offload_bytes`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache

from paratune.config.sizes import config_sizes
from paratune.config.plan import Plan

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by place (exact, from the real architecture) and the sizes the model uses."""

    total: int
    embedding: int
    head: int  # untied LM head (0 when tied)
    layer: int  # one decoder block
    rest: int  # final norm and anything else outside the blocks
    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    compute: int  # N in 6N
    largest_leaf: int = 0  # parameters of the largest module that owns them directly (its own, not its children's)
    kv_heads: int = 0  # key/value heads (GQA); 0 = heads
    largest_layer: int = 0  # the largest decoder block (blocks differ: DeepSeek-V3's dense first ones); 0 = layer
    # ZeRO-3's persistent parameters (`_tensor_layout`): in tensors small enough to stay gathered
    persistent: int = 0
    # ... and the others (partitioned, gathered when used) by place: the embedding's, the untied
    # head's, the largest block's
    gathered_embedding: int = 0  # untied; a tied one is the head's
    gathered_head: int = 0
    gathered_layer: int = 0
    gathered_blocks: int = 0  # all the blocks'
    first_layer: int = 0  # the first block (the last in backward); 0 = layer
    gathered_first: int = 0  # ... its fetched tensors

    @property
    def first(self) -> int:
        return self.first_layer or self.layer

    @property
    def block(self) -> int:
        """One block where one is held whole at a time (gathered, its gradients, its
        reduce-scatter input): the largest, so the peak is the largest block's. `layer` (the mean)
        is for what all the blocks hold together."""
        return self.largest_layer or self.layer


# DeepSpeed's stage3_param_persistence_threshold default (deepspeed/runtime/zero/config.py, 1e5
# elements; paratune's DeepSpeed config leaves it, and stage3_model_persistence_threshold, alone).
ZERO3_PERSISTENCE_THRESHOLD = 100_000


@lru_cache(maxsize=64)
def _tensor_layout(key: str) -> dict[str, int]:
    """Counted on the whole model built on the meta device (no memory; blocks may differ, so no
    one-block copy): `largest_leaf`, the parameters of the largest module that holds parameters
    itself (nn.Linear, nn.Embedding, a norm, packed experts): what DeepSpeed's zero.Init builds
    whole before partitioning it; and ZeRO-3's persistent parameters: each tensor of at most
    ZERO3_PERSISTENCE_THRESHOLD elements is marked `ds_persist` (partition_parameters.py
    `_convert_to_deepspeed_param`, parameter_offload.py `mark_persistent_parameters`): gathered
    after every step (stage3.py `_post_step`) and never released in forward or backward
    (partitioned_param_coordinator.py `__params_to_release`), so never fetched either; the others
    (`gathered_*`: of the embedding, the untied head, the largest block) are."""
    import torch
    from transformers import AutoModelForCausalLM

    from paratune.model.build import config_from_key, decoder_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_key(key))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())

    def fetched(params) -> int:  # noqa: ANN001
        return sum(p.numel() for p in params if p.numel() > ZERO3_PERSISTENCE_THRESHOLD)

    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    small = sum(p.numel() for p in model.parameters() if p.numel() <= ZERO3_PERSISTENCE_THRESHOLD)
    stack = decoder_blocks(model)
    blocks = [fetched(block.parameters()) for block in stack]
    return {"largest_leaf": largest, "persistent": small,
            "gathered_embedding": 0 if tied else fetched([embedding.weight]),
            "gathered_head": 0 if head is None else fetched([head.weight]),
            "gathered_layer": max(blocks), "gathered_blocks": sum(blocks), "gathered_first": blocks[0],
            "first_layer": sum(p.numel() for p in stack[0].parameters())}


@lru_cache(maxsize=64)
def _shape_from_key(key: str) -> ModelShape:
    from paratune.model.build import config_from_key, parameter_counts, parameter_layout

    config = config_from_key(key)
    layout, sizes = parameter_layout(config), config_sizes(config)
    tensors = _tensor_layout(key)
    return ModelShape(
        total=layout["total"], embedding=layout["embedding"], head=layout["head"], layer=layout["layer"],
        rest=layout["total"] - layout["embedding"] - layout["head"] - layout["layer"] * layout["layers"],
        layers=layout["layers"], hidden=sizes.hidden, vocab=sizes.vocab, heads=sizes.heads,
        head_dim=sizes.head_dim,
        compute=parameter_counts(config)["compute"], largest_leaf=tensors["largest_leaf"],
        kv_heads=sizes.kv_heads,
        largest_layer=layout.get("largest_layer", layout["layer"]), persistent=tensors["persistent"],
        gathered_embedding=tensors["gathered_embedding"], gathered_head=tensors["gathered_head"],
        gathered_layer=tensors["gathered_layer"], gathered_blocks=tensors["gathered_blocks"],
        first_layer=tensors["first_layer"], gathered_first=tensors["gathered_first"])


@lru_cache(maxsize=256)
def _config_key_of(model: str, overrides_json: str, file_stamp: float | None) -> str:
    from paratune.model.build import build_config, config_key

    return config_key(build_config(model, json.loads(overrides_json)))


def model_config_key(plan: Plan) -> str:
    """config_key of the plan's model, remembered per model, overrides and (a model given as a
    file) the file's modification time: building a transformers config costs ~3 ms, and a space's
    estimate asked for it ~8 times a plan (a 1,000-plan space: 25 s of it)."""
    stamp = os.path.getmtime(plan.model) if os.path.isfile(plan.model) else None
    return _config_key_of(plan.model, json.dumps(plan.model_overrides, sort_keys=True, default=str), stamp)


def model_shape(plan: Plan) -> ModelShape:
    return _shape_from_key(model_config_key(plan))


# --------------------------------------------------------------------------- what one rank holds
def replicas(plan: Plan) -> int:
    """Ranks that hold the same model-parallel slice and share its gradients: dp, and cp with it
    (context-parallel ranks see parts of the same sequences, so they are data-parallel for the
    weights: FSDP2 shards over dp x cp, DDP all-reduces over it)."""
    return plan.dp_degree * plan.cp


def stage_blocks(plan: Plan, shape: ModelShape) -> float:
    """Parameters of the decoder blocks one rank's stage holds (before TP): all of them without
    pipeline stages (layers x the mean block: exact where blocks differ); with stages, the
    heaviest stage's, as many of the largest block as a stage holds (DeepSeek-V3's dense first
    blocks sit on the first stage, the others hold only MoE blocks)."""
    if plan.pp == 1:
        return shape.layers * shape.layer
    return math.ceil(shape.layers / plan.pp) * shape.block


def local_params(plan: Plan, shape: ModelShape) -> tuple[float, float]:
    """(parameters this rank's model-parallel slice holds, of which in one decoder block: the
    mean block, so that the blocks hold layers x that).

    TP shards every block and the (vocab-parallel) embedding and head; norms are small and
    counted as sharded. PP gives a stage its layers; the heavier end stage (embedding on the
    first, norm and head on the last) sets the peak.

    ZeRO's tp is DeepSpeed's AutoTP: it splits the blocks' linear layers and the LM head, but
    keeps an untied input embedding whole on every rank (tied, both are vocab-split)."""
    t, p = plan.tp, plan.pp
    blocks = stage_blocks(plan, shape)
    if plan.strategy == "zero" and t > 1:
        whole = shape.embedding + shape.rest if shape.head else 0.0
        return (blocks + shape.head + (0 if shape.head else shape.embedding)) / t + whole, shape.layer / t
    if p > 1:
        ends = max(shape.embedding, shape.head + shape.rest if shape.head else shape.embedding + shape.rest)
    else:
        ends = shape.embedding + shape.head + shape.rest
    return (blocks + ends) / t, shape.layer / t


@dataclass(frozen=True)
class HeldParams:
    """Parameter counts of what one rank's model-parallel slice holds, by place."""

    local: float  # every parameter of the slice
    layer: float  # one decoder block held whole (gathered, its gradients): the largest block
    first: float  # the first block, the last one in backward
    root: float  # outside the blocks: embedding, untied head, final norm
    head: float  # an untied LM head (0 when tied)
    embedding: float
    largest: float  # the largest single parameter tensor

    @classmethod
    def of(cls, plan: Plan, shape: ModelShape) -> "HeldParams":
        local, _ = local_params(plan, shape)
        t = plan.tp
        root = max(0.0, local - stage_blocks(plan, shape) / t)
        return cls(local=local, layer=shape.block / t, first=shape.first / t, root=root, head=min(shape.head / t, root),
                   embedding=min(shape.embedding / t, root), largest=(shape.largest_leaf or shape.block) / t)


def pipeline_in_flight(plan: Plan) -> float:
    """Micro-batches whose activations the first pipeline rank holds at once (of all its
    blocks): GPipe all; 1F1B pp; interleaved 1F1B (v = 2 stages a rank) its warm-up's chunk
    forwards and the one running, (v - 1) x micro-batches a round + 2 (pp - 1) + 1 (torch's
    pipelining/schedules.py `_get_warmup_ops`, rank 0), capped by the micro-batches, over v."""
    m, pp = plan.grad_accum, plan.pp
    if pp == 1:
        return 1.0
    if plan.pp_schedule == "gpipe":
        return float(m)
    if plan.pp_schedule == "interleaved_1f1b":
        v, per_round = 2, m // max(1, m // pp)
        return min((v - 1) * per_round + 2 * (pp - 1) + 1, m * v) / v
    return float(min(m, pp))


def fsdp_shard_degree(plan: Plan) -> int:
    """Ranks that share one parameter's shards under FSDP (1 for no_shard)."""
    f = plan.fsdp
    assert f is not None
    dp = replicas(plan)
    node_dp = plan.gpus_per_node // plan.tp if plan.gpus_per_node else dp  # the dp ranks of one node
    shard = {"full": dp, "grad_op": dp, "hybrid": f.shard_group_size or node_dp, "no_shard": 1}[f.sharding]
    return max(1, min(shard, dp))


def fully_sharded(plan: Plan) -> bool:
    """Whether the plan runs FSDP2's `fully_shard` (on the whole mesh when it is one rank): the
    fsdp strategy without model parallelism (paratune.parallel.fsdp), or with it and more than one
    replica (paratune.parallel.nd shards over dp x cp; with a single replica it applies no FSDP)."""
    if plan.strategy != "fsdp" or plan.fsdp is None or plan.fsdp.sharding == "no_shard":
        return False
    return (plan.tp == plan.pp == plan.cp == 1) or replicas(plan) > 1


def compute_precision(plan: Plan) -> str:
    """How the plan's bf16 compute is made (paratune.parallel): "bf16-params" where the
    parameters the forward uses are bf16 themselves (FSDP2's MixedPrecisionPolicy: the fsdp
    strategy, except a model-parallel plan with one replica, which runs without FSDP2; DeepSpeed's
    bf16 engine, which casts the model), else "bf16", autocast over fp32 parameters (DDP, and the
    single-replica model-parallel plans); "fp32" in fp32."""
    if plan.precision != "bf16":
        return plan.precision
    if plan.strategy == "zero":
        return "bf16-params"
    if plan.strategy == "fsdp" and ((plan.tp == plan.pp == plan.cp == 1) or replicas(plan) > 1):
        return "bf16-params"
    return "bf16"


def offload_bytes(plan: Plan, shape: ModelShape) -> float:
    """Bytes a rank moves between host and device per step because of CPU offload."""
    local, _ = local_params(plan, shape)
    dp, ga, pb = replicas(plan), plan.grad_accum, BYTES[plan.precision]
    moved = 0.0
    if plan.strategy == "zero" and plan.zero is not None:
        if plan.zero.offload_optimizer:  # fp32 gradient partition down, updated parameters up
            moved += (4 + pb) * local / dp
        if plan.zero.offload_param and plan.zero.stage == 3:  # parameters up for forward and backward
            moved += 2 * ga * pb * local / dp
    elif plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.cpu_offload:
        moved += 2 * ga * 4 * local / dp + 4 * local / dp  # shards up per pass, gradients down
    return moved


def mlp_width(shape: ModelShape) -> float:
    """A block's MLP width (intermediate size) from its parameters: what is not attention
    (q and o: h x h each, k and v: h x kv dims each) nor its two norms, over the three matrices
    of a gated MLP. Exact for Llama-like blocks; for others, the width of an equivalent one."""
    h = shape.hidden
    kv = (shape.kv_heads or shape.heads) * shape.head_dim
    return max(0.0, (shape.layer - 2 * h * h - 2 * h * kv - 2 * h) / (3 * h))


def float8_cast_bytes(plan: Plan, shape: ModelShape) -> float:
    """Bytes of torchao's float8 casts alive at once (float8 plans; else 0). torchao 0.18 saves the
    high-precision input and weight for backward (torchao/float8/float8_linear.py:45
    `ctx.save_for_backward(input_hp, weight_hp_t)`) and casts again in backward, so no float8
    copy outlives its matmul: what exists is one linear's casts at a time, 1 byte an element (the
    scales are one number per tensor or row). The largest: a backward of the MLP's widest linear,
    its grad_output and input casts (tokens x its width, twice) and the weight's (twice: for the
    input's gradient and, transposed, rowwise's second layout). Under the float8 all-gather the
    gathered weight is float8 already (counted with FSDP2's gathered blocks)."""
    if plan.float8 == "none":
        return 0.0
    h = shape.hidden
    width = max(h, mlp_width(shape)) / plan.tp
    tokens = plan.micro_batch * plan.seq_len // plan.cp  # sequence parallelism gathers before the matmul
    return 2.0 * tokens * width + (0.0 if plan.float8_all_gather else 2.0 * h * width)
