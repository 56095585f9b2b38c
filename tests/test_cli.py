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
    proc = subprocess.Popen([*PARATUNE, "ui", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
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
