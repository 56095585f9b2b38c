"""What paratune needs of Ray Train, on whichever supported Ray runs the tests: the main suite runs
them on constraints.txt's Ray (the newest), `.ci/run` on the oldest (.ci/oldest_ray.sh).

A measurement's worker group that cannot start fails at Ray Train's start timeout (never retried),
a failing rank ends the run after one attempt, a run past its deadline is ended with its workers,
rank 0's return comes back (Result.return_value, or the report fallback before Ray 2.56), the
controller settings reach the workers, and a checkpointed training run reports its outcome (from
its last checkpoint before Ray 2.56). Tiny train loops, so each is a worker group's start and little
more; the same behaviour through paratune's own trial: test_trial_ray.py and test_session.py."""

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle
from conftest import BASE_PLAN

from paratune.trial.failures import classify
from paratune.cluster.launch import (
    Deadline,
    WorkerDemand,
    build_trainer,
    fit,
    placement_groups,
    remove_leaked_placement_groups,
    return_value,
)
from paratune.config.plan import load_plan_dict

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the train loops below: Ray's workers cannot import tests/


def _workers(**per_worker) -> WorkerDemand:
    workers = WorkerDemand.for_plan(load_plan_dict(BASE_PLAN), use_gpu=False)
    return dataclasses.replace(workers, per_worker={**workers.per_worker, **per_worker}) if per_worker else workers


def _measure(loop, config, tmp_path: Path, deadline: Deadline, workers: WorkerDemand | None = None):
    trainer = build_trainer(loop, config, name=f"range-{time.monotonic_ns()}", workers=workers or _workers(),
                            backend="gloo", comm_timeout_s=60, storage_path=tmp_path / "ray", deadline=deadline)
    t0 = time.perf_counter()
    result, error = fit(trainer)
    return result, error, time.perf_counter() - t0


def _released(before: set[str]) -> None:
    """What a failed run held is free again: its placement group removed (paratune's cleanup, as
    after every failed trial), both CPUs available."""
    import ray

    remove_leaked_placement_groups(before)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= 2
    assert not {pg for pg, state in placement_groups().items() if pg not in before and state == "CREATED"}


def _rank_0_says(config):
    import ray.train

    names = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "PARATUNE_PROBE")
    rank = ray.train.get_context().get_world_rank()
    return {"rank": rank, "env": {n: os.environ.get(n) for n in names}, "payload": config["payload"]}


# `matrix` (make test-matrix; and .ci/oldest_ray.sh runs this module whole on the oldest Ray): on this Ray,
# every ok run_trial reads rank 0's return (test_session's fresh and reused figures), the plan's env
# comes back as seen (test_trial_ray's stop-early trial) and the controller settings are checked by name
# in test_session's assert_fresh_trial_figures.
@pytest.mark.matrix
def test_rank_0s_return_and_the_controller_settings_reach_the_driver(ray_local, tmp_path):
    workers = dataclasses.replace(_workers(), env={"PARATUNE_PROBE": "42"})
    result, error, _ = _measure(_rank_0_says, {"payload": [1, 2.5, "x"]}, tmp_path, Deadline(120), workers)
    assert error is None, error
    out = return_value(result)
    assert out == {"rank": 0, "payload": [1, 2.5, "x"],
                   "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60",
                           "PARATUNE_PROBE": "42"}}


def _unplaceable(config):
    return {}


def test_workers_that_cannot_start_fail_at_the_start_timeout_never_retried(ray_local, tmp_path):
    """Before Ray 2.49 this retried forever (controller_failure_limit did not exist)."""
    before = set(placement_groups())
    result, error, wall = _measure(_unplaceable, {}, tmp_path, Deadline(240, start_timeout_s=5),
                                   _workers(paratune_missing=1))
    assert error is not None and wall < 90, (wall, error)
    reason, message = classify(error)
    assert reason == "insufficient_resources", (reason, message)
    _released(before)


def _rank_1_fails(config):
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    with open(config["attempts"], "a") as f:
        f.write(f"{rank}\n")
    if rank == 1:
        raise RuntimeError("paratune-range: rank 1 fails on purpose")
    time.sleep(2)
    return {}


# `matrix` (make test-matrix; .ci/oldest_ray.sh runs it on the oldest Ray): on this Ray, a failing run
# that is ended, classified and cleaned up: test_trial_ray's diverged trial (every rank raises) and
# test_session's killed worker (worker_died, its group ended, the next plan in a fresh one).
@pytest.mark.matrix
def test_a_failing_rank_ends_the_run_after_one_attempt(ray_local, tmp_path):
    before = set(placement_groups())
    attempts = tmp_path / "attempts.txt"
    result, error, _ = _measure(_rank_1_fails, {"attempts": str(attempts)}, tmp_path, Deadline(240))
    assert error is not None and "rank 1 fails on purpose" in str(error)
    assert sorted(attempts.read_text().split()) == ["0", "1"]  # one attempt of each rank: no retry
    assert classify(error)[0] == "error"
    _released(before)


def _hangs(config):
    Path(config["pids"]).joinpath(str(os.getpid())).touch()
    time.sleep(3600)


# `matrix` (make test-matrix; .ci/oldest_ray.sh runs it on the oldest Ray): on this Ray, the same Deadline
# through paratune's trial: test_trial_ray's hanging worker, ended by its 20 s trial_timeout_s, its CPUs
# and placement group free again.
@pytest.mark.matrix
def test_a_run_past_its_deadline_ends_with_its_workers(ray_local, tmp_path):
    before = set(placement_groups())
    pids = tmp_path / "pids"
    pids.mkdir()
    result, error, wall = _measure(_hangs, {"pids": str(pids)}, tmp_path, Deadline(45, "hang: past {deadline_s:.0f}s"))
    assert classify(error) == ("hang", "hang: past 45s") and 45 <= wall < 45 + 30, (wall, error)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2  # both workers were running when the deadline came (45 s: a loaded start)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended

    until = time.time() + 30
    while any(alive(p) for p in started) and time.time() < until:
        time.sleep(0.5)
    assert not [p for p in started if alive(p)]
    _released(before)


# The training run's one end-to-end run in `make test` (test_cluster_jobs' training job, resumed from its
# checkpoint, and test_newcomer's `paratune train` are `e2e`).
def test_a_training_run_reports_its_outcome(ray_local, tmp_path):
    """Ray's own TorchTrainer (no runner, no deadline), checkpointed; before Ray 2.56 the outcome is
    read from its last checkpoint."""
    from paratune.train.training import run_training

    result = run_training(load_plan_dict(BASE_PLAN), steps=3, checkpoint_every=2, track=False,
                          storage_path=str(tmp_path / "ray"), name="range-train")
    assert result.ok, result.message
    assert len(result.losses) == 3 and result.resumed_at_steps == [] and result.tokens_per_s_per_gpu > 0
    assert result.checkpoint and result.checkpoint.endswith("step_00000003")
