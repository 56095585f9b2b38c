"""paratune.launch: the Ray version its private overrides mirror, and the trainers it assembles.

The timed trainer overrides two private TorchTrainer methods as Ray 2.60 writes them; another Ray
may have changed them, so any other release is refused by name before a trainer is built."""

import re
from pathlib import Path

import pytest

from paratune.launch import MIRRORED_RAY_VERSION, RayVersionError, check_ray_version

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("installed", ["2.60.0", "2.60.3", "2.60.0rc1", "2.60.1.dev0"])
def test_the_mirrored_release_and_its_patches_pass(installed):
    check_ray_version(installed)


@pytest.mark.parametrize("installed", ["2.61.0", "2.59.1", "3.0.0", "2.6.0", "2.600.0", "nightly", ""])
def test_another_ray_is_refused_naming_the_installed_and_the_mirrored_version(installed):
    with pytest.raises(RayVersionError) as refused:
        check_ray_version(installed)
    message = str(refused.value)
    assert f"installed {installed!r}" in message and f"Ray {MIRRORED_RAY_VERSION}" in message
    assert "_initialize_and_run_controller" in message and f"allowed: ray {MIRRORED_RAY_VERSION}.x" in message


def test_the_installed_ray_and_pyproject_allow_only_the_mirrored_release():
    import ray

    check_ray_version(ray.__version__)
    major, minor = MIRRORED_RAY_VERSION.split(".")
    [spec] = re.findall(r'"ray\[[^\]]*\]([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert spec == f">={major}.{minor},<{major}.{int(minor) + 1}"


def test_a_measurement_is_never_retried_and_training_keeps_rays_trainer():
    """The same builder: a deadline gives the timed trainer (no retry, the deadline and start
    timeout set); none gives Ray's own TorchTrainer with the caller's failure config."""
    from ray.train import FailureConfig
    from ray.train.torch import TorchTrainer

    from paratune.launch import Deadline, WorkerDemand, build_trainer
    from paratune.plan import load_plan_dict

    plan = load_plan_dict({"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2,
                           "env": {"NCCL_ALGO": "Ring"}})
    workers = WorkerDemand.for_plan(plan, False)
    assert (workers.per_worker, workers.env, workers.workers) == ({"CPU": 1}, {"NCCL_ALGO": "Ring"}, 2)

    def loop(config):
        return config

    timed = build_trainer(loop, {}, name="t", workers=workers, backend="gloo", comm_timeout_s=30,
                          storage_path="/tmp/paratune-test-storage",
                          deadline=Deadline(12.0, "late {deadline_s:.0f}", start_timeout_s=5.0))
    assert type(timed).__name__ == "TimedTorchTrainer"
    assert (timed.deadline_s, timed.deadline_message, timed.start_timeout_s) == (12.0, "late {deadline_s:.0f}", 5.0)
    assert timed.run_config.failure_config.max_failures == 0
    assert timed.run_config.failure_config.controller_failure_limit == 0
    assert timed.run_config.worker_runtime_env == {"env_vars": {"NCCL_ALGO": "Ring"}}
    training = build_trainer(loop, {}, name="r", workers=workers, backend="gloo", comm_timeout_s=30,
                             storage_path="/tmp/paratune-test-storage", failure_config=FailureConfig(max_failures=3))
    assert type(training) is TorchTrainer and training.run_config.failure_config.max_failures == 3
