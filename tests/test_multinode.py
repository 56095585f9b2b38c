"""Placement and node loss on a real multi-node Ray cluster: three `ray start` raylets on this
host (token auth on), driven with `ray job submit` as users do, with an MLflow server beside it:
a head with no CPUs (it runs the job drivers, as ray_cluster.yaml's CPU head does) and worker
nodes of 3 and 2 CPUs, sizes that make uneven packing happen (4 workers: 3 + 1). Its own module,
so that test_cluster_jobs.py's one-node cluster is gone before this one starts."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from paratune.sweep import Ledger
from test_cluster_jobs import (FIXED, WORKER_NODES, Cluster, _alive_train_workers, _start_cluster, alive_nodes, join_node,
                               ray_list)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def multinode():
    """A head with no CPUs (job drivers only, as ray_cluster.yaml's CPU head) and worker nodes of
    3 and 2 CPUs: placement and node loss."""
    yield from _start_cluster(0, WORKER_NODES)


# --------------------------------------------------------------------------- placement on several nodes
def _node_names(c: Cluster) -> dict[str, str]:
    """node id -> the test's name for it (its custom resource paratune_<name>), 'head' for the head."""
    names = {}
    for node in alive_nodes(c):
        res = node.get("resources_total", {})
        names[node["node_id"]] = next((k.removeprefix("paratune_") for k in res if k.startswith("paratune_")), "head")
    return names




def test_a_tp_group_packed_across_nodes_is_invalid_placement_and_whole_nodes_keep_it_inside(multinode):
    """4 workers with tp 2 on a cluster whose free CPUs are 3 + 1: Ray Train packs ranks 0-2 on one
    node and rank 3 on the other, so the tp group of ranks 2-3 would straddle nodes. Every rank
    checks the layout before the first step: invalid_placement, with the layout, never a hang.
    The same plan on whole nodes (gpus_per_node 2) runs 2 + 2 and records where each rank ran."""
    cluster = multinode
    plan = {**FIXED, "num_workers": 4, "tp": 2, "strategy": "ddp", "micro_batch": 2, "trial_timeout_s": 240}
    out = cluster.tmp / "placement.json"
    job, _ = cluster.submit("tests/placement_job.py", json.dumps(plan), str(out))
    assert cluster.status(job) == "SUCCEEDED", cluster.logs(job)[-4000:]
    packed, whole = json.loads(out.read_text())
    names = _node_names(cluster)
    assert packed["status"] == "failed" and packed["reason"] == "invalid_placement", (packed["message"], cluster.logs(job)[-3000:])
    assert "tp group of ranks 2-3 spans 2 nodes" in packed["message"] and "ranks 0-2" in packed["message"]
    assert whole["status"] == "ok", whole["message"]
    by_rank = {p["rank"]: (names[p["node_id"]], p["local_rank"], p["local_world_size"]) for p in whole["placement"]}
    assert by_rank[0][0] == by_rank[1][0] != by_rank[2][0] == by_rank[3][0]  # tp groups inside a node
    assert {by_rank[r][0] for r in by_rank} == {"node3", "node2"} and all(v[2] == 2 for v in by_rank.values())
    assert not _alive_train_workers(cluster)


def test_a_node_killed_mid_trial_is_node_lost_and_the_sweep_goes_on(multinode):
    """Two 2-worker plans with gpus_per_node 2 on nodes of 3 and 2 CPUs: both run at once, each on
    whole nodes of its own (never sharing one, though node3 could hold 3 workers), and each rank's
    node is recorded in the ledger and in MLflow. Then the raylet of the node running the trial
    that hangs is SIGKILLed (with its workers): that trial ends node_lost naming the node, the
    sweep finishes on the node left, nothing leaks (train workers, placement groups, the sweep's
    actors), and the finished result is kept. Runs last: the node is started again afterwards."""
    cluster = multinode
    space_path = cluster.tmp / "nodeloss.yaml"
    space_path.write_text(yaml.safe_dump({
        "name": "node-loss", "fixed": {**FIXED, "gpus_per_node": 2, "comm_timeout_s": 90, "trial_timeout_s": 240},
        "space": {"strategy": {"ddp": {}}, "micro_batch": [2], "env": {"PARATUNE_FAULT": ["hang:rank=0:step=1", "none"]}},
        "search": {"algorithm": "grid", "trials": 2, "top_k": 1, "remeasure_rounds": 0, "reuse_workers": False}}))
    out = cluster.tmp / "sweep-nodeloss"
    job, _ = cluster.submit("jobs/sweep.py", str(space_path), "--out", str(out), "--tracking-uri", cluster.tracking_uri,
                            wait=False)
    ledger_path = out / "ledger.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (ledger_path.exists() and '"none"' in ledger_path.read_text()):
        assert cluster.status(job) in ("PENDING", "RUNNING"), cluster.logs(job)[-4000:]
        time.sleep(1)
    # The healthy trial is done (its idle worker group keeps its node); the hanging one holds the
    # other node: kill that node.
    healthy_node = next(e.result.placement[0]["node_id"] for e in Ledger(ledger_path).search_entries()
                        if e.result.plan["env"]["PARATUNE_FAULT"] == "none")
    names = _node_names(cluster)
    victim_id = next(i for i, n in names.items() if n in cluster.nodes and i != healthy_node)
    victim = names[victim_id]
    workers = ray_list(cluster, "actors", "state=ALIVE")
    assert [a for a in workers if a["class_name"] == "RayTrainWorker" and a["node_id"] == victim_id], workers
    os.killpg(cluster.nodes[victim].pid, signal.SIGKILL)
    try:
        assert cluster.wait(job, timeout=300) == "SUCCEEDED", cluster.logs(job)[-4000:]
        by_fault = {e.result.plan["env"]["PARATUNE_FAULT"]: e.result for e in Ledger(ledger_path).search_entries()}
        lost = by_fault["hang:rank=0:step=1"]
        assert lost.status == "failed" and lost.reason == "node_lost", lost.message
        assert victim_id[:8] in lost.message
        healthy = by_fault["none"]
        assert healthy.ok, healthy.message
        # Side by side (the hanging trial was running when the healthy one finished), on different nodes.
        healthy_nodes = {p["node_id"] for p in healthy.placement}
        assert len(healthy.placement) == 2 and len(healthy_nodes) == 1 and victim_id not in healthy_nodes
        assert lost.started_at < healthy.started_at + healthy.wall_s < lost.started_at + lost.wall_s
        client = MlflowClient(cluster.tracking_uri)
        parent_id = json.loads((out / "sweep.json").read_text())["parent_run_id"]
        children = {r.data.tags["paratune.status"]: r for r in client.search_runs(
            [client.get_run(parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}' and tags.`paratune.phase` = 'search'")}
        node = healthy.placement[0]
        assert children["ok"].data.tags["paratune.placement"] == f"node {node['node_ip']} ({node['node_id'][:8]}): ranks 0-1"
        assert children["failed"].data.tags["paratune.failure_reason"] == "node_lost"
        assert "paratune.winner" in client.get_run(parent_id).data.tags
        # Nothing leaks: no train worker, no placement group still holding resources, no sweep actor.
        time.sleep(2)
        assert not _alive_train_workers(cluster)
        groups = ray_list(cluster, "placement-groups")
        assert not [g for g in groups if g["state"] in ("CREATED", "PENDING", "RESCHEDULING")], groups
        alive = ray_list(cluster, "actors", "state=ALIVE")
        assert not [a for a in alive if a["class_name"] in ("NodeLeases", "PoolActor", "TrainController")], alive
    finally:
        cluster.nodes[victim] = join_node(cluster, victim, WORKER_NODES[victim], expect=1 + len(WORKER_NODES))
