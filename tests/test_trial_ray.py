"""The trial end to end on a real in-process Ray cluster: 2 gloo workers per trial."""

import pytest
from conftest import BASE_PLAN, ray_actor_processes, resources_released

from paratune.config.plan import load_plan_dict
from paratune.cluster.launch import idle_runner_pids
from paratune.cluster.trial import run_trial

pytestmark = pytest.mark.integration
# The Ray Train actors a fresh trial starts, which must end with its run.
TRAIN_ACTORS = ("TrainController", "RayTrainWorker", "SynchronizationActor")


# A fresh trial's figures against the reference and against a reused group's (FSDP2 with its
# communication share, placement, and the Ray actors a measurement starts):
# tests/test_session.py::test_a_reused_group_measures_a_plan_as_a_fresh_one_does. Every option of
# every family, on gloo processes without Ray: tests/test_parity_gloo.py. Here: how fresh trials fail.


# `matrix` (make test-matrix): the env reaches a group's workers before its process group starts, and a
# group that cannot start leaves no worker or placement group, through the same launch code
# (launch.build_trainer, the plan's WorkerDemand) in a reused group: test_session's
# test_another_env_gets_another_group_and_a_failure_ends_it ("unborn").
@pytest.mark.matrix
def test_env_reaches_workers_before_process_group_start(ray_local):
    # gloo reads GLOO_SOCKET_IFNAME while the process group is created: a bogus interface can
    # only fail the trial if the variable was in the worker's environment before that moment.
    bad = load_plan_dict({**BASE_PLAN, "env": {"GLOO_SOCKET_IFNAME": "paratune-no-such-if0"}})
    result = run_trial(bad)
    assert result.status == "failed" and result.reason is not None
    assert "paratune-no-such-if0" in result.message
    # The failed setup must not leak its placement group and starve the next trial.
    resources_released(ray_local)


# `matrix` (make test-matrix): a worker's exception in a fresh trial, classified, is test_a_loss_that_overflows
# (diverged, the cluster free after it); the allocator's own message through Ray's error wrapper is
# test_failures' (oom); a measured trial over its budget ends oom in test_sweep's grid sweep.
@pytest.mark.matrix
def test_out_of_memory_comes_back_classified(ray_local):
    # A model whose embedding alone needs 256 TiB: the allocator refuses it on every machine.
    plan = load_plan_dict({**BASE_PLAN, "model_overrides": {"vocab_size": 2**40}})
    result = run_trial(plan)
    assert result.status == "failed" and result.reason == "oom", result.message
    assert "allocate" in result.message


def test_invalid_plan_is_rejected_before_any_worker_starts(ray_local):
    import ray

    before = ray.available_resources().get("CPU")
    result = run_trial({**BASE_PLAN, "micro_batch": 3})
    assert result.status == "failed" and result.reason == "invalid_config"
    assert "global_batch: 8 is not divisible by micro_batch x dp_degree = 3 x 2" in result.message
    assert ray.available_resources().get("CPU") == before
    result = run_trial({**BASE_PLAN, "model": "no-such-model"})
    assert result.reason == "invalid_config" and "or a preset: " in result.message
    # Context parallelism on a cluster without GPUs: torch cannot ring CPU attention; refused with why.
    result = run_trial({**BASE_PLAN, "cp": 2, "micro_batch": 4})
    assert result.reason == "invalid_config" and "aten._scaled_dot_product_flash_attention_for_cpu" in result.message
    # Async TP on a cluster without GPUs: refused before any worker starts, with why.
    result = run_trial({**BASE_PLAN, "tp": 2, "sequence_parallel": True, "compile": True, "async_tp": True})
    assert result.reason == "invalid_config" and "async_tp: true on CPU workers" in result.message, result.message
    assert ray.available_resources().get("CPU") == before
    # More workers than the cluster holds: at once (not after Ray Train's 60 s start timeout),
    # named: what it needs, what the cluster has.
    result = run_trial({**BASE_PLAN, "num_workers": 4})
    assert result.reason == "insufficient_resources" and result.wall_s < 5, result.message
    assert "needs 4 workers x {CPU 1}" in result.message and "CPU 2 -> 2 worker(s)" in result.message
    assert ray.available_resources().get("CPU") == before


def test_hanging_worker_is_ended_by_the_trial_timeout(ray_local):
    import time

    # Rank 0 stuck in Python, rank 1 waiting in a collective whose timeout (300 s) is far off:
    # the trial's deadline ends it.
    # (A worker killed mid-trial, and a hang inside a collective, are tests against a real
    # cluster in test_cluster_jobs.py.)
    plan = load_plan_dict({**BASE_PLAN, "trial_timeout_s": 20, "env": {"PARATUNE_FAULT": "hang:rank=0:step=1"}})
    t0 = time.perf_counter()
    result = run_trial(plan)
    assert result.status == "failed" and result.reason == "hang", result.message
    assert time.perf_counter() - t0 < 20 + 75  # the deadline, plus abort and teardown
    # Its workers are gone: the cluster's CPUs are free again, no placement group is left.
    resources_released(ray_local)


# `matrix` (make test-matrix): the same worker code stops in a reused group, with its partial figures and
# no memory-tracked step (test_session's test_the_stop_rule_works_in_a_reused_group), a plan's env comes
# back as seen there too (test_another_env_gets_another_group_and_a_failure_ends_it), and a sweep stops
# a trial early and records it (test_sweep's test_a_sweep_stops_early_the_trial_that_cannot_reach_its_incumbent).
@pytest.mark.matrix
def test_a_trial_that_cannot_reach_the_incumbent_stops_early_with_its_partial_figures(ray_local):
    from paratune.costs.measure import TrialStopRule

    # The plan's env reaches its workers (and comes back as seen): settings that are not
    # communication settings are still delivered.
    env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_ALGO": "Ring", "PARATUNE_PROBE": "42"}
    plan = load_plan_dict({**BASE_PLAN, "measure_steps": 5, "track_memory": True, "env": env})
    result = run_trial(plan, stop_rule=TrialStopRule(incumbent_tokens_per_s_per_gpu=1e12, min_steps=2))
    assert result.env_seen == env, result.env_seen
    assert result.status == "stopped_early" and not result.ok and result.stopped_early
    assert len(result.step_times_s) == 2 and len(result.losses) == plan.warmup_steps + 2
    assert result.tokens_per_s_per_gpu > 0 and "after 2 of 5 measured steps" in result.message
    assert result.peak_memory_bytes == [0, 0]  # its extra memory-tracked step was skipped
    # An incumbent it can beat runs every measured step: the same worker code in a reused group,
    # tests/test_session.py::test_the_stop_rule_works_in_a_reused_group.


def test_a_loss_that_overflows_fails_the_trial_as_diverged(ray_local):
    """An lr of 1e20 sends step 1's loss to NaN on every rank: the trial is failed, reason
    `diverged`, naming the first step and rank (never `ok` with NaN figures, which a sweep would
    rank by its speed), and the cluster is free for the next trial."""
    from paratune.trial.failures import classify

    earlier = ray_actor_processes(*TRAIN_ACTORS, settle_s=0)  # not this test's run
    result = run_trial(load_plan_dict({**BASE_PLAN, "lr": 1e20}))
    assert result.status == "failed" and result.reason == "diverged", (result.status, result.message)
    assert "loss not finite from step 1 on rank 0 (nan); 2 of 2 rank(s)" in result.message
    assert classify(RuntimeError(result.message))[0] == "diverged"  # also when only the text survives
    resources_released(ray_local)
    # The run's Ray Train actors ended with it; its runner, whose fit() returned by itself, is kept
    # for the next measurement (reused by the next fresh trial: the dropout test below, `e2e`).
    assert ray_actor_processes(*TRAIN_ACTORS, besides=earlier) == {}, earlier
    assert idle_runner_pids()


# `e2e` (make test-e2e): `make test` keeps parity's switch for the random draws a family ships
# (test_families) and a fresh trial beside a reused group (test_session).
@pytest.mark.e2e
def test_parity_of_a_model_with_dropout_runs_both_sides_without_it(ray_local, tmp_path):
    """GPT-BigCode ships dropout 0.1 (resid/embd/attn): its measured trial draws masks no reference
    repeats, so parity re-runs the plan and the reference with every dropout off, and says so
    (parity_mode deterministic, what it switched off); the trial it was given keeps its own
    losses, drawn with dropout on."""
    from family_zoo import write_config

    from paratune.sweep.parity import winner_parity

    plan = load_plan_dict({**BASE_PLAN, "model": str(write_config("gpt_bigcode", tmp_path)), "measure_steps": 2})
    earlier = ray_actor_processes(*TRAIN_ACTORS, settle_s=0)  # not this test's runs
    measured = run_trial(plan)
    assert measured.status == "ok", measured.message
    runners = idle_runner_pids()
    parity = winner_parity(plan, measured)
    assert parity.passed, parity.reason
    # Two fresh trials in a row: the first's runner actor ran the second (one Ray process and its
    # imports fewer per launch), and each run's Ray Train actors ended with it.
    assert runners and idle_runner_pids() == runners, (runners, idle_runner_pids())
    assert ray_actor_processes(*TRAIN_ACTORS, besides=earlier) == {}, earlier
    assert parity.mode == "deterministic" and parity.switched_off == {"resid_pdrop": 0.1, "embd_pdrop": 0.1,
                                                                      "attn_pdrop": 0.1}
    assert parity.losses != list(measured.losses)  # the check's own run, not the dropout-drawing one
    assert parity.to_record("a", "k")["parity_mode"] == "deterministic"
