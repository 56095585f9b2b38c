"""paratune.cluster.launch: the Ray releases it runs on, what each lacks, and the trainers it assembles.

Ray's public API (and one private method, feature-detected), from OLDEST_RAY (2.49: the first Train V2 with
FailureConfig(controller_failure_limit); before it the controller retries a worker group that
cannot start forever) to NEWEST_RAY; pyproject.toml declares the same range."""

import re
from pathlib import Path

import pytest

from paratune.cluster.launch import NEWEST_RAY, OLDEST_RAY, RayFeatures, RayVersionError, check_ray_version

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("installed", ["2.49.0", "2.49.2", "2.53.0rc1", "2.60.0", "2.60.3", "2.61.0", "2.61.1.dev0"])
def test_every_release_in_the_range_passes(installed):
    check_ray_version(installed)


@pytest.mark.parametrize("installed", ["2.48.0", "2.43.0", "2.62.0", "3.0.0", "2.6.0", "2.600.0", "nightly", ""])
def test_a_ray_outside_the_range_is_refused_naming_it_and_the_range(installed):
    with pytest.raises(RayVersionError) as refused:
        check_ray_version(installed)
    message = str(refused.value)
    assert f"installed {installed!r}" in message and "allowed: ray 2.49 to 2.61.x" in message


def test_the_installed_ray_and_pyproject_declare_the_range():
    import ray

    check_ray_version(ray.__version__)
    [spec] = re.findall(r'"ray\[[^\]]*\]([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert spec == f">={OLDEST_RAY[0]}.{OLDEST_RAY[1]},<{NEWEST_RAY[0]}.{NEWEST_RAY[1] + 1}"


def test_what_an_older_ray_lacks_is_said_and_the_newest_lacks_nothing():
    old = RayFeatures("2.49.2", return_value=False, label_selector=False, controller_failure_limit=True)
    lost = old.lost()
    assert len(lost) == 2 and "Result.return_value (Ray 2.56)" in lost[0] and "label_selector (Ray 2.53)" in lost[1]
    assert RayFeatures("2.60.0", True, True, True).lost() == []


def test_the_installed_ray_is_train_v2_and_its_features_match_its_release():
    """Read from Ray's public config classes (never from the version number)."""
    import ray

    from paratune.cluster.launch import ray_features

    features = ray_features()
    minor = tuple(int(x) for x in ray.__version__.split(".")[:2])
    assert features.controller_failure_limit
    assert (features.return_value, features.label_selector) == (minor >= (2, 56), minor >= (2, 53))


def test_a_measurement_is_never_retried_and_training_keeps_rays_trainer():
    """The same builder: a deadline gives the timed trainer (no retry, the deadline and start
    timeout set); none gives Ray's own TorchTrainer with the caller's failure config."""
    from ray.train import FailureConfig
    from ray.train.torch import TorchTrainer

    from paratune.cluster.launch import Deadline, WorkerDemand, build_trainer
    from paratune.config.plan import load_plan_dict

    plan = load_plan_dict({"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2,
                           "env": {"NCCL_ALGO": "Ring"}})
    workers = WorkerDemand.for_plan(plan, False)
    assert (workers.per_worker, workers.env, workers.workers) == ({"CPU": 1}, {"NCCL_ALGO": "Ring"}, 2)

    def loop(config):
        return config

    timed = build_trainer(loop, {}, name="t", workers=workers, backend="gloo", comm_timeout_s=30,
                          storage_path="/tmp/paratune-test-storage",
                          deadline=Deadline(12.0, "late {deadline_s:.0f}", start_timeout_s=5.0))
    assert type(timed).__name__ == "TimedTrainer"
    assert (timed.deadline_s, timed.deadline_message, timed.start_timeout_s) == (12.0, "late {deadline_s:.0f}", 5.0)
    assert timed.kwargs["failure_config"].max_failures == 0
    assert timed.kwargs["failure_config"].controller_failure_limit == 0
    # What the runner builds (in its own process) from those arguments: Ray's TorchTrainer, less the
    # two actors a measurement has no use for (Ray Data's dataset manager, the placement-group
    # cleaner: MEASUREMENT_SKIPPED_CALLBACKS), every other controller callback kept.
    from paratune.cluster.launch import MEASUREMENT_SKIPPED_CALLBACKS, _torch_trainer

    inner = _torch_trainer(loop, measurement=True, **timed.kwargs)
    assert isinstance(inner, TorchTrainer) and inner.run_config.failure_config.controller_failure_limit == 0
    assert inner.run_config.worker_runtime_env == {"env_vars": {"NCCL_ALGO": "Ring"}}
    rays = [type(cb).__name__ for cb in TorchTrainer(loop, scaling_config=inner.scaling_config)._create_default_callbacks()]
    assert set(MEASUREMENT_SKIPPED_CALLBACKS) <= set(rays), rays  # the installed Ray starts both: the cut is real
    assert [type(cb).__name__ for cb in inner._create_default_callbacks()] == \
        [name for name in rays if name not in MEASUREMENT_SKIPPED_CALLBACKS]
    training = build_trainer(loop, {}, name="r", workers=workers, backend="gloo", comm_timeout_s=30,
                             storage_path="/tmp/paratune-test-storage", failure_config=FailureConfig(max_failures=3))
    assert type(training) is TorchTrainer and training.run_config.failure_config.max_failures == 3


def test_the_runner_env_sets_the_controller_switches_and_the_users_values_win(monkeypatch):
    """Ray Train's documented RAY_TRAIN_* variables reach the controller through the runner's env:
    paratune's measurement settings, the worker-group start timeout (60 s on every release: Ray's
    default was 30 s before 2.54), Train V2 on (2.49-2.50); a user's own value wins, save the start
    timeout a sweep sets from its autoscaler bound."""
    from paratune.cluster.launch import MEASUREMENT_CONTROLLER_ENV, runner_env

    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    env = runner_env(None)
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"
    assert env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == MEASUREMENT_CONTROLLER_ENV["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]
    assert (env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"], env["RAY_TRAIN_V2_ENABLED"]) == ("60", "1")
    assert runner_env(900.0)["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "900.0"
    assert all(name.startswith("RAY_TRAIN_") for name in env)


def test_rank_0s_return_comes_back_without_result_return_value():
    """Ray before 2.56: the value travels in the last report's metrics (base64 of its pickle)."""
    import base64
    import pickle
    from types import SimpleNamespace

    from paratune.cluster.launch import RETURN_METRIC, return_value

    out = {"losses": [1.5, 1.25], "placement": [{"rank": 0}]}
    old = SimpleNamespace(metrics={RETURN_METRIC: base64.b64encode(pickle.dumps(out)).decode()})
    assert return_value(old) == out
    assert return_value(SimpleNamespace(metrics=None)) is None and return_value(None) is None
    assert return_value(SimpleNamespace(return_value=out, metrics=None)) == out


def test_a_fit_puts_back_the_sigint_handler_it_found():
    """Ray Train's fit() installs a SIGINT handler holding the run's controller (main thread): after
    the run, the process's own handler is back, so the finished run's controller ends with it."""
    import signal

    from paratune.cluster.launch import sigint_handler_kept

    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        with sigint_handler_kept():
            signal.signal(signal.SIGINT, lambda signum, frame: None)  # what fit() does
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
