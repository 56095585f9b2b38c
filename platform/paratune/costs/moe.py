"""What expert parallelism changes in a plan's costs: the routed experts' share of each rank, the
all-to-all, and the routing's imbalance.

Layout (paratune.parallel.ep, torchtitan's): the dp ranks are expert_dp x ep, ep innermost; each
routed-experts module keeps E / ep experts on a rank, copied on expert_dp = dp / ep ranks (ep
apart: strided); the dense part (attention, norms, router, shared experts, embedding, head) is laid
out over all dp ranks as without ep. So per rank:

- the experts' parameters are (expert params of the rank's stage) / ep before data-parallel
  sharding; FSDP2 (full / grad_op) shards them further over expert_dp, DDP keeps them whole
  (`ExpertShare`, `shard_params`). Under fsdp full the expert *shard* is the same with or
  without ep (p_e / ep / expert_dp = p_e / dp): what ep saves there is the gathered block (E / ep
  experts unsharded at a time) and the gathering; under ddp it divides the experts' states by ep;
- each MoE layer's tokens go out and back by all-to-all: dispatch and combine, in forward and in
  backward, tokens x top_k rows of `hidden` elements each time, (ep - 1) / ep of them to other
  ranks (`all_to_all_bytes`): inside a node while the ep group (ep consecutive ranks at tp 1)
  fits in gpus_per_node, else across nodes (`all_to_all_crosses_nodes`); exposed (the expert
  computation waits on its tokens, and the next layer on their results);
- a rank's experts receive tokens x top_k rows on average; routing is never perfectly balanced,
  so the busiest rank's experts receive `imbalance` (max / mean tokens per expert) times that:
  its expert computation, the rows it receives (all-to-all) and their saved activations scale by
  it (`expert_activation_bytes`).

Imbalance: DEFAULT_IMBALANCE (1.0, ideal balance) until a measured trial says better: the
TrialResult's `routing_balance` (max / mean tokens per expert, per layer, and its max: recorded by
the trial from the routers' choices) is what `estimate(..., routing_balance=...)` and
`paratune plan --routing-balance` take; the sweep passes the measured one of its trials.

Counts are exact, from the real architecture built on the meta device (paratune.model.build
routed_experts / routed_top_k). No torch import at module level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from paratune.config.plan import Plan

# Max / mean tokens per expert assumed where no trial has measured it: 1.0 is ideal balance,
# which dropless routing with a load-balancing loss (Mixtral, Qwen3-MoE) or DeepSeek-V3's bias
# balancing approaches over a step but not within one micro-batch. Stated, not fitted: it
# understates the busiest rank until a trial's `routing_balance` replaces it.
DEFAULT_IMBALANCE = 1.0


@dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of a model, exact (meta device)."""

    total: int  # parameters of every routed-experts module
    per_layer: tuple[int, ...]  # each decoder block's routed-expert parameters (0: a dense block)
    experts: int  # routed experts per MoE layer
    top_k: int
    per_expert: int  # parameters of one expert (of one layer)
    largest_dense_leaf: int  # the largest module's own parameters outside the experts

    @property
    def moe_layers(self) -> int:
        return sum(1 for n in self.per_layer if n)

    @property
    def largest_layer(self) -> int:
        return max(self.per_layer, default=0)

    @property
    def first_layer(self) -> int:
        return self.per_layer[0] if self.per_layer else 0

    def width(self, hidden: int) -> float:
        """An expert's intermediate width: its three (gated) matrices of hidden x width."""
        return self.per_expert / (3 * hidden) if hidden else 0.0


@lru_cache(maxsize=64)
def _expert_layout(key: str) -> ExpertLayout:
    import torch
    from transformers import AutoModelForCausalLM

    from paratune.model.build import config_from_key, decoder_blocks, routed_experts, routed_top_k

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_key(key))
    found = routed_experts(model)
    blocks = decoder_blocks(model)
    inside = {id(m) for _, module, _ in found for m in module.modules()}
    per_block = []
    for block in blocks:
        ids = {id(m) for m in block.modules()}
        per_block.append(sum(sum(p.numel() for p in module.parameters()) for _, module, _ in found if id(module) in ids))
    dense_leaf = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules() if id(m) not in inside),
                     default=0)
    if not found:
        return ExpertLayout(0, tuple(per_block), 0, 0, 0, dense_leaf)
    path, module, count = found[0]
    return ExpertLayout(total=sum(sum(p.numel() for p in m.parameters()) for _, m, _ in found),
                        per_layer=tuple(per_block), experts=count, top_k=routed_top_k(model, path, module),
                        per_expert=sum(p.numel() for p in module.parameters()) // count,
                        largest_dense_leaf=dense_leaf)


def expert_layout(plan: Plan) -> ExpertLayout:
    """The plan's model's routed experts (remembered per model config)."""
    from paratune.model.shapes import model_config_key

    return _expert_layout(model_config_key(plan))


@dataclass(frozen=True)
class ExpertShare:
    """Routed-expert parameters of what one rank's model-parallel slice holds before data-parallel
    sharding (E / ep of each layer's experts), by place; `expert_dp`: the ranks FSDP2 shards them
    over (the dense rest: over dp)."""

    local: float  # in the rank's stage
    layer: float  # in its largest block
    first: float  # in its first block (the last one in backward)
    ep: int
    expert_dp: int

    @property
    def saved(self) -> float:
        """Expert parameters the rank does not hold because of ep: (ep - 1) x local."""
        return self.local * (self.ep - 1)


def expert_share(plan: Plan, layout: ExpertLayout | None = None) -> ExpertShare:
    """A rank's routed-expert parameters (ExpertShare). A pipeline stage holds ceil(L / pp) blocks
    and the heaviest stage's are the MoE ones (paratune.model.shapes.stage_blocks' rule)."""
    layout = layout or expert_layout(plan)
    ep = max(1, plan.ep)
    if plan.pp == 1:
        stage = float(layout.total)
    else:
        stage = min(math.ceil(len(layout.per_layer) / plan.pp), layout.moe_layers) * float(layout.largest_layer)
    # The ranks holding the same experts: expert_dp, x tp (with tp the routed experts are ep's, whole
    # on every tp rank; FSDP2 shards them over the flattened expert_dp x tp mesh: paratune.parallel.ep).
    return ExpertShare(local=stage / ep, layer=layout.largest_layer / ep, first=layout.first_layer / ep, ep=ep,
                       expert_dp=max(1, plan.dp_degree // ep) * plan.tp)


def shard_params(params: float, experts: float, shard: int, share: ExpertShare | None) -> float:
    """Parameters per rank of `params` (of which `experts` are routed-expert ones, already / ep)
    sharded by FSDP2: the dense ones over `shard` ranks, the experts over expert_dp (with ep 1,
    everything over `shard`: the experts are then sharded like the rest)."""
    if share is None or share.ep == 1:
        return params / shard
    return (params - experts) / shard + experts / share.expert_dp


# --------------------------------------------------------------------------- communication
def all_to_all_bytes(tokens: float, top_k: int, hidden: int, nbytes: int, ep: int, moe_layers: int,
                     imbalance: float = DEFAULT_IMBALANCE) -> float:
    """Bytes one rank sends (= receives) by all-to-all per micro-batch: per MoE layer dispatch +
    combine, forward + backward (4 exchanges) of tokens x top_k rows of `hidden` elements, the
    (ep - 1) / ep of them bound for other ranks; the busiest rank's received rows x `imbalance`."""
    if ep <= 1 or moe_layers <= 0:
        return 0.0
    return 4.0 * tokens * top_k * hidden * nbytes * (ep - 1) / ep * moe_layers * imbalance


def all_to_all_crosses_nodes(plan: Plan, gpus_per_node: int) -> bool:
    """Whether an ep group spans nodes: ep consecutive ranks (tp 1: the dp ranks are consecutive)
    fit in a node when ep <= gpus_per_node and a node holds whole groups."""
    ep = plan.ep
    span = ep * plan.tp
    return span > gpus_per_node or gpus_per_node % span != 0


def expert_dp_crosses_nodes(plan: Plan, gpus_per_node: int) -> bool:
    """Whether an expert_dp group (ranks ep apart) spans nodes: ep x expert_dp = dp ranks."""
    return plan.expert_dp_degree > 1 and plan.dp_degree * plan.tp > gpus_per_node


# --------------------------------------------------------------------------- compute and memory
def expert_flops_share(plan: Plan, layout: ExpertLayout | None = None) -> float:
    """The share of a step's model FLOPs in the routed experts (6 FLOPs a parameter a token, top_k
    of each layer's experts), against paratune.costs.measure.flops_per_token: what `imbalance` scales."""
    from paratune.costs.measure import flops_per_token
    from paratune.model.shapes import model_shape

    layout = layout or expert_layout(plan)
    if not layout.total:
        return 0.0
    shape = model_shape(plan)
    routed = 6.0 * layout.moe_layers * layout.top_k * layout.per_expert
    return routed / flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)


def expert_activation_bytes(plan: Plan, imbalance: float = DEFAULT_IMBALANCE,
                            layout: ExpertLayout | None = None) -> tuple[float, float]:
    """(saved, in flight) bytes per rank the ep dispatch adds to what the trace (ep 1: every
    expert local, each token's top_k rows on its own rank) already counts.

    saved: the rows beyond the mean that the busiest rank's experts receive, (imbalance - 1) x
    tokens x top_k, each its received input (hidden), the gate/up output (2 x width) and the
    activation (width) kept for backward, in every MoE block whose activations are kept (full
    recompute: only the block being recomputed). in flight: one layer's all-to-all buffers, the
    sorted send copy and the received rows (x imbalance), tokens x top_k x hidden each."""
    from paratune.model.shapes import BYTES, model_shape

    layout = layout or expert_layout(plan)
    if plan.ep <= 1 or not layout.total:
        return 0.0, 0.0
    shape = model_shape(plan)
    act = BYTES["bf16"] if plan.precision == "bf16" else 4
    tokens = plan.micro_batch * plan.seq_len // plan.cp
    rows = tokens * layout.top_k
    width = layout.width(shape.hidden)
    per_row = (shape.hidden + 3 * width) * act
    layers_here = min(math.ceil(shape.layers / plan.pp), layout.moe_layers)
    kept = 1 if plan.activation_checkpointing == "full" else layers_here
    saved = max(0.0, imbalance - 1.0) * rows * per_row * kept
    in_flight = rows * shape.hidden * act * (1 + imbalance)
    return saved, in_flight


def held_with_experts(plan: Plan, shape=None):  # noqa: ANN001, ANN201 - (HeldParams, ExpertShare | None)
    """paratune.model.shapes.HeldParams of the plan with its routed experts cut to E / ep (what a rank
    holds before data-parallel sharding), and the ExpertShare that says how many of them are
    experts (None without ep, or for a model without routed experts: HeldParams.of as it is)."""
    from dataclasses import replace

    from paratune.model.shapes import HeldParams, model_shape

    shape = shape or model_shape(plan)
    held = HeldParams.of(plan, shape)
    if plan.ep <= 1:
        return held, None
    layout = expert_layout(plan)
    if not layout.total:
        return held, None
    share = expert_share(plan, layout)
    # HeldParams counts the experts over tp like the rest (E / tp of them); a rank holds E / ep,
    # whole (with tp they are ep's, not tp's): (ep / tp - 1) x its share less than HeldParams says
    # (tp 1: (ep - 1) / ep of them are elsewhere).
    cut = share.ep / plan.tp - 1
    largest = max(float(layout.largest_dense_leaf), (shape.largest_leaf or shape.block) / share.ep)
    return replace(held, local=held.local - share.local * cut, layer=held.layer - share.layer * cut,
                   first=held.first - share.first * cut, largest=largest), share


# Moments at which the blocks' saved activations are alive (the backward has not passed them yet),
# and those at which an MoE layer's all-to-all buffers are in flight (a block's forward or backward).
_BLOCKS_SAVED = ("gather", "block_forward", "forward", "logits", "loss", "head", "first_grad", "after_head", "blocks",
                 "next_block", "block_end", "block_reduced", "block_reduce")
_DISPATCHING = ("gather", "block_forward", "forward", "blocks", "next_block", "last_block")


def add_dispatch(plan: Plan, moments: dict, imbalance: float) -> None:
    """Expert parallelism's activations beyond the trace of a rank's blocks, added to the moments
    of paratune.costs.memory (phase -> its _Moment): the busiest rank's extra received rows while the
    blocks' saved activations live, one layer's all-to-all buffers while a block runs
    (`expert_activation_bytes`)."""
    saved, in_flight = expert_activation_bytes(plan, imbalance)
    for phase, m in moments.items():
        m.activations += (saved if phase in _BLOCKS_SAVED else 0.0) + (in_flight if phase in _DISPATCHING else 0.0)


def rank_trace_config(config_json: str, ep: int) -> str:
    """The config a rank's blocks are traced with in a mixture-of-experts model: every traced block
    an MoE block (DeepSeek-V3's first_k_dense_replace dense blocks are 3 of 61: the 1- and 2-layer
    copies would otherwise trace only dense blocks, and the MoE block's backward sets the peak),
    and under ep the experts a rank holds, E / ep (at least top_k, so that each token still has
    top_k rows: the rows a rank's experts receive on average, as under ep), with one routing
    group (grouped routing only picks among them; it changes no tensor's size). What the trace
    then holds is a rank's: its tokens' top_k rows through its own experts' weights, their
    gradients (and autocast copies) for E / ep experts, not E (with E / ep < top_k: top_k
    experts' weights, a slight overcount)."""
    import json

    from paratune.config.degrees import EXPERT_COUNT_KEYS

    data = json.loads(config_json)
    count_key = next((k for k in EXPERT_COUNT_KEYS if isinstance(data.get(k), int) and data[k] >= 2), None)
    if count_key is None:
        return config_json
    changes: dict = {}
    if data.get("first_k_dense_replace"):
        changes["first_k_dense_replace"] = 0
    if ep > 1:
        top_k = data.get("num_experts_per_tok") or 1
        changes[count_key] = max(data[count_key] // ep, top_k)
        if data.get("n_group", 1) > 1:
            changes.update(n_group=1, topk_group=1)
    return json.dumps({**data, **changes}, sort_keys=True) if changes else config_json
