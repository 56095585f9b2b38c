"""Placement rules as pure functions (paratune.trial.placement): what a layout breaks, what a cluster
cannot hold, how whole nodes are chosen and pinned, how a wait for an autoscaler ends; and the
failure texts Ray gives when a node dies. The same rules on a real multi-node cluster:
tests/test_cluster_jobs.py."""

import pytest

from paratune.trial.failures import CLUSTER_REASONS, classify, classify_text
from paratune.trial.placement import (
    Demand,
    NodeLeases,
    NodeRoom,
    PlacementError,
    RankPlace,
    check_layout,
    choose_nodes,
    describe,
    pinned_selectors,
    placement_violations,
    shortfall,
    trials_at_once,
    wait_for_room,
)
from paratune.config.plan import load_plan_dict

A, B, C = "a" * 56, "b" * 56, "c" * 56


def layout(*nodes: str) -> list[RankPlace]:
    """Ranks in order, each on the node given; local ranks and local worlds as Ray Train sets them."""
    counts = {n: nodes.count(n) for n in nodes}
    seen: dict[str, int] = {}
    out = []
    for rank, node in enumerate(nodes):
        out.append(RankPlace(rank, node, f"10.0.0.{ord(node[0]) - 96}", seen.get(node, 0), counts[node]))
        seen[node] = seen.get(node, 0) + 1
    return out


def plan(**kw):
    base = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 4}
    return load_plan_dict({**base, **kw})


def test_a_tp_group_across_two_nodes_is_an_invalid_placement_with_the_layout():
    tp2 = plan(tp=2, strategy="ddp")
    uneven = layout(A, A, A, B)  # what PACK gives 4 workers on a 3-CPU and a 2-CPU node
    problems = placement_violations(tp2, uneven)
    assert problems == ["tp group of ranks 2-3 spans 2 nodes"]
    with pytest.raises(PlacementError) as err:
        check_layout(tp2, uneven)
    text = str(err.value)
    assert text.startswith("invalid_placement: ") and "node 10.0.0.1 (aaaaaaaa): ranks 0-2" in text
    assert "node 10.0.0.2 (bbbbbbbb): rank 3" in text and "set gpus_per_node" in text
    assert classify(err.value)[0] == "invalid_placement"
    # Two nodes of two: every tp group inside one node, and one local world for all ranks.
    assert check_layout(tp2, layout(A, A, B, B)) == 2
    assert check_layout(plan(strategy="ddp"), uneven) == 1  # dp only: any layout is correct


def test_hybrid_shard_groups_and_node_size_are_checked():
    hybrid = plan(strategy="fsdp", fsdp={"sharding": "hybrid"}, gpus_per_node=2)
    assert placement_violations(hybrid, layout(A, A, B, B)) == []
    assert placement_violations(hybrid, layout(A, B, A, B)) == ["hybrid shard group of ranks 0-1 spans 2 nodes",
                                                                "hybrid shard group of ranks 2-3 spans 2 nodes"]
    assert "3 ranks on node aaaaaaaa, more than gpus_per_node 2" in placement_violations(hybrid, layout(A, A, A, B))
    # Without a node size, hybrid sharding takes each rank's local world: it must be the same on all.
    unsized = plan(strategy="fsdp", fsdp={"sharding": "hybrid"})
    assert placement_violations(unsized, layout(A, A, B, B)) == []
    assert "same number of ranks on every node" in placement_violations(unsized, layout(A, A, A, B))[0]


def test_describe_names_nodes_and_rank_ranges():
    assert describe(layout(A, A, B, A)) == "node 10.0.0.1 (aaaaaaaa): ranks 0,1,3; node 10.0.0.2 (bbbbbbbb): rank 2"


NODES = [NodeRoom(A, "10.0.0.1", {"CPU": 3.0}), NodeRoom(B, "10.0.0.2", {"CPU": 2.0}),
         NodeRoom(C, "10.0.0.3", {"CPU": 1.0})]


def test_shortfall_names_what_the_plan_needs_and_what_the_cluster_has():
    assert shortfall(Demand(6, {"CPU": 1.0}, None, False), NODES) is None
    too_big = shortfall(Demand(8, {"CPU": 1.0}, None, False), NODES)
    assert too_big.startswith("insufficient_resources: the plan needs 8 workers x {CPU 1}")
    assert "3 node(s)" in too_big and "10.0.0.1 (aaaaaaaa): CPU 3 -> 3 worker(s)" in too_big
    # Whole nodes of 2 workers: A and B can host one each, C cannot.
    assert shortfall(Demand(4, {"CPU": 1.0}, 2, True), NODES) is None
    missing = shortfall(Demand(6, {"CPU": 1.0}, 2, True), NODES)
    assert "on 3 whole node(s) of >= 2 worker(s) each" in missing
    gpus = shortfall(Demand(2, {"GPU": 1.0, "CPU": 8.0}, 8, True), NODES)
    assert "GPU 0" in gpus and "-> 0 worker(s)" in gpus


def test_concurrency_follows_whole_nodes():
    assert trials_at_once(Demand(2, {"CPU": 1.0}, 2, True), NODES) == 2  # A and B, one trial each
    assert trials_at_once(Demand(2, {"CPU": 1.0}, None, False), NODES) == 3  # 6 CPUs / 2
    assert trials_at_once(Demand(4, {"CPU": 1.0}, 2, True), NODES) == 1
    assert trials_at_once(Demand(8, {"CPU": 1.0}, None, False), NODES) == 1  # never 0


def test_whole_nodes_are_chosen_once_and_pinned_rank_by_rank():
    demand = Demand(4, {"CPU": 1.0}, 2, True)
    assert choose_nodes(demand, NODES, set()) == [A, B]
    assert choose_nodes(demand, NODES, {A}) is None  # C cannot host 2: not enough free nodes
    assert pinned_selectors(demand, [A, B]) == [{"ray.io/node-id": A}] * 2 + [{"ray.io/node-id": B}] * 2
    leases = NodeLeases()
    small = Demand(2, {"CPU": 1.0}, 2, True)
    as_dicts = [{"node_id": n.node_id, "ip": n.ip, "resources": n.resources} for n in NODES]
    first = leases.acquire("t1", small.__dict__, as_dicts)
    second = leases.acquire("t2", small.__dict__, as_dicts)
    assert first == [A] and second == [B]
    assert leases.acquire("t3", small.__dict__, as_dicts) is None  # no third trial shares a node
    assert leases.release("t1") == 1 and leases.acquire("t3", small.__dict__, as_dicts) == [A]


def test_waiting_for_an_autoscaler_is_visible_and_bounded():
    said: list[str] = []
    now = [0.0]
    booted = [NodeRoom(A, "10.0.0.1", {"CPU": 1.0})]

    def nodes():
        return booted + ([NodeRoom(B, "10.0.0.2", {"CPU": 2.0})] if now[0] >= 40 else [])

    def sleep(s):
        now[0] += s

    demand = Demand(3, {"CPU": 1.0}, None, False)
    assert wait_for_room(demand, 300, said.append, poll_s=5, nodes=nodes, clock=lambda: now[0], sleep=sleep) is None
    assert now[0] == 40 and said and said[0].startswith("waiting for nodes (0 s of at most 300 s): the plan needs 3")
    now[0] = 0.0
    timed_out = wait_for_room(Demand(9, {"CPU": 1.0}, None, False), 60, said.append, poll_s=5, nodes=nodes,
                              clock=lambda: now[0], sleep=sleep)
    assert timed_out.startswith("insufficient_resources: ") and "(waited 60 s for the autoscaler, the bound)" in timed_out


@pytest.mark.parametrize("text, reason", [
    # GCS's words for an actor whose node died (Ray 2.60), as Ray Train wraps them.
    ("WorkerGroupError: Training failed due to worker errors:\n[Rank 1]\nActorDiedError: The actor died unexpectedly "
     "before finishing this task.\n\tclass_name: RayTrainWorker\n\tactor_id: 6f0c\n\tip: 127.0.0.1\n"
     "The actor died because its node has died. Node Id: 3c6b1e0b2f", "node_lost"),
    ("NodeDiedError: node 3c6b1e0b2f died", "node_lost"),
    ("RuntimeError: invalid_placement: tp group of ranks 2-3 spans 2 nodes", "invalid_placement"),
    ("ActorDiedError: The actor died unexpectedly before finishing this task.\n\tpid: 4242\n"
     "Worker unexpectedly exits with a connection error code 2", "worker_died"),
])
def test_node_death_and_placement_texts_are_classified(text, reason):
    assert classify_text(text) == reason
    assert ({"node_lost", "insufficient_resources", "invalid_placement"} <= CLUSTER_REASONS)


def test_a_trial_the_cluster_failed_is_kept_but_measured_again_on_resume(tmp_path):
    from paratune.sweep.ledger import Ledger, LedgerEntry, objective_value, unscored
    from paratune.cluster.trial import TrialResult

    plan_dict = plan(strategy="ddp").to_dict()
    lost = TrialResult.failed(plan_dict, "node_lost", "node(s) aaaaaaaa died during the trial")
    oom = TrialResult.failed(plan_dict, "oom", "out of memory")
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(LedgerEntry(1, "lost", lost))
    ledger.append(LedgerEntry(2, "oom", oom))
    again = Ledger(tmp_path / "ledger.jsonl")
    assert [e.key for e in again.search_entries()] == ["lost", "oom"]  # nothing lost
    assert again.keys() == {"oom"}  # the plan's own failure is final; the node's is measured again
    assert unscored(lost) and not unscored(oom) and objective_value(oom, None) == 0.0
