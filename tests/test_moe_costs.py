"""The cost model under expert parallelism (paratune.costs.moe with paratune.costs.memory / .estimate):
the experts' per-rank share, the all-to-all, the routing imbalance, and the MoE spaces' plans.

Pure functions on the meta device (no processes): tiny-mixtral for hand-computed numbers (hidden
64, MoE width 96, 2 layers of 8 experts, top-2, 4 heads / 2 KV heads, vocab 512, untied), the
shipped MoE spaces with the formula's activations (no trace) for the ranking.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paratune.config.devices import get_device
from paratune.costs.estimate import _time_terms, comm_volume, compute_seconds, estimate, estimate_space
from paratune.costs.construction import construction_bytes
from paratune.costs.memory import memory_moments
from paratune.costs.moe import (
    all_to_all_bytes,
    all_to_all_crosses_nodes,
    expert_dp_crosses_nodes,
    expert_flops_share,
    expert_layout,
    held_with_experts,
    shard_params,
)
from paratune.config.plan import Plan
from paratune.model.shapes import model_shape

ROOT = Path(__file__).resolve().parents[1]

# tiny-mixtral by hand: each layer's experts are gate_up [8, 2 x 96, 64] + down [8, 64, 96].
H, WIDTH, EXPERTS, LAYERS, TOP_K = 64, 96, 8, 2, 2
EXPERT_PARAMS = LAYERS * EXPERTS * 3 * H * WIDTH  # 294,912
# embedding + head (512 x 64 each) + final norm + per layer: q, o (64 x 64), k, v (64 x 32), two
# norms, the router (8 x 64) and the experts.
LAYER_PARAMS = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 8 * 64 + EXPERTS * 3 * H * WIDTH
TOTAL = 2 * 512 * 64 + 64 + LAYERS * LAYER_PARAMS  # 386,368
DENSE = TOTAL - EXPERT_PARAMS


def _plan(**kw) -> Plan:
    base = dict(model="tiny-mixtral", num_workers=4, seq_len=32, micro_batch=2, global_batch=8, precision="fp32",
                device="cpu", strategy="fsdp")
    base.update(kw)
    return Plan(**base)


def test_expert_layout_is_the_architectures():
    layout = expert_layout(_plan())
    assert layout.total == EXPERT_PARAMS == 294_912
    assert layout.per_layer == (EXPERT_PARAMS // 2, EXPERT_PARAMS // 2)
    assert (layout.experts, layout.top_k, layout.moe_layers) == (EXPERTS, TOP_K, LAYERS)
    assert layout.width(H) == WIDTH
    assert model_shape(_plan()).total == TOTAL == 386_368


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_states_per_rank_by_hand(ep):
    """dp 4: FSDP2 shards the dense part over 4 ranks, the E / ep experts over 4 / ep copies, so
    the fp32 shard (weights at the optimizer step) is (dense + experts) / 4 whatever ep; DDP holds
    the dense part whole and E / ep of the experts; grad_op keeps E / ep experts of every block
    gathered through the forward."""
    fsdp = _plan(ep=ep)
    held, share = held_with_experts(fsdp)
    assert held.local == DENSE + EXPERT_PARAMS / ep
    assert (share is None) == (ep == 1)
    experts_here = share.local if share else 0.0
    assert shard_params(held.local, experts_here, 4, share) == pytest.approx(DENSE / 4 + EXPERT_PARAMS / ep / (4 // ep))
    step = memory_moments(fsdp, "formula")["step"]
    assert step.weights == pytest.approx(4 * (DENSE / 4 + EXPERT_PARAMS / 4))
    assert step.optimizer >= 8 * (DENSE / 4 + EXPERT_PARAMS / 4)

    ddp = memory_moments(_plan(ep=ep, strategy="ddp"), "formula")["step"]
    assert ddp.weights == pytest.approx(4 * (DENSE + EXPERT_PARAMS / ep))  # 1,545,472 / 956,416 / 661,504 B

    grad_op = memory_moments(_plan(ep=ep, fsdp={"sharding": "grad_op"}), "formula")["forward"]
    root = 2 * 512 * 64 + 64
    block_gathered = LAYER_PARAMS - EXPERTS * 3 * H * WIDTH * (ep - 1) / ep
    assert grad_op.weights == pytest.approx(4 * (DENSE / 4 + EXPERT_PARAMS / 4) + 4 * root + 4 * LAYERS * block_gathered)


def test_construction_builds_only_the_ranks_experts():
    ddp1, ddp4 = (construction_bytes(_plan(strategy="ddp", ep=ep)) for ep in (1, 4))
    largest_dense = 512 * 64  # the embedding (and the head)
    assert ddp4 == pytest.approx(4 * (DENSE + EXPERT_PARAMS / 4) + 4 * max(largest_dense, EXPERTS * 3 * H * WIDTH / 4))
    assert ddp1 - ddp4 > 4 * EXPERT_PARAMS * 0.7


def test_all_to_all_volume_formula_and_where_it_runs():
    assert all_to_all_bytes(64, 2, 64, 4, 1, 2) == 0.0  # ep 1: no exchange
    # 4 exchanges (dispatch, combine; forward, backward) x tokens x top_k x hidden x bytes x (ep-1)/ep x layers
    assert all_to_all_bytes(64, 2, 64, 4, 4, 2) == 4 * 64 * 2 * 64 * 4 * 3 / 4 * 2 == 196_608
    plan = _plan(ep=4)
    tokens = plan.micro_batch * plan.seq_len
    assert comm_volume(plan).ep == plan.grad_accum * 4 * tokens * TOP_K * H * 4 * 3 / 4 * LAYERS
    assert comm_volume(_plan(ep=1)).ep == 0.0

    def gpu(num_workers: int, ep: int, per_node: int) -> Plan:
        return Plan(model="tiny-mixtral", num_workers=num_workers, ep=ep, gpus_per_node=per_node, strategy="fsdp",
                    device="cuda", precision="bf16", seq_len=32, micro_batch=1, global_batch=num_workers)

    assert not all_to_all_crosses_nodes(gpu(16, 8, 8), 8)  # an ep group of 8 consecutive ranks: one node
    assert all_to_all_crosses_nodes(gpu(16, 8, 4), 4)  # 8 ranks over nodes of 4
    assert all_to_all_crosses_nodes(gpu(12, 4, 6), 6)  # groups of 4 straddle nodes of 6
    assert expert_dp_crosses_nodes(gpu(16, 4, 8), 8)  # copies ep apart over 16 ranks: across the 2 nodes
    assert not expert_dp_crosses_nodes(gpu(8, 4, 8), 8)
    # The roofline times the all-to-all on the node's links or the network's, exposed.
    h100 = get_device("h100-80gb")
    inside, across = (_time_terms(gpu(16, 8, per_node), h100)[2] for per_node in (8, 4))
    ratio = h100.intra_node_gbps / h100.inter_node_gbps
    assert across == pytest.approx(inside * ratio, rel=1e-6)


def test_expert_dp_collectives_over_the_expert_copies_only():
    """FSDP2's gathers and reduce-scatters: the dense part over dp 4, the experts over 4 / ep; at ep
    4 the experts have one copy each and move nothing."""
    d1, d4 = comm_volume(_plan(ep=1)).dp, comm_volume(_plan(ep=4)).dp
    ga = _plan().grad_accum
    per_param = ga * (2 * 4 + 4)  # two fp32 all-gathers (reshard after forward) and a fp32 reduce-scatter
    assert d1 == pytest.approx(3 / 4 * per_param * TOTAL)
    assert d4 == pytest.approx(3 / 4 * per_param * DENSE)
    d2 = comm_volume(_plan(ep=2)).dp  # experts: E / 2 over 2 copies, (2 - 1) / 2 of a ring
    assert d2 == pytest.approx(3 / 4 * per_param * DENSE + 1 / 2 * per_param * EXPERT_PARAMS / 2)


def test_imbalance_scales_expert_compute_all_to_all_and_received_activations():
    plan, dense_like = _plan(ep=4), _plan(ep=1)
    cpu = get_device("cpu")
    assert comm_volume(plan, 1.5).ep == pytest.approx(1.5 * comm_volume(plan, 1.0).ep)
    share = expert_flops_share(plan)
    assert 0 < share < 1
    assert compute_seconds(plan, cpu, imbalance=1.5) == pytest.approx(compute_seconds(plan, cpu) * (1 + 0.5 * share))
    assert compute_seconds(dense_like, cpu, imbalance=1.5) == compute_seconds(dense_like, cpu)  # ep 1: all local
    balanced, skewed = (memory_moments(plan, "formula", imbalance=i)["forward"].activations for i in (1.0, 2.0))
    tokens = plan.micro_batch * plan.seq_len
    # the busiest rank's extra rows (tokens x top_k more), each input + gate/up + activation, in both
    # blocks, and one layer's received buffer that much bigger
    extra_saved = tokens * TOP_K * (H + 3 * WIDTH) * 4 * LAYERS
    assert skewed - balanced == pytest.approx(extra_saved + tokens * TOP_K * H * 4)
    assert estimate(plan, cpu, routing_balance=2.0, activation_model="formula").time.step_s > \
        estimate(plan, cpu, activation_model="formula").time.step_s
    with pytest.raises(ValueError, match=r"routing_balance: got 0\.5; allowed: a number >= 1"):
        estimate(plan, cpu, routing_balance=0.5, activation_model="formula")


SPACES = [("qwen3_30b_a3b_1x8", "h100-80gb"), ("mixtral_8x7b_2x8", "h100-80gb"),
          ("deepseek_v3_671b_32x8", "h200-141gb")]


@pytest.mark.parametrize("name,device", SPACES)
def test_moe_spaces_rank_ep_plans_and_reject_naming_the_part(name, device):
    from paratune.sweep.space import load_space

    space = load_space(ROOT / "search_spaces" / f"{name}.yaml")
    dev = get_device(device)
    estimates = estimate_space(space, dev, capacity_gib=space.spec.objective.memory_budget_gb,
                               activation_model="formula")
    fitting = [e for e in estimates if e.fits]
    assert fitting and any(e.plan.ep > 1 for e in fitting), [(e.plan.ep, e.plan.strategy) for e in fitting[:3]]
    # ep trades FSDP2's gathers of the experts (prefetched: hidden under the micro-batch's compute
    # while it lasts longer, estimate.dp_overlap_share) for an exposed all-to-all: on one or two
    # nodes the gathers hide and ep 1 ranks first by a few percent; DeepSeek-V3's 671B cannot
    # gather its experts in time, and its ep plans rank first
    if name == "deepseek_v3_671b_32x8":
        assert fitting[0].plan.ep > 1, [(e.plan.ep, e.plan.strategy) for e in fitting[:3]]
    assert all(e.comm.ep > 0 for e in fitting if e.plan.ep > 1)
    rejected = [e for e in estimates if not e.fits]
    assert rejected
    ddp_whole = [e for e in rejected if e.plan.strategy == "ddp" and e.plan.ep == min(p.plan.ep for p in estimates)]
    assert ddp_whole and all("weights+grads+optimizer" in e.overflow for e in ddp_whole)
    assert all("largest part" in e.overflow or "alone" in e.overflow or "construction" in e.overflow
               for e in rejected)
    # under ddp ep divides the experts' states: the smallest ep holds the most
    ddp = sorted((e for e in estimates if e.plan.strategy == "ddp" and e.plan.micro_batch == 1 and e.plan.pp == 1
                  and e.plan.activation_checkpointing == "full"), key=lambda e: e.plan.ep)
    states = [e.memory.weights + e.memory.optimizer for e in ddp]
    assert states == sorted(states, reverse=True) and states[0] > states[-1]


def _moe_profile(seconds_per_byte: float = 1e-9) -> "Profile":  # noqa: F821 - paratune.costs.profile.Profile
    """A profile of tiny-mixtral's block (every expert local, as the profiler runs it) with linear
    collective curves for groups of 2 and 4 (no latency: the bytes alone)."""
    from paratune.costs.profile import BlockShape, BlockTime, Curve, LinearFit, Profile, config_digest

    blocks = [BlockTime(shape=BlockShape(micro_batch=2, seq_len=32), block_s=0.01, embed_s=0.001, head_s=0.02)]
    curves = [Curve(op=op, size=size, stride=1, latency_s=0.0, seconds_per_byte=seconds_per_byte)
              for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv") for size in (2, 4)]
    return Profile(model="tiny-mixtral", config_digest=config_digest("tiny-mixtral"), precision="fp32",
                   device_type="cpu", device_name="cpu", world_size=4, blocks=blocks, collectives=curves,
                   optimizer=LinearFit(a=1e-3, b=1e-9))


def test_calibrated_model_times_the_all_to_all_and_the_busiest_ranks_experts():
    from paratune.costs.profile import GroupSpec, plan_groups
    from paratune.costs.timemodel import compose

    profile = _moe_profile()
    plan = _plan(ep=2)
    terms = compose(plan, profile)
    tokens = plan.micro_batch * plan.seq_len
    rows = tokens * TOP_K * H * 4  # one exchange's buffer, fp32
    assert terms["ep_comm"] == pytest.approx(4 * LAYERS * plan.grad_accum * rows * 1e-9)
    assert compose(_plan(ep=1), profile)["ep_comm"] == 0.0
    skewed = compose(plan, profile, imbalance=1.5)
    assert skewed["ep_comm"] == pytest.approx(1.5 * terms["ep_comm"])
    assert skewed["compute"] == pytest.approx(terms["compute"] * (1 + 0.5 * expert_flops_share(plan)))
    # the experts' FSDP2 collectives run on their 2 copies; at ep 4 (one copy) there are none, so
    # the dp term shrinks as ep grows
    assert compose(_plan(ep=4), profile)["dp_comm"] < terms["dp_comm"] < compose(_plan(ep=1), profile)["dp_comm"]
    assert GroupSpec(size=2, stride=1) in plan_groups(plan) and GroupSpec(size=2, stride=2) in plan_groups(plan)


def test_plan_command_shows_the_expert_layout_and_takes_a_measured_balance(tmp_path, capsys):
    from paratune.cli import main

    space = str(ROOT / "search_spaces" / "mixtral_8x7b_2x8.yaml")
    out = tmp_path / "plans.json"
    assert main(["plan", space, "--formula", "--routing-balance", "1.3", "--json", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "expert parallelism: experts per rank, their copies, the all-to-all" in said
    assert "1 of 8" in said and "one node (NVLink)" in said
    assert "routing balance (max / mean tokens per expert): 1.3 (measured, --routing-balance)" in said
    import json

    rows = json.loads(out.read_text())
    assert any(r["fits"] and r["plan"]["ep"] == 8 for r in rows)
    assert main(["plan", space, "--formula", "--routing-balance", "0.5"]) == 2
    assert "routing_balance: got 0.5; allowed: a number >= 1" in " ".join(capsys.readouterr().out.split())


def test_a_ranks_blocks_are_traced_as_moe_blocks_with_its_own_experts():
    """The activation trace under ep holds E / ep experts (at least top_k) and MoE blocks only."""
    import json

    from paratune.costs.moe import rank_trace_config as _rank_experts
    from paratune.model.shapes import model_config_key

    key = model_config_key(_plan())
    assert _rank_experts(key, 1) == key  # all experts, no dense first blocks to skip
    assert json.loads(_rank_experts(key, 4))["num_local_experts"] == EXPERTS // 4
    deepseek = json.loads(_rank_experts(model_config_key(_plan(model="deepseek-v3", num_workers=64, global_batch=128, ep=64)), 64))
    assert (deepseek["n_routed_experts"], deepseek["first_k_dense_replace"], deepseek["n_group"]) == (8, 0, 1)
    dense = model_config_key(_plan(model="tiny-llama", ep=1))
    assert _rank_experts(dense, 4) == dense


def test_with_tp_a_rank_holds_its_ep_ranks_experts_whole():
    """tp x ep (paratune.parallel.ep): tp splits the dense part, the routed experts are ep's, whole on
    every tp rank, so a rank holds E / ep of them (not E / tp), and FSDP2 shards them over their
    expert_dp x tp copies; each tp rank dispatches 1 / tp of the shared tokens."""
    from paratune.costs.estimate import comm_volume
    from paratune.costs.moe import held_with_experts
    from paratune.model.shapes import model_shape

    def held(**kw):
        plan = _plan(num_workers=8, global_batch=8, micro_batch=1, strategy="ddp", tp=2, **kw)
        return held_with_experts(plan, model_shape(plan))

    (dense_tp, _), (ep4, share) = held(), held(ep=4)
    assert ep4.local == pytest.approx(dense_tp.local - EXPERT_PARAMS / 2 + EXPERT_PARAMS / 4)
    assert share.expert_dp == 4 // 4 * 2  # dp 4 / ep 4 copies on each tp rank: 2 ranks hold the same experts
    # dp 4 and 2 micro-batches of 1 both ways: with tp 2 each rank dispatches half the tokens
    plan_tp = _plan(num_workers=8, global_batch=8, micro_batch=1, strategy="ddp", tp=2, ep=2)
    plan_no_tp = _plan(num_workers=4, global_batch=8, micro_batch=1, strategy="ddp", ep=2)
    assert comm_volume(plan_no_tp).ep > 0
    assert comm_volume(plan_tp).ep == pytest.approx(comm_volume(plan_no_tp).ep / 2)


def test_a_sweep_passes_the_measured_routing_balance_to_its_time_model():
    """The ledger's calibration and the calibrated model take each trial's routing_balance: later
    ep predictions use the largest seen (the busiest rank sets the step)."""
    from paratune.costs.estimate import Roofline
    from paratune.trial.results import TrialResult
    from paratune.sweep.ledger import observe_calibration

    cpu = get_device("cpu")
    roofline = Roofline(cpu, None, activation_model="formula")
    plan = _plan(ep=2)
    before = roofline.predict(plan).time.step_s
    result = TrialResult(status="ok", plan=plan.to_dict(), world_size=4, step_time_median_s=before,
                         routing_balance=1.8)
    observe_calibration(roofline, result)
    assert roofline.routing_balance == 1.8
    observe_calibration(roofline, result.model_copy(update={"routing_balance": 1.2}))
    assert roofline.routing_balance == 1.8  # not lowered by a better-balanced trial
