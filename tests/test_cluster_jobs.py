"""A real multi-node Ray cluster on this host, driven the way users drive one: `ray job submit
--runtime-env jobs/runtime_env.yaml -- python jobs/...`, with an MLflow tracking server (`paratune
ui`) beside it. Token auth on. Three `ray start` raylets: a head with no CPUs (it runs the job
drivers, as ray_cluster.yaml's CPU head does) and worker nodes of 3 and 2 CPUs, sizes that make
uneven packing happen (4 workers: 3 + 1). One cluster for every job test, in file order: the
training job, placement, and the sweep's faults last (it kills a node). Faults are real:
SIGKILLed workers and drivers, a worker that hangs in the middle of a step, a node whose raylet is
killed. Each job submission costs a driver, a job supervisor and Ray Train launches (~30
CPU-seconds each on this 2-core machine), so the sweep meets all of its faults in one sweep and
its resumption."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from paratune.sweep.ledger import Ledger
from procs import free_port, stop_group, wait_http

# `e2e` (make test-e2e): `make test` keeps a sweep's trials on Ray (test_sweep), fresh and reused worker
# groups with their failures (test_session) and a training run's checkpoints (test_ray_range).
pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.skipif(
    tuple(int(x) for x in __import__("ray").__version__.split(".")[:2]) < (2, 52),
    reason="the cluster runs with token auth, which Ray has from 2.52 (below, RAY_AUTH_MODE does nothing: "
           "docs/install.md 'Ray versions')")]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SECRET = "hf_" + secrets.token_hex(12)  # a token in the cluster's environment: must never reach MLflow
FIXED = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2, "warmup_steps": 1,
         "measure_steps": 2, "profile_comm": False, "lr": 0.01, "trial_timeout_s": 60, "comm_timeout_s": 10}


@dataclass
class Cluster:
    address: str  # the job server (dashboard), http://127.0.0.1:PORT
    tracking_uri: str  # the MLflow server
    env: dict[str, str]  # what a user's shell has: RAY_AUTH_MODE=token and the token's path
    tmp: Path
    gcs: str = ""  # 127.0.0.1:PORT, what `ray start --address` joins
    nodes: dict[str, subprocess.Popen] | None = None  # worker node name -> its `ray start --block`

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def submit(self, *entrypoint: str, wait: bool = True, timeout: float = 600,
               env_vars: dict[str, str] | None = None) -> tuple[str, subprocess.CompletedProcess]:
        """The README's command (the repo shipped as the working directory), or with `env_vars` the
        winner's job.sh form (paratune installed where the job runs, its env inline, nothing from the
        directory it is typed in); returns the job id and the CLI's output."""
        ship = (["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars is not None else
                ["--working-dir", ".", "--runtime-env", "jobs/runtime_env.yaml"])
        args = ["job", "submit", "--address", self.address, *ship, *([] if wait else ["--no-wait"]), "--", "python",
                *entrypoint]
        proc = self.ray(*args, timeout=timeout)
        for _ in range(30):  # the job agent registers a few seconds after the dashboard answers
            if "No available agent" not in proc.stderr + proc.stdout:
                break
            time.sleep(2)
            proc = self.ray(*args, timeout=timeout)
        found = re.search(r"raysubmit_\w+", proc.stdout + proc.stderr)
        assert found, proc.stdout + proc.stderr
        return found.group(0), proc

    @cached_property
    def jobs(self):
        """Ray's job SDK, for status and logs: polling through the `ray` CLI starts a Python process
        (a CPU-second of imports) every poll; the job itself is always submitted with the CLI."""
        from ray.job_submission import JobSubmissionClient

        token = Path(self.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        return JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {token}"})

    def status(self, job_id: str) -> str:
        return str(self.jobs.get_job_status(job_id).value)

    def logs(self, job_id: str) -> str:
        return self.jobs.get_job_logs(job_id)

    def wait(self, job_id: str, timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            status = self.status(job_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(2)
        return "TIMEOUT"


# Worker nodes: name -> CPUs. The head has none: job drivers only, never a trial's worker.
WORKER_NODES = {"node3": 3, "node2": 2}
# GCS notices a dead raylet within ~10 s (default: 5 missed checks of 3 s, ~30 s), so node loss is
# quick, and a live raylet on 2 cores shared with another test process (make test's two) answers
# in time: 1 s checks with a 1 s timeout and 2 misses lost a live node under that load.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                      "RAY_health_check_timeout_ms": "3000", "RAY_health_check_initial_delay_ms": "1000"}


def own_ports() -> list[str]:
    """Every port a node would otherwise take by default (e.g. its dashboard agent's 52365): two
    nodes on one host, or two clusters, must not fight over one (the job server then finds no
    agent: "No available agent to submit job")."""
    return [f"--{p}={free_port()}" for p in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                             "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                             "runtime-env-agent-port")]


def start_worker_node(c: Cluster, name: str, cpus: int) -> subprocess.Popen:
    """One more raylet on this host joining the head (its own ports, sockets and CPUs)."""
    return subprocess.Popen(
        [str(BIN / "ray"), "start", f"--address={c.gcs}", "--block", "--node-ip-address=127.0.0.1",
         f"--num-cpus={cpus}", "--num-gpus=0", f"--resources={{\"paratune_{name}\": 1}}", *own_ports(),
         f"--temp-dir={c.tmp / name}"],  # its own session dir: raylets on one host must not share sockets
        env=c.env, stdout=(c.tmp / f"{name}.log").open("a"), stderr=subprocess.STDOUT, start_new_session=True)


def ray_list(c: Cluster, kind: str, *filters: str) -> list[dict]:
    """What `ray list KIND --filter K=V --detail` lists, from the dashboard's state API over HTTP
    with the cluster's token (each `ray list` is a Python process: ~3 CPU-seconds of imports, and
    the tests poll). Retried: the state API can time out on a loaded machine."""
    import requests

    params = [("limit", "10000"), ("detail", "true")]
    for f in filters:
        key, _, value = f.partition("=")
        params += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
    headers = {"Authorization": f"Bearer {Path(c.env['RAY_AUTH_TOKEN_PATH']).read_text().strip()}"}
    error = ""
    for attempt in range(5):
        try:
            body = requests.get(f"{c.address}/api/v0/{kind.replace('-', '_')}", params=params, headers=headers, timeout=60).json()
            if body["result"]:
                return body["data"]["result"]["result"]
            error = body.get("msg", "")
        except (requests.RequestException, ValueError, KeyError) as err:
            error = repr(err)
        time.sleep(2)
    raise RuntimeError(f"ray list {kind}: {error[-1500:]}")


def join_node(c: Cluster, name: str, cpus: int, expect: int) -> subprocess.Popen:
    """Start a worker node and wait until the cluster has `expect` nodes. One at a time, and
    retried once: a raylet that does not register within Ray's fixed 30 s (a loaded 2-core
    machine) makes `ray start` give up ("The current node timed out during startup")."""
    for attempt in range(2):
        proc = start_worker_node(c, name, cpus)
        try:
            wait_for_nodes(c, expect, timeout=60)
            return proc
        except TimeoutError:
            stop_group(proc)
            if attempt:
                raise
    raise AssertionError("unreachable")


def alive_nodes(c: Cluster) -> list[dict]:
    return ray_list(c, "nodes", "state=ALIVE")


def wait_for_nodes(c: Cluster, count: int, timeout: float = 90) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        nodes = alive_nodes(c)
        if len(nodes) == count:
            return nodes
        time.sleep(1)
    logs = {p.name: p.read_text()[-1500:] for p in c.tmp.glob("node*.log")}
    raise TimeoutError(f"{count} alive nodes expected, saw {len(alive_nodes(c))}; node logs: {logs}")


def _start_cluster(head_cpus: int, worker_nodes: dict[str, int]):
    tmp = Path(tempfile.mkdtemp(prefix="ptc", dir="/tmp"))  # short: Ray's socket paths live under it
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token), "HF_TOKEN": SECRET}
    env.pop("RAY_ADDRESS", None)
    dash, mlflow_port, gcs_port = free_port(), free_port(), free_port()
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--num-cpus={head_cpus}", "--num-gpus=0",
         f"--temp-dir={tmp / 'ray'}", "--include-dashboard=true", *own_ports()],
        env={**env, **FAST_HEALTH_CHECKS}, stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    server = subprocess.Popen(
        [str(BIN / "paratune"), "ui", "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--host", "127.0.0.1",
         "--port", str(mlflow_port)],
        cwd=tmp, env=env, stdout=(tmp / "mlflow.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    c = Cluster(f"http://127.0.0.1:{dash}", f"http://127.0.0.1:{mlflow_port}", env, tmp, f"127.0.0.1:{gcs_port}", {})
    try:
        wait_http(f"http://127.0.0.1:{dash}/api/version")
        for i, (name, cpus) in enumerate(worker_nodes.items(), 2):
            c.nodes[name] = join_node(c, name, cpus, expect=i)
        wait_http(f"http://127.0.0.1:{mlflow_port}/health")
        yield c
    finally:
        for proc in c.nodes.values():
            stop_group(proc)
        stop_group(head)
        stop_group(server)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (job drivers only, as ray_cluster.yaml's CPU head) and worker nodes of
    3 and 2 CPUs."""
    yield from _start_cluster(0, WORKER_NODES)


def _no_secret_in(client: MlflowClient, runs) -> None:
    for run in runs:
        blob = json.dumps({"params": run.data.params, "tags": run.data.tags, "metrics": run.data.metrics})
        assert SECRET not in blob, f"secret leaked into MLflow run {run.info.run_id}"


def _alive_train_workers(cluster: Cluster) -> list[dict]:
    return [a for a in ray_list(cluster, "actors", "state=ALIVE") if a["class_name"] == "RayTrainWorker"]


def test_training_job_checkpoints_and_resumes_after_a_worker_is_killed(cluster):
    """The winner's training job, submitted as users submit it: checkpoints every 2 steps; rank 1
    is SIGKILLed 3 s into step 3; Ray Train restarts the worker group from the step-2 checkpoint,
    and the loss curve is the uninterrupted one step for step (the same training run on one
    process without interruption, which every fp32 strategy matches to < 1e-5)."""
    from paratune.config.plan import load_plan_dict
    from paratune.sweep.parity import reference_losses

    plan = {**FIXED, "strategy": "fsdp", "fsdp": {"sharding": "full"},
            "env": {"PARATUNE_FAULT": "kill:rank=1:step=3:delay_s=3"}}
    plan_path, result_path = cluster.tmp / "train.yaml", cluster.tmp / "train.json"
    plan_path.write_text(yaml.safe_dump(plan))
    # As the winner's job.sh submits it: `python -m paratune train`, the env inline, no working directory.
    job, _ = cluster.submit("-m", "paratune", "train", str(plan_path), "--steps", "6", "--checkpoint-every", "2",
                            "--name", "faulty", "--storage", str(cluster.tmp / "checkpoints"),
                            "--tracking-uri", cluster.tracking_uri, "--json", str(result_path),
                            "--hf-out", str(cluster.tmp / "trained-hf"),
                            env_vars={"PARATUNE_HOME": str(cluster.tmp / "home")})
    assert cluster.status(job) == "SUCCEEDED", cluster.logs(job)[-4000:]
    result = json.loads(result_path.read_text())
    assert result["status"] == "ok" and result["resumed_at_steps"] == [2]
    uninterrupted = reference_losses(load_plan_dict(plan), steps=6)
    assert len(result["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(result["losses"], uninterrupted)) < 1e-5
    assert Path(result["checkpoint"]).name == "step_00000006"
    _assert_hf_model_is_the_checkpointed_state(result, cluster.tmp / "trained-hf", plan)

    client = MlflowClient(cluster.tracking_uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["restarts"] == 1
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(6))  # each step once, across the restart
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(result["losses"])
    _no_secret_in(client, [run])


def _assert_hf_model_is_the_checkpointed_state(result: dict, hf_out: Path, plan: dict) -> None:
    """--hf-out: from_pretrained loads exactly the model of the last checkpoint's sharded state
    (the step-6 weights, after the restart), none of it left at its initial value."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from paratune.model.build import build_config, build_model

    assert result["hf_model"] == str(hf_out.resolve()) and (hf_out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(hf_out).state_dict()
    dcp_to_torch_save(Path(result["checkpoint"]) / "state", hf_out.parent / "state.pt")
    trained = torch.load(hf_out.parent / "state.pt", weights_only=False)["model"]
    initial = build_model(build_config(plan["model"]), seed=0).state_dict()
    assert set(loaded) == set(trained)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
        assert not torch.equal(loaded[key], initial[key]), f"{key}: still its initial value"


# --------------------------------------------------------------------------- placement on several nodes
def _node_names(c: Cluster) -> dict[str, str]:
    """node id -> the test's name for it (its custom resource paratune_<name>), 'head' for the head."""
    names = {}
    for node in alive_nodes(c):
        res = node.get("resources_total", {})
        names[node["node_id"]] = next((k.removeprefix("paratune_") for k in res if k.startswith("paratune_")), "head")
    return names




def test_a_tp_group_packed_across_nodes_is_invalid_placement_and_whole_nodes_keep_it_inside(cluster):
    """A tp-2 plan of 2 workers of 2 CPUs on nodes of 3 and 2 CPUs: Ray Train can only place one
    on each node, so the tp group straddles nodes. Every rank checks the layout before the first
    step: invalid_placement, with the layout, never a hang. The plan with 4 workers on whole nodes
    (gpus_per_node 2) runs 2 + 2 (though node3 could hold 3) and records where each rank ran."""
    plan = {**FIXED, "num_workers": 4, "tp": 2, "strategy": "ddp", "micro_batch": 2, "trial_timeout_s": 240}
    out = cluster.tmp / "placement.json"
    job, _ = cluster.submit("tests/placement_job.py", json.dumps(plan), str(out))
    assert cluster.status(job) == "SUCCEEDED", cluster.logs(job)[-4000:]
    packed, whole = json.loads(out.read_text())
    names = _node_names(cluster)
    assert packed["status"] == "failed" and packed["reason"] == "invalid_placement", (packed["message"], cluster.logs(job)[-3000:])
    assert "tp group of ranks 0-1 spans 2 nodes" in packed["message"], packed["message"]
    assert packed["message"].count(": rank ") == 2  # the layout: one rank on each node
    assert whole["status"] == "ok", whole["message"]
    by_rank = {p["rank"]: (names[p["node_id"]], p["local_rank"], p["local_world_size"]) for p in whole["placement"]}
    assert by_rank[0][0] == by_rank[1][0] != by_rank[2][0] == by_rank[3][0]  # tp groups inside a node
    assert {by_rank[r][0] for r in by_rank} == {"node3", "node2"} and all(v[2] == 2 for v in by_rank.values())
    assert not _alive_train_workers(cluster)


def test_a_sweep_survives_a_dead_worker_a_killed_driver_and_a_lost_node(cluster):
    """One sweep of three 2-worker plans with gpus_per_node 2 on nodes of 3 and 2 CPUs, through
    every fault a cluster deals a sweep. Two trials run at once, each on a whole node of its own
    (never sharing one, though node3 could hold 3 workers).
    1. A worker of one trial is SIGKILLed mid-trial (worker_died); the trial waiting for a node
       starts on the node it freed. While the other trial hangs in a collective, the sweep's
       driver itself is SIGKILLed.
    2. The sweep is resumed with --resume: the finished trial is kept, nothing is re-run, the two
       unfinished trials run side by side on the two nodes (the dead trial's and the dead driver's
       workers are gone). Once the healthy one is done, the raylet of the node running the hanging
       one is SIGKILLed with its workers: that trial ends node_lost naming the node, and the sweep
       finishes on the node left.
    Every trial is in the ledger and in MLflow once, with where its ranks ran; nothing leaks
    (train workers, placement groups, the sweep's actors). Runs last: the cluster is one node
    short after it."""
    space_path = cluster.tmp / "faults.yaml"
    space_path.write_text(yaml.safe_dump({
        "name": "faults", "fixed": {**FIXED, "gpus_per_node": 2, "comm_timeout_s": 90, "trial_timeout_s": 240},
        "space": {"strategy": {"ddp": {}}, "micro_batch": [2],
                  "env": {"PARATUNE_FAULT": ["hang:rank=0:step=1", "kill:rank=1:step=1", "none"]}},
        "search": {"algorithm": "grid", "trials": 3, "top_k": 1, "remeasure_rounds": 0}}))
    out = cluster.tmp / "sweep-faults"
    ledger_path = out / "ledger.jsonl"
    args = ["jobs/sweep.py", str(space_path), "--out", str(out), "--tracking-uri", cluster.tracking_uri]

    def faults_in_ledger() -> list[str]:
        return [e.result.plan["env"]["PARATUNE_FAULT"] for e in Ledger(ledger_path).search_entries()] \
            if ledger_path.exists() else []

    def wait_for_in_ledger(fault: str, job: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and fault not in faults_in_ledger():
            assert cluster.status(job) in ("PENDING", "RUNNING"), cluster.logs(job)[-4000:]
            time.sleep(1)
        assert fault in faults_in_ledger(), cluster.logs(job)[-4000:]

    # 1. The hanging trial and the killed one start together; kill the driver once the killed
    #    one is in the ledger (the hanging one cannot finish: its collective times out after 90 s).
    job, _ = cluster.submit(*args, wait=False)
    wait_for_in_ledger("kill:rank=1:step=1", job, timeout=300)
    first_lines = ledger_path.read_text().splitlines()
    assert faults_in_ledger() == ["kill:rank=1:step=1"], first_lines
    driver = subprocess.run(["pgrep", "-f", f"jobs/sweep.py {space_path}"], capture_output=True, text=True)
    pids = [int(p) for p in driver.stdout.split()]
    assert pids, "the sweep driver is not running"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert cluster.wait(job, timeout=120) == "FAILED"

    # 2. Resumed: the healthy trial and the hanging one side by side; then the hanging one's node dies.
    resumed, _ = cluster.submit(*args, "--resume", wait=False)
    wait_for_in_ledger("none", resumed, timeout=300)
    healthy_node = next(e.result.placement[0]["node_id"] for e in Ledger(ledger_path).search_entries()
                        if e.result.plan["env"]["PARATUNE_FAULT"] == "none")
    names = _node_names(cluster)
    victim_id = next(i for i, n in names.items() if n in cluster.nodes and i != healthy_node)
    victim = names[victim_id]
    workers = ray_list(cluster, "actors", "state=ALIVE")
    assert [a for a in workers if a["class_name"] == "RayTrainWorker" and a["node_id"] == victim_id], workers
    os.killpg(cluster.nodes[victim].pid, signal.SIGKILL)  # the module's last test: the node stays dead
    assert cluster.wait(resumed, timeout=300) == "SUCCEEDED", cluster.logs(resumed)[-4000:]
    log = cluster.logs(resumed)
    assert "resuming: 1 finished trial(s) kept, 2 to run" in log, log[-4000:]

    ledger = Ledger(ledger_path)
    search = ledger.search_entries()
    assert [e.number for e in search] == [1, 2, 3] and len({e.key for e in search}) == 3
    assert ledger_path.read_text().splitlines()[: len(first_lines)] == first_lines  # nothing rewritten
    by_fault = {e.result.plan["env"]["PARATUNE_FAULT"]: e.result for e in search}
    killed, lost, healthy = by_fault["kill:rank=1:step=1"], by_fault["hang:rank=0:step=1"], by_fault["none"]
    assert killed.reason == "worker_died", killed.message
    assert lost.status == "failed" and lost.reason == "node_lost", lost.message
    assert victim_id[:8] in lost.message
    assert healthy.ok, healthy.message
    # Side by side (the hanging trial was running when the healthy one finished), on different
    # whole nodes: the healthy trial's 2 ranks on one node, not the one that died.
    healthy_nodes = {p["node_id"] for p in healthy.placement}
    assert len(healthy.placement) == 2 and len(healthy_nodes) == 1 and victim_id not in healthy_nodes
    assert all(p["local_world_size"] == 2 for p in healthy.placement)
    assert lost.started_at < healthy.started_at + healthy.wall_s < lost.started_at + lost.wall_s

    client = MlflowClient(cluster.tracking_uri)
    parent_id = json.loads((out / "sweep.json").read_text())["parent_run_id"]
    experiment = client.get_run(parent_id).info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_id}' and tags.`paratune.phase` = 'search'")
    assert sorted(int(r.data.tags["paratune.trial_number"]) for r in children) == [1, 2, 3]  # once each
    assert sorted(r.data.tags.get("paratune.failure_reason", "ok") for r in children) == ["node_lost", "ok", "worker_died"]
    node = healthy.placement[0]
    ok_run = next(r for r in children if r.data.tags["paratune.status"] == "ok")
    assert ok_run.data.tags["paratune.placement"] == f"node {node['node_ip']} ({node['node_id'][:8]}): ranks 0-1"
    assert client.get_run(parent_id).data.tags["paratune.winner"].startswith("ddp")
    job_sh = (out / "winner" / "job.sh").read_text()
    assert job_sh.count("ray job submit") == 1 and "-- python -m paratune train" in job_sh
    assert "jobs/" not in job_sh  # nothing assumed in the directory it is typed in
    _no_secret_in(client, [client.get_run(parent_id), *children])
    # Nothing leaks: no train worker, no placement group still holding resources, no sweep actor.
    time.sleep(2)
    assert not _alive_train_workers(cluster)
    groups = ray_list(cluster, "placement-groups")
    assert not [g for g in groups if g["state"] in ("CREATED", "PENDING", "RESCHEDULING")], groups
    alive = ray_list(cluster, "actors", "state=ALIVE")
    assert not [a for a in alive if a["class_name"] in ("NodeLeases", "PoolActor", "FitRunner", "TrainController")], alive
    # The pools of both drivers (and so their groups' Train controllers) ran on the head, the
    # drivers' node: a 0-CPU actor on a worker node would have died with it, and the sweep with it.
    pools = [a for a in ray_list(cluster, "actors", "class_name=PoolActor")]
    assert len(pools) == 2 and {names.get(a["node_id"]) for a in pools} == {"head"}, pools
    # Every measurement's runner (its fit(): the Train controller is the runner's) ran, and none is
    # left (above). A runner sits on its caller's node: the pool's (the head) for a reused group,
    # the Tune trainable's for a trial that launches its own workers, which may be a worker node.
    assert ray_list(cluster, "actors", "class_name=FitRunner")
