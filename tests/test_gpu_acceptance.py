"""The GPU acceptance script smoke-runs on CPU (tiny model, gloo) as the lent GPU machine's image
would run it: Ray, MLflow and Optuna cannot be imported (tests/image_shaped), and transformers,
its hub and tokenizers are the image's versions (bench/gpu_image.txt, installed by `make install`
into .venv/gpu-image-site). Every family trains in bf16 with predictions beside the measurements
(the float8 one with torchao, as the carried wheel gives the image; the compiled one is not run on
CPU and says so), the oversized plan comes back `oom`, and the script says which versions it ran
under. Without torchao the float8 family says "torchao not importable" and the run goes on. On a GPU
the same script is the acceptance run (bench/results/gpu_acceptance.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gloo_harness import _free_port

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SHAPED = Path(__file__).parent / "image_shaped"  # its sitecustomize refuses ray, mlflow, optuna
IMAGE_SITE = Path(sys.prefix) / "gpu-image-site"  # the image's transformers (make install)
pytestmark = pytest.mark.integration


def _image_versions() -> dict[str, str]:
    pins = (ROOT / "bench" / "gpu_image.txt").read_text().splitlines()
    return dict(line.split("==") for line in pins if line and not line.startswith("#"))


# `e2e` (make test-e2e): `make test` keeps the worker path's imports as on the GPU image (below) and
# checkpointing and compile under the GPU image's transformers (test_recompute_compile's gpu-image case).
@pytest.mark.e2e
def test_acceptance_script_smoke_runs_as_on_the_gpu_image(tmp_path):
    assert (IMAGE_SITE / "transformers").is_dir(), f"{IMAGE_SITE} is missing: run `make install`"
    env = {**os.environ, "PARATUNE_ACCEPT_DIR": str(tmp_path), "PARATUNE_ACCEPT_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(IMAGE_SHAPED), str(IMAGE_SITE)])}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--no-single"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    machine = report["machine"]
    assert machine["transformers"] == _image_versions()["transformers"]  # the image's, not the venv's
    assert {machine[p] for p in ("ray", "mlflow", "optuna")} == {"not importable"}
    assert machine["deepspeed"] != "not importable" and machine["pydantic"] != "not importable"
    families = {r["family"]: r for r in report["families"]}
    assert set(families) == {"ddp", "fsdp-full", "zero-2", "zero-3", "zero-3-offload-cpu-adam",
                             "fsdp-full-compiled-selective", "fsdp-full-float8-tensorwise"}
    compiled = families.pop("fsdp-full-compiled-selective")  # a cold Inductor compile: not in the CPU smoke
    assert compiled["status"] == "skipped" and "not compiled in the CPU smoke run" in compiled["message"]
    assert report["not_checked"][0] == f"family fsdp-full-compiled-selective: {compiled['message']}"
    # What one GPU of the image cannot run, said plainly: ep (5.17 has no AllToAllEP), the multi-GPU layouts.
    assert "expert parallelism: transformers 5.17.0 has no transformers.distributed.expert_parallel" in \
        report["not_checked"][1] and "need 2 or more GPUs" in report["not_checked"][2]
    float8 = families["fsdp-full-float8-tensorwise"]
    assert float8["status"] == "ok", (float8.get("message"), float8.get("traceback"))
    assert set(float8["linear_matmul_dtypes"]) == {"float8_e4m3fn", "bfloat16"}, float8["linear_matmul_dtypes"]
    for name, row in families.items():
        assert row["status"] == "ok", (name, row.get("message"), row.get("traceback"))
        assert row["compute_dtype_ok"], (name, row["linear_matmul_dtypes"])
        assert row["tokens_per_s_per_gpu"] > 0 and row["predicted_memory_bytes"] > 0
        assert row["losses"][-1] < row["losses"][0], (name, row["losses"])
        # The cost model's prediction for this one-rank bf16 run (ZeRO's reduce bucket included:
        # it read -100% when the model counted the bucket only for dp > 1).
        assert abs(row["memory_error"]) <= 0.05, (name, row["peak_memory_bytes"], row["predicted_memory_bytes"])
    assert families["zero-3-offload-cpu-adam"]["optimizer_class"] == "DeepSpeedCPUAdam"
    assert families["zero-3"]["optimizer_class"] == "AdamW"  # torch's, the CPU parity path (auto on CPU)
    assert report["oversized"]["reason"] == "oom", report["oversized"]
    probe = report["comm_share_probe"]  # one rank: nothing a share could measure
    assert probe["world_size"] == 1 and probe["share_of_all_reduce_loop"] is None
    assert "not measurable on one rank" in probe["note"]
    assert report["failed"] == []
    text = (tmp_path / "gpu_acceptance.md").read_text()
    assert "| zero-3-offload-cpu-adam |" in text and "not measurable on one rank" in text
    assert "| fsdp-full-compiled-selective | | not checked: not compiled in the CPU smoke run" in text
    assert f"transformers {_image_versions()['transformers']}" in text and "ray not importable" in text
    assert "versions: python" in proc.stdout  # printed first, before any family runs


def test_the_float8_family_says_torchao_is_not_importable_and_is_not_run(monkeypatch):
    """As on the GPU image without the carried wheel: reported, skipped, not a failed check."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_acceptance

    for name in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ModuleNotFoundError
    row = gpu_acceptance.run_family("fsdp-full-float8-tensorwise", gpu_acceptance.FAMILIES["fsdp-full-float8-tensorwise"])
    assert row["status"] == "skipped" and row["message"].startswith("torchao not importable"), row
    assert gpu_acceptance.checks_failed([row], {"status": "ok"}, {"reason": "oom"}, None) == []


# What a worker imports (the acceptance run and the GPU bench import these without Ray): every
# module of the worker path, the model-parallel layouts the five families do not reach included.
WORKER_PATH = ["paratune.cluster.trial", "paratune.trial.worker", "paratune.trial.placement", "paratune.costs.measure", "paratune.trial.failures", "paratune.config.plan",
               "paratune.config.data", "paratune.model.build", "paratune.model.materialize", "paratune.trial.precision",
               "paratune.sweep.parity", "paratune.checks.preflight", "paratune.costs.estimate", "paratune.config.devices", "paratune.model.shapes",
               "paratune.costs.activations", "paratune.costs.memory", "paratune.trial.results", "paratune.cluster.launch",
               "paratune.parallel", "paratune.parallel.runner",
               "paratune.parallel.ddp", "paratune.parallel.fsdp", "paratune.parallel.zero", "paratune.parallel.tp",
               "paratune.parallel.pp", "paratune.parallel.cp", "paratune.parallel.nd", "paratune.parallel.dims",
               "paratune.parallel.float8"]


def test_the_worker_path_imports_without_ray_mlflow_or_optuna():
    code = ("import importlib, sys\n"
            f"for name in {WORKER_PATH!r}:\n"
            "    importlib.import_module(name)\n"
            "try:\n    import ray\nexcept ModuleNotFoundError:\n    print('ray refused')\n"
            "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('ray', 'mlflow', 'optuna')))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(IMAGE_SHAPED), str(ROOT / "platform")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["ray refused", "[]"], proc.stdout
