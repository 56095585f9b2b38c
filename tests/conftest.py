import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the gloo harness

# No memory-tracked extra step (track_memory): the tests that check memory figures ask for it.
BASE_PLAN = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 2,
             "warmup_steps": 1, "measure_steps": 2, "profile_comm": False, "track_memory": False,
             "lr": 1e-2}

# DeepSpeed's CPU Adam (what ZeRO offload steps with on GPU clusters) is JIT-compiled at first use:
# ~125 CPU-seconds of C++ per venv (two files), inside whichever test needs it first. `make install`
# builds it (and leaves .cpu_adam_built in the venv). Without that, it is built from the session's
# start by a niced background process: it takes the CPU the tests leave idle, and a test that needs
# the op before it is done waits on torch's build lock (its process idle, the build then has that
# core) instead of starting another build.
_CPU_ADAM_BUILD = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
_builder: subprocess.Popen | None = None


def pytest_collection_finish(session) -> None:
    """Record the tiers this session runs (tests/tiers.py: batches leave out the cases no selected
    test reads). Start the build once: in the only pytest process, or in the first of pytest-xdist's
    workers (each collects every test)."""
    global _builder
    import tiers

    tiers.SELECTED = {"matrix" if item.get_closest_marker("matrix") else "core" for item in session.items}
    first_process = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    built = (Path(sys.prefix) / ".cpu_adam_built").exists()
    wanted = not (built or session.config.option.collectonly) and any(item.get_closest_marker("integration") for item in session.items)
    if first_process and wanted and _builder is None:
        _builder = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", _CPU_ADAM_BUILD],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# The modules whose tests start Ray: the in-process cluster (ray_local), `ray start` raylets, the
# `paratune` command's own Ray. test_wheel.py: the installed wheel's `paratune trial` starts a Ray of
# its own. Under pytest-xdist (`make test TEST_WORKERS=2`) they go first, the three-raylet job tests
# (the longest module) first of all, so that the short unit and gloo modules fill the other process
# at the end. Each module is one scope (its fixtures stay in one process); two Ray modules may run
# at once, each process with its own in-process Ray (bench/results/test_suite_time.md, 2026-12-07:
# the 2 cores 93% busy, 26 min 11 s against one process's 27 min 55 s).
RAY_MODULES = ["test_cli.py", "test_cluster_config.py", "test_cluster_jobs.py", "test_newcomer.py", "test_profile.py",
               "test_ray_range.py", "test_session.py", "test_sweep.py", "test_tracking_server.py", "test_trial_ray.py",
               "test_user_loop.py", "test_wheel.py"]
LONGEST_MODULE = "test_cluster_jobs.py"


def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist, the job tests, then the other Ray modules, then the rest; file order otherwise."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: (item.path.name != LONGEST_MODULE, item.path.name not in RAY_MODULES))  # stable


def pytest_sessionfinish(session) -> None:
    """Let an unfinished build end (a killed one would leave torch's lock file, and every later
    use of the op would wait on it forever)."""
    if _builder is not None:
        _builder.wait()


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """A real in-process Ray cluster with 2 CPUs, like this machine and CI."""
    import ray

    os.environ["PARATUNE_HOME"] = str(tmp_path_factory.mktemp("paratune_home"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory) -> Path:
    """One empty MLflow SQLite store, schema made: a new store runs MLflow's migrations (~5 s of
    CPU), so each test copies this file instead (`mlflow_uri`)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, empty_mlflow_store) -> str:
    """A fresh MLflow store of this test's own (tmp_path/mlflow.db), as a tracking URI."""
    db = tmp_path / "mlflow.db"
    shutil.copyfile(empty_mlflow_store, db)
    return f"sqlite:///{db}"


def resources_released(ray) -> None:
    """Nothing holds the in-process cluster after a failure: both CPUs free again, no live placement
    group (the next trial or group would otherwise wait for CPUs, then time out)."""
    import time

    from ray.util import placement_group_table

    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= 2
    live = [pg for pg in placement_group_table().values() if pg["state"] in ("CREATED", "PENDING", "RESCHEDULING")]
    assert not live, live


def ray_actor_processes(*classes: str, settle_s: float = 30.0, besides: dict[int, str] | None = None) -> dict[int, str]:
    """Live processes of this machine that Ray titled as an actor of one of `classes` (`ray::Class`,
    `ray::Class.method` while it runs one), but those in `besides` (e.g. what an earlier module left):
    pid -> title. Waits up to `settle_s` for them to go, since an actor whose last handle was dropped
    ends a moment later (~1.2 s here)."""
    import time

    deadline = time.time() + settle_s
    while True:
        found = {}
        for entry in Path("/proc").iterdir():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, ValueError):
                continue
            if title.startswith("ray::") and title[5:].split(".")[0].split()[0] in classes \
                    and int(entry.name) not in (besides or {}):
                found[int(entry.name)] = title
        if not found or time.time() > deadline:
            return found
        time.sleep(0.5)


def expected_parameter_share(plan) -> float:
    """Parameters one rank should hold under a plan: the model over tp and pp, and over the ranks
    FSDP2 shards across (the dp axis with cp folded in, or a hybrid shard group)."""
    from paratune.model.build import build_config, parameter_counts

    total = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
    sharded = plan.strategy == "fsdp" and plan.fsdp.sharding != "no_shard"
    shards = (plan.fsdp.shard_group_size or plan.dp_degree * plan.cp) if sharded else 1
    return total / (plan.tp * plan.pp * shards)


def traced_as_real(mode: str):
    """tiny-llama's activations traced on fake tensors under checkpointing `mode` (the runtime's
    own policy), checked equal to the same micro-batch on real tensors at every phase; returns the
    traced coefficients (paratune.costs.activations)."""
    import pytest

    from paratune.costs.activations import _trace_micro_batch, _traced_coefficients
    from paratune.model.build import build_config, config_from_key, config_key

    key = config_key(build_config("tiny-llama"))
    traced = _traced_coefficients(key, mode, "fp32", 2, 64)
    _, real, _ = _trace_micro_batch(config_from_key(key), 128, mode, "fp32", sequences=2, fake=False)
    for phase, peak in real.items():
        if phase in traced.phases:
            assert sum(traced.phases[phase].at(128, 2)) == pytest.approx(peak, abs=64), phase
    return traced

