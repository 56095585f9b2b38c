import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the gloo harness

BASE_PLAN = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 2,
             "warmup_steps": 1, "measure_steps": 2, "profile_comm": False,
             "lr": 1e-2}


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
