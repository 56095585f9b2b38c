"""The GPU acceptance script smoke-runs on CPU (tiny model, gloo): every family trains, in bf16,
with predictions beside the measurements, and the oversized plan comes back `oom`. On a GPU the
same script is the acceptance run (bench/results/gpu_acceptance.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gloo_harness import _free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_acceptance_script_smoke_runs_on_cpu(tmp_path):
    env = {**os.environ, "PARATUNE_ACCEPT_DIR": str(tmp_path), "PARATUNE_ACCEPT_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--no-single"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    families = {r["family"]: r for r in report["families"]}
    assert set(families) == {"ddp", "fsdp-full", "zero-2", "zero-3", "zero-3-offload-cpu-adam"}
    for name, row in families.items():
        assert row["status"] == "ok", (name, row.get("message"), row.get("traceback"))
        assert row["compute_dtype_ok"], (name, row["linear_matmul_dtypes"])
        assert row["tokens_per_s_per_gpu"] > 0 and row["predicted_memory_bytes"] > 0
        assert row["losses"][-1] < row["losses"][0], (name, row["losses"])
    assert families["zero-3-offload-cpu-adam"]["optimizer_class"] == "DeepSpeedCPUAdam"
    assert families["zero-3"]["optimizer_class"] == "AdamW"  # torch's, the CPU parity path (auto on CPU)
    assert report["oversized"]["reason"] == "oom", report["oversized"]
    assert 0 < report["comm_share_probe"]["share_of_all_reduce_loop"] <= 1
    assert "| zero-3-offload-cpu-adam |" in (tmp_path / "gpu_acceptance.md").read_text()
