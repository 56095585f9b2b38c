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
# ~125 CPU-seconds of C++ per fresh clone (two files), inside whichever test needs it first. It is
# built in a background process from the session's start instead, beside the tests, so that it is
# done by the time the first test needs it (a few minutes in). Not niced: with two test processes
# the CPUs are rarely idle, and a niced build starved until a test blocked on it (a test that
# takes ~20 s took 187 s). torch's build lock makes a test that needs the op wait for this build
# instead of starting another.
_CPU_ADAM_BUILD = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
_builder: subprocess.Popen | None = None


def pytest_collection_finish(session) -> None:
    """Start the build once: in the only pytest process, or in the first of pytest-xdist's workers
    (each collects every test)."""
    global _builder
    first_process = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first_process and any(item.get_closest_marker("integration") for item in session.items) and _builder is None:
        _builder = subprocess.Popen([sys.executable, "-c", _CPU_ADAM_BUILD],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules that start processes (integration) first, the quick unit modules after them. Under
    pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder) a worker takes the next
    module in this order when it is nearly done with its own, so the long modules (the cluster's
    job tests: ~5 min) start early and the short ones fill the end. (xdist's own order, by number
    of tests, started the job tests last, with one process idle for their last 2 minutes.)"""
    integration = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: item.path not in integration)  # stable: file order otherwise


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


def expected_parameter_share(plan) -> float:
    """Parameters one rank should hold under a plan: the model over tp and pp, and over the ranks
    FSDP2 shards across (the dp axis with cp folded in, or a hybrid shard group)."""
    from paratune.models import build_config, parameter_counts

    total = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
    sharded = plan.strategy == "fsdp" and plan.fsdp.sharding != "no_shard"
    shards = (plan.fsdp.shard_group_size or plan.dp_degree * plan.cp) if sharded else 1
    return total / (plan.tp * plan.pp * shards)
