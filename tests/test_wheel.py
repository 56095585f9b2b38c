"""paratune as a library: the built wheel, installed core-only (no extra) into a clean virtual environment
in a temporary folder, used from a folder with no checkout around it.

The wheel carries the presets, the shipped spaces and the job entry point (`python -m paratune`: what
`ray job submit ... -- python -m paratune tune <space>` runs where paratune is installed in the
cluster's image); `paratune plan` takes a shipped space by name, a CPU trial runs, and a ZeRO plan is
refused naming `paratune[deepspeed]`. Ray is constraints.txt's (the newest supported); the oldest
supported Ray runs the same install, a trial and a two-trial sweep in `.ci/run` (.ci/oldest_ray.sh).

The environment: uv (pinned in constraints.txt, in the dev venv), torch as the dev venv's build found
through the machine's pip find-links (PIP_FIND_LINKS, else pip's config; constraints.txt's note: a bare torch pin could
resolve to a multi-GB CUDA build), the rest from the index or uv's cache.
"""

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# `e2e` (make test-e2e): `make test` keeps the core install's refusals without the extras (test_extras)
# and a trial on Ray from the checkout (test_session).
pytestmark = [pytest.mark.integration, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.executable).parent / "uv"
DDP = """model: tiny-llama
seq_len: 32
global_batch: 8
micro_batch: 2
num_workers: 2
strategy: ddp
warmup_steps: 1
measure_steps: 2
profile_comm: false
track_memory: false
"""


def _run(*cmd, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done


def _said(done: subprocess.CompletedProcess) -> str:
    return " ".join((done.stdout + done.stderr).split())  # rich wraps lines outside a terminal


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(the wheel, the venv's bin folder, an env for its commands, an empty working folder)."""
    assert UV.exists(), f"{UV}: uv is part of the development environment (constraints.txt; make install)"
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    built = _run(UV, "build", "-q", "--out-dir", dist, ROOT)  # the sdist, then the wheel from it (python -m build's way)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = dist.glob("paratune-*.whl")
    venv = base / "venv"
    made = _run(UV, "venv", "-q", venv, "--python", sys._base_executable)
    assert made.returncode == 0, made.stderr[-2000:]
    constraints = base / "constraints.txt"
    constraints.write_text("".join(line for line in (ROOT / "constraints.txt").read_text().splitlines(True)
                                   if not line.startswith("torch==")))
    found = os.environ.get("PIP_FIND_LINKS") or _run(sys.executable, "-m", "pip", "config", "get", "global.find-links").stdout
    links = [arg for link in found.split() for arg in ("--find-links", link)]  # pip's, where make install finds torch
    torch = f"torch=={importlib.metadata.version('torch')}"  # the dev venv's build (the CPU one here)
    installed = _run(UV, "pip", "install", "-q", "--python", venv / "bin" / "python", *links, "-c", constraints,
                     torch, wheel)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONDONTWRITEBYTECODE", "MLFLOW_TRACKING_URI")
           and not k.startswith("PARATUNE_")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PARATUNE_HOME=str(base / "home"))
    work = base / "work"
    work.mkdir()
    return wheel, venv / "bin", env, work


def test_the_wheel_carries_the_presets_the_shipped_spaces_and_the_entry_points(wheel_env):
    from paratune.config.model_config import PRESET_DIR
    from paratune.sweep.space import shipped_spaces

    wheel, *_ = wheel_env
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"paratune/spaces/{name}.yaml" for name in shipped_spaces()} <= names
    assert {f"paratune/presets/{p.name}" for p in PRESET_DIR.glob("*.json")} <= names  # models, devices, bands
    assert {"paratune/__main__.py", "paratune/presets/devices.json", "paratune/cli.py"} <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "paratune = paratune.cli:main" in entry_points
    assert not [n for n in names if n.startswith(("tests/", "search_spaces/", "bench/"))]


def test_a_core_install_outside_the_checkout_plans_a_shipped_space_and_runs_a_cpu_trial(wheel_env):
    wheel, bin_dir, env, work = wheel_env
    where = _run(bin_dir / "python", "-c", "import paratune, ray; print(paratune.__file__, ray.__version__)",
                 cwd=work, env=env)
    assert where.returncode == 0 and where.stdout.startswith(str(bin_dir.parent)), where.stdout + where.stderr
    listed = _run(bin_dir / "python", "-m", "paratune", "spaces", cwd=work, env=env)  # the job entry point's form
    assert listed.returncode == 0 and "local_cpu" in listed.stdout and "deepspeed (not installed)" in _said(listed)
    planned = _run(bin_dir / "paratune", "plan", "local_cpu", cwd=work, env=env)
    assert planned.returncode == 0, _said(planned)[-3000:]
    assert "24 x strategy: 'zero' needs DeepSpeed, which is not installed" in _said(planned)
    (work / "zero.yaml").write_text(DDP.replace("strategy: ddp", "strategy: zero"))
    refused = _run(bin_dir / "paratune", "validate", "zero.yaml", cwd=work, env=env)
    assert refused.returncode == 2 and "install it with pip install 'paratune[deepspeed]'" in _said(refused)
    (work / "ddp.yaml").write_text(DDP)
    trial = _run(bin_dir / "paratune", "trial", "ddp.yaml", cwd=work, env=env)
    assert trial.returncode == 0 and "ddp: ok" in _said(trial), _said(trial)[-4000:]
