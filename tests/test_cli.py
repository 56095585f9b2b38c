"""The command line: clear errors for bad input, and the MLflow UI on 127.0.0.1."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

PARATUNE = [str(Path(sys.executable).parent / "paratune")]


def _run(*args, cwd=None):
    return subprocess.run([*PARATUNE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_validate_reports_field_value_and_allowed(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("strategy: fsdp\nfsdp: {sharding: half}\n")
    done = _run("validate", str(plan))
    assert done.returncode == 2
    said = " ".join(done.stdout.split())  # rich wraps at 80 columns outside a terminal: where depends on the path
    assert "fsdp.sharding: got 'half'" in said and "'full', 'grad_op', 'hybrid' or 'no_shard'" in said
    good = _run("validate", "plans/cpu_ddp.yaml")
    assert good.returncode == 0 and "grad_accum: 2" in good.stdout


def test_models_lists_every_preset_whatever_its_family(capsys):
    """GPT-NeoX and OPT configs have no num_key_value_heads (no GQA): their heads are their KV heads."""
    from paratune.cli import main
    from paratune.config.model_config import preset_names

    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    assert all(f"│ {name} " in listed for name in preset_names()), listed
    row = next(line for line in listed.splitlines() if "│ tiny-gptneox " in line)
    assert "│ 4/4 " in row  # tiny-gptneox: 4 heads, each its own KV head


@pytest.mark.integration  # the `paratune` command in its own process
def test_tune_rejects_a_bad_space_before_starting_anything(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("name: x\nspace: {strategy: {zero: {stag: [1]}}}\n")
    done = _run("tune", str(space), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "zero.stag: unknown knob; allowed: stage" in done.stdout
    assert not (tmp_path / "out").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_cmdlines(sid: int) -> list[list[str]]:
    """The command lines of every process in session `sid` (the UI and what it spawned)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
                out.append((stat.parent / "cmdline").read_bytes().decode().split("\0")[:-1])
        except (OSError, IndexError, ValueError):
            continue
    return out


# `e2e` (make test-e2e): `make test` keeps MLflow as a real server (test_tracking_server's race and
# error tests) and a `paratune` command run as a user runs it (test_a_command_says_its_own_first_line).
@pytest.mark.integration
@pytest.mark.e2e
def test_ui_serves_the_store_on_localhost_with_one_worker(tmp_path, mlflow_uri):
    """`paratune ui` itself asks MLflow for one server worker (uvicorn, not MLflow's default pool of
    four): the environment carries no MLFLOW_WORKERS. It prints the link to the sweeps' runs."""
    from paratune.out.tracking import SweepTracker

    uri = mlflow_uri
    experiment = SweepTracker(uri).experiment_id
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_WORKERS"}
    proc = subprocess.Popen([*PARATUNE, "ui", "--tracking-uri", uri, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        deadline = time.time() + 90
        status = None
        while time.time() < deadline and status != 200:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
            except OSError:
                time.sleep(1)
        assert status == 200
        servers = [c for c in _session_cmdlines(proc.pid) if any(Path(a).name == "uvicorn" for a in c[:3])]
        assert len(servers) == 1 and "--workers" in servers[0], _session_cmdlines(proc.pid)
        assert servers[0][servers[0].index("--workers") + 1] == "1"
        # uvicorn forks no worker pool for one worker: the server is the only python left but MLflow's CLI.
        spawned = [c for c in _session_cmdlines(proc.pid) if any("multiprocessing" in a for a in c)]
        assert spawned == [], spawned
    finally:
        os.killpg(proc.pid, 15)
        out = proc.communicate(timeout=30)[0]
    assert f"#/experiments/{experiment}/runs?workflowType=machine_learning" in out, out


@pytest.mark.integration  # the `paratune` command in its own process
def test_trial_with_bad_plans_records_each_failure_and_never_crashes(tmp_path):
    """A broken plan file and a model that cannot be built are failed rows with their reasons,
    written to the JSON as they come; no traceback, exit code 1 (not every plan ran)."""
    import json

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "pad_token_id": 600}
    (tmp_path / "config.json").write_text(json.dumps(config))  # pad token outside the vocabulary
    (tmp_path / "bad_model.yaml").write_text(f"model: {tmp_path / 'config.json'}\nnum_workers: 2\n")
    (tmp_path / "bad_plan.yaml").write_text("model: tiny-llama\nmicro_batch: 3\nglobal_batch: 8\n")
    out = tmp_path / "results.json"
    proc = _run("trial", str(tmp_path / "bad_plan.yaml"), str(tmp_path / "bad_model.yaml"), "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert rows["bad_plan"]["reason"] == "invalid_config" and "global_batch" in rows["bad_plan"]["message"]
    assert rows["bad_model"]["reason"] == "invalid_config" and "bad_model" in proc.stdout


@pytest.mark.integration  # the `paratune` command in its own process
def test_report_rewrites_a_sweeps_report_and_logs_it_to_its_parent_run(tmp_path, mlflow_uri):
    """`paratune report SWEEP_DIR` from the folder alone (ledger, sweep.json): the page, its path
    printed, and a copy under the parent run's "report" artifacts when the store is there."""
    import json

    from paratune.config.plan import load_plan_dict
    from paratune.sweep.ledger import Ledger, LedgerEntry
    from paratune.out.tracking import SweepTracker
    from paratune.cluster.trial import TrialResult

    from conftest import BASE_PLAN

    uri = mlflow_uri
    tracker = SweepTracker(uri)
    parent = tracker.start_parent("s", None, {}, {})
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"tracking_uri": uri, "parent_run_id": parent}))
    plan = load_plan_dict(BASE_PLAN).to_dict()
    Ledger(sweep / "ledger.jsonl").append(LedgerEntry(1, "k1", TrialResult(
        status="ok", plan=plan, world_size=2, tokens_per_s_per_gpu=100.0, losses=[3.0, 2.0], step_times_s=[0.1, 0.1],
        peak_memory_bytes=[2**28, 2**28], wall_s=5.0, started_at=1.7e9)))
    done = _run("report", str(sweep))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"sweep report: {sweep / 'report' / 'report.html'}" in done.stdout
    assert "report/report.html" in {a.path for a in tracker.client.list_artifacts(parent, "report")}
    assert _run("report", str(tmp_path / "nothing")).returncode == 2


def test_a_command_says_its_own_first_line(tmp_path):
    """Day one is quiet: no third-party line before paratune's own. `models` builds every preset
    (transformers imports torchao, whose wheel warns about C++ extensions it cannot load, and torch
    about torchao's pytree Enums); the filters are paratune.config.quiet's, by cause."""
    import logging

    from paratune.config.quiet import DeepSpeedCpuNotice, RayTokenAuthNotice, TorchaoImportNoise

    proc = subprocess.run([str(Path(sys.executable).parent / "paratune"), "models"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip() == "", proc.stderr[:2000]
    assert proc.stdout.lstrip().startswith("model presets"), proc.stdout[:300]

    def kept(f: logging.Filter, message: str) -> bool:
        return f.filter(logging.LogRecord("x", logging.WARNING, __file__, 1, message, None, None))

    notice = RayTokenAuthNotice()
    assert not kept(notice, "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    assert kept(notice, "Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert not kept(TorchaoImportNoise(), "Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: y")
    cpu_notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    import torch

    assert kept(DeepSpeedCpuNotice(), cpu_notice) is torch.cuda.is_available()  # kept where a GPU was missed


def test_plan_says_which_zero_buffers_to_size_for_a_small_model(tmp_path, capsys):
    """DeepSpeed's default buckets (5e8 elements) outweigh a tiny model's own states many times: a
    space that leaves them unset is told which fields to set, with a size that scales with the
    model; one that sets them is not."""
    import yaml

    from paratune import cli

    space = {"name": "z", "fixed": {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "seq_len": 32,
                                    "device": "cpu"},
             "space": {"strategy": {"zero": {"stage": [2]}}, "micro_batch": [2]}}
    path = tmp_path / "z.yaml"
    path.write_text(yaml.safe_dump(space))
    assert cli.main(["plan", str(path), "--formula"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "device: cpu (the space's device;" in out
    assert "Set zero.reduce_bucket_size and zero.allgather_bucket_size in the space (e.g. 4e3" in out, out
    space["space"]["strategy"]["zero"]["reduce_bucket_size"] = [4096]
    path.write_text(yaml.safe_dump(space))
    assert cli.main(["plan", str(path), "--formula"]) == 0
    assert "zero.reduce_bucket_size" not in capsys.readouterr().out
