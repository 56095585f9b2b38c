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
    assert "fsdp.sharding: got 'half'" in done.stdout and "'full', 'grad_op', 'hybrid' or 'no_shard'" in done.stdout
    good = _run("validate", "plans/cpu_ddp.yaml")
    assert good.returncode == 0 and "grad_accum: 2" in good.stdout


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


@pytest.mark.integration
def test_ui_serves_the_store_on_localhost(tmp_path):
    port = _free_port()
    # One server process instead of MLflow's default four (each imports MLflow's server on this
    # 2-core machine): what is tested is paratune's `ui` (store, host, port), not uvicorn's pool.
    env = {**os.environ, "MLFLOW_WORKERS": "1"}
    proc = subprocess.Popen([*PARATUNE, "ui", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--port", str(port)],
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
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


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
