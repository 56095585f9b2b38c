import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the gloo harness

BASE_PLAN = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 2,
             "warmup_steps": 1, "measure_steps": 3, "profile_comm": False,
             "lr": 1e-2}


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """A real in-process Ray cluster with 2 CPUs, like this machine and CI."""
    import ray

    os.environ["PARATUNE_HOME"] = str(tmp_path_factory.mktemp("paratune_home"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
