"""MLflow as a real server: `mlflow server` on 127.0.0.1 (its own SQLite store and artifact root),
started by this module; the sweep and SweepTracker talk to it over HTTP. Each trial is found once
(one child run per trial under the sweep's parent): after a real sweep whose two trials run side
by side, when two threads log at the same instant, and when the server errors or drops answers."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from paratune.config.plan import load_plan_dict
from paratune.sweep.space import load_space
from paratune.sweep.ledger import Ledger, LedgerEntry
from paratune.sweep.driver import run_sweep
from paratune.sweep.callbacks import LedgerCallback
from paratune.out.tracking import SweepTracker, trial_metrics
from paratune.cluster.trial import TrialResult

from conftest import BASE_PLAN
from procs import free_port, stop_group

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
# One worker per trial: the 2-CPU cluster runs two trials at once (paratune.sweep.cluster.concurrency).
FIXED = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 1, "warmup_steps": 1,
         "measure_steps": 2, "profile_comm": False, "lr": 0.01, "trial_timeout_s": 300}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` on a free port; its URL. Stopped (the whole process group) whatever happens."""
    tmp = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # as `paratune ui`: no job runner
    log = tmp / "server.log"
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
         "--serve-artifacts", "--artifacts-destination", str(tmp / "artifacts")],
        cwd=tmp, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not come up (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        stop_group(proc, grace_s=15)
        proc.wait(timeout=15)


def _children(client: MlflowClient, parent_id: str) -> list:
    experiment = client.get_run(parent_id).info.experiment_id
    return client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_id}'", max_results=1000)


def _by_trial(runs) -> dict[tuple[str, int], list]:
    out: dict[tuple[str, int], list] = {}
    for run in runs:
        tags = run.data.tags
        out.setdefault((tags["paratune.phase"], int(tags["paratune.trial_number"])), []).append(run)
    return out


def _assert_each_trial_once(client: MlflowClient, parent_id: str, entries: list[LedgerEntry]) -> dict:
    """Exactly one child run per ledger entry (no other child), logged completely, holding the
    trial's plan, status and figures. Returns (phase, number) -> run."""
    runs = _by_trial(_children(client, parent_id))
    assert {k: len(v) for k, v in runs.items()} == {(e.phase, e.number): 1 for e in entries}
    found = {}
    for e in entries:
        run = runs[(e.phase, e.number)][0]
        result, data = e.result, run.data
        assert data.tags["paratune.logged"] == "1" and data.tags["paratune.status"] == result.status
        assert run.info.status == ("FINISHED" if result.ok else "KILLED" if result.stopped_early else "FAILED")
        assert data.params["status"] == result.status
        assert data.params["micro_batch"] == str(result.plan["micro_batch"])
        assert data.params["num_workers"] == str(result.plan["num_workers"])
        for name, value in trial_metrics(result).items():
            assert data.metrics[name] == pytest.approx(value), name
        history = client.get_metric_history(run.info.run_id, "loss")
        assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(result.losses)
        found[(e.phase, e.number)] = run
    return found


# --------------------------------------------------------------------------- a real sweep
# `e2e` (make test-e2e): `make test` keeps every trial logged once through this server under races and
# errors (the tests below) and a sweep on Ray logged to an MLflow store (test_sweep).
@pytest.mark.e2e
def test_a_sweep_logs_through_the_server_each_of_two_concurrent_trials_once(ray_local, server, faulty, tmp_path,
                                                                           monkeypatch, capsys):
    """Two plans, grid, one worker each: Tune runs both trials at once on the 2-CPU cluster. The
    server then holds one parent for the sweep and one child per ledger entry. The server is down
    (past MLflow's retries) while the first trial is logged: the sweep goes on, says so, and logs
    that trial at its end, once."""
    space_path = tmp_path / "served.yaml"
    space_path.write_text(yaml.safe_dump({
        "name": "served", "fixed": FIXED, "space": {"strategy": {"ddp": {}}, "micro_batch": [2, 4]},
        "search": {"algorithm": "grid", "trials": 2, "reuse_workers": False, "top_k": 1, "remeasure_rounds": 0}}))
    space = load_space(space_path)

    # When the driver saw each trial start and finish (Tune calls its callbacks on one thread).
    seen: dict[str, dict[str, float]] = {}
    complete = LedgerCallback.on_trial_complete

    def on_trial_start(self, iteration, trials, trial, **info):
        seen.setdefault(trial.trial_id, {})["start"] = time.time()

    def on_trial_complete(self, iteration, trials, trial, **info):
        seen.setdefault(trial.trial_id, {})["end"] = time.time()
        return complete(self, iteration, trials, trial, **info)

    monkeypatch.setattr(LedgerCallback, "on_trial_start", on_trial_start, raising=False)
    monkeypatch.setattr(LedgerCallback, "on_trial_complete", on_trial_complete)

    # Through the faulty proxy: the first trial's last write ("paratune.logged") fails 3 times,
    # MLflow's 1 + 2 retries (the `faulty` fixture); the start of the sweep sets no tag.
    proxied = f"http://127.0.0.1:{faulty.server_address[1]}"
    faulty.fail("/runs/set-tag", "503", times=3)
    out = tmp_path / "sweep"
    report = run_sweep(space, out, tracking_uri=proxied, report_page=False)
    said = capsys.readouterr().out
    assert [how for _, how in faulty.seen].count("503") == 3, faulty.seen
    assert "MLflow: search trial 1 not logged" in said and "logged 1 trial(s) to MLflow that it missed" in said, said

    entries = Ledger(out / "ledger.jsonl").entries
    assert sorted(e.result.plan["micro_batch"] for e in entries) == [2, 4]
    assert [e.number for e in entries] == [1, 2] and all(e.phase == "search" and e.result.ok for e in entries)

    # Side by side: each trial ran for wall_s between its start and its end as the driver saw them;
    # one after the other they would need the sum of both, more than the span they had.
    assert len(seen) == 2 and all(set(s) == {"start", "end"} for s in seen.values()), seen
    span = max(s["end"] for s in seen.values()) - min(s["start"] for s in seen.values())
    walls = [e.result.wall_s for e in entries]
    assert sum(walls) > span, f"trials did not overlap: wall times {walls} within {span:.1f} s"
    ends = sorted(s["end"] for s in seen.values())
    assert ends[1] - ends[0] < min(walls), f"finished {ends[1] - ends[0]:.1f} s apart"

    client = MlflowClient(server)  # through the server, not the SQLite file
    experiment = client.get_run(report.parent_run_id).info.experiment_id
    parents = client.search_runs([experiment], "tags.`paratune.kind` = 'sweep' and tags.`paratune.space` = 'served'")
    assert [p.info.run_id for p in parents] == [report.parent_run_id]
    assert json.loads((out / "sweep.json").read_text())["tracking_uri"] == proxied
    _assert_each_trial_once(client, report.parent_run_id, entries)
    parent = client.get_run(report.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["fixed.num_workers"] == "1"
    assert {a.path for a in client.list_artifacts(report.parent_run_id)} >= {"space", "winner"}  # via the server


# --------------------------------------------------------------------------- two at one instant
def _result(micro_batch: int, status: str = "ok") -> TrialResult:
    plan = load_plan_dict({**BASE_PLAN, "micro_batch": micro_batch}).to_dict()
    if status == "failed":
        return TrialResult.failed(plan, "oom", "CUDA out of memory (simulated)", wall_s=3.0)
    return TrialResult(status=status, plan=plan, world_size=2, tokens_per_s_per_gpu=1000.0 * micro_batch,
                       step_time_median_s=0.1, losses=[3.0, 2.5, 2.0], step_times_s=[0.1, 0.12],
                       wall_s=9.0, peak_memory_bytes=[2**30, 2**30],
                       message="after 2 of 3 measured steps" if status == "stopped_early" else None)


def _at_once(*calls):
    """Run the calls in threads that all start at one instant (a barrier); their results, in
    order. Re-raises the first exception."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            results[i] = err

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_two_trials_finishing_at_the_same_instant_are_each_logged_once(server):
    tracker = SweepTracker(server, experiment="at-once")
    client = MlflowClient(server)
    entries = [LedgerEntry(1, "a", _result(4)), LedgerEntry(2, "b", _result(2, "stopped_early")),
               LedgerEntry(3, "c", _result(1, "failed"))]

    # Two different trials, logged by two threads at one instant.
    parent = tracker.start_parent("at-once", None, {}, {})
    ids = _at_once(*[lambda e=e: tracker.log_trial(parent, e.number, e.result) for e in entries[:2]])
    runs = _assert_each_trial_once(client, parent, entries[:2])
    assert ids == [runs[("search", 1)].info.run_id, runs[("search", 2)].info.run_id]

    # Again, each of them, while a resume syncs the ledger (which also holds trial 3): nothing twice.
    again = _at_once(lambda: tracker.log_trial(parent, 1, entries[0].result),
                     lambda: tracker.log_trial(parent, 2, entries[1].result),
                     lambda: tracker.sync_ledger(parent, entries))
    assert again == [*ids, 1]
    _assert_each_trial_once(client, parent, entries)
    assert tracker.sync_ledger(parent, entries) == 0

    # A trial no one has logged yet, by the callback and a resume at one instant: still once.
    parent = tracker.start_parent("at-once-2", None, {}, {})
    first, filled = _at_once(lambda: tracker.log_trial(parent, 1, entries[0].result),
                             lambda: tracker.sync_ledger(parent, entries[:1]))
    assert filled in (0, 1)
    assert _assert_each_trial_once(client, parent, entries[:1])[("search", 1)].info.run_id == first


def test_a_trial_is_kept_when_another_finishes_while_it_is_being_logged(server):
    """Trial 1's run is created but not yet complete when trial 2 finishes: logging trial 2 must
    neither drop trial 1's run (it looks like a killed driver's partial run) nor log it twice."""
    tracker = SweepTracker(server, experiment="overlap")
    client = MlflowClient(server)
    entries = [LedgerEntry(1, "a", _result(4)), LedgerEntry(2, "b", _result(2))]
    parent = tracker.start_parent("overlap", None, {}, {})
    created, second_started = threading.Event(), threading.Event()
    log_batch = tracker.client.log_batch

    def slow_first_log_batch(run_id, *args, **kwargs):
        if threading.current_thread().name == "trial-1" and not created.is_set():
            created.set()  # trial 1's run exists, incomplete: let trial 2 in while it is
            second_started.wait(timeout=5)
            time.sleep(1.0)  # a slow server: trial 2's logging has all the time it needs
        return log_batch(run_id, *args, **kwargs)

    tracker.client.log_batch = slow_first_log_batch
    results: dict[int, object] = {}

    def log(entry: LedgerEntry) -> None:
        try:
            results[entry.number] = tracker.log_trial(parent, entry.number, entry.result)
        except Exception as err:  # noqa: BLE001 - checked below
            results[entry.number] = err

    first = threading.Thread(target=log, args=(entries[0],), name="trial-1")
    first.start()
    assert created.wait(timeout=60)
    second = threading.Thread(target=log, args=(entries[1],), name="trial-2")
    second.start()
    second_started.set()
    first.join(timeout=120)
    second.join(timeout=120)
    assert not any(isinstance(r, Exception) for r in results.values()), results
    runs = _assert_each_trial_once(client, parent, entries)
    assert results == {n: runs[("search", n)].info.run_id for n in (1, 2)}


# --------------------------------------------------------------------------- server faults
class _FaultyProxy(ThreadingHTTPServer):
    """A reverse proxy in front of the server that can answer 503 for it, or pass a request on
    and lose the answer (the connection closes with no response), for chosen endpoints."""

    daemon_threads = True

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.faults: list[list] = []  # [endpoint suffix, "503" | "lose_answer", times left]
        self.seen: list[tuple[str, str]] = []  # (endpoint, what happened)
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    def fail(self, endpoint: str, how: str, times: int = 1) -> None:
        with self.lock:
            self.faults.append([endpoint, how, times])

    def heal(self) -> None:
        with self.lock:
            self.faults.clear()

    def fault_for(self, path: str) -> str | None:
        with self.lock:
            for fault in self.faults:
                if path.split("?")[0].endswith(fault[0]) and fault[2] > 0:
                    fault[2] -= 1
                    return fault[1]
        return None


class _ProxyHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        how = self.server.fault_for(self.path)
        self.server.seen.append((self.path.split("?")[0], how or "ok"))
        if how == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "content-length")}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        if how == "lose_answer":  # done on the server, never heard of by the client
            self.close_connection = True
            return
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _forward


@pytest.fixture
def faulty(server, monkeypatch):
    # MLflow retries 5xx and lost answers itself (7 times, minutes of backoff by default): a few
    # quick ones here.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    proxy = _FaultyProxy(int(server.rsplit(":", 1)[1]))
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_server_errors_and_lost_answers_never_lose_or_double_a_trial(faulty, server):
    """What log_trial promises when the server fails: a brief outage (MLflow's own retries) costs
    nothing; an answer lost after the server acted leaves at most a partial run, which the next
    logging call drops; an outage that outlasts the retries raises (the ledger already holds the
    trial) and leaves a partial run that the resume's sync_ledger replaces with the trial, once."""
    url = f"http://127.0.0.1:{faulty.server_address[1]}"
    tracker = SweepTracker(url, experiment="faults")
    direct = MlflowClient(server)  # the truth, past the proxy
    entries = [LedgerEntry(1, "a", _result(4)), LedgerEntry(2, "b", _result(2)), LedgerEntry(3, "c", _result(1)),
               LedgerEntry(4, "d", _result(1, "failed"))]
    parent = tracker.start_parent("faults", None, {}, {})

    # Briefly unavailable: two 503s on the first write of trial 1, retried by the client.
    faulty.fail("/runs/log-batch", "503", times=2)
    run_1 = tracker.log_trial(parent, 1, entries[0].result)
    assert ("/api/2.0/mlflow/runs/log-batch", "503") in faulty.seen
    assert _assert_each_trial_once(direct, parent, entries[:1])[("search", 1)].info.run_id == run_1

    # The server creates trial 2's run but its answer is lost: the client's retry creates another.
    faulty.fail("/runs/create", "lose_answer")
    run_2 = tracker.log_trial(parent, 2, entries[1].result)
    assert ("/api/2.0/mlflow/runs/create", "lose_answer") in faulty.seen
    twos = _by_trial(_children(direct, parent))[("search", 2)]
    assert run_2 in {r.info.run_id for r in twos}
    assert all(r.data.tags.get("paratune.logged") != "1" for r in twos if r.info.run_id != run_2)  # partial only

    # Down for longer than the retries while trial 3 is being logged: log_trial raises.
    faulty.fail("/runs/set-tag", "503", times=100)
    with pytest.raises(MlflowException):
        tracker.log_trial(parent, 3, entries[2].result)
    threes = _by_trial(_children(direct, parent))[("search", 3)]
    assert [r.data.tags.get("paratune.logged") for r in threes] == [None]  # created, never marked complete

    # The server is back; the driver resumes from its ledger (which also holds trial 4).
    faulty.heal()
    assert tracker.sync_ledger(parent, entries) == 2
    runs = _assert_each_trial_once(direct, parent, entries)
    assert runs[("search", 1)].info.run_id == run_1 and runs[("search", 2)].info.run_id == run_2
    assert direct.get_run(threes[0].info.run_id).info.lifecycle_stage == "deleted"
    assert tracker.sync_ledger(parent, entries) == 0
