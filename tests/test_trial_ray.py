"""The trial end to end on a real in-process Ray cluster: 2 gloo workers per trial."""

import pytest
from conftest import BASE_PLAN

from paratune.plan import load_plan_dict
from paratune.reference import max_loss_difference, reference_losses
from paratune.trial import run_trial

pytestmark = pytest.mark.integration


# DDP as a fresh trial, and ZeRO-2 and FSDP2 in a reused group, against the reference:
# tests/test_session.py (run_trial's figures against a reused group's). Every option of every
# family, on gloo processes without Ray: tests/test_parity_gloo.py.
FSDP_WITH_ENV = {"strategy": "fsdp", "fsdp": {"sharding": "full"}, "profile_comm": True, "track_memory": True,
                 "env": {"GLOO_SOCKET_IFNAME": "lo", "NCCL_ALGO": "Ring", "PARATUNE_PROBE": "42"}}


def test_a_fresh_trial_measures_fsdp_and_matches_reference(ray_local):
    plan = load_plan_dict({**BASE_PLAN, **FSDP_WITH_ENV})
    result = run_trial(plan)
    assert result.ok, result.message
    assert max_loss_difference(result.losses, reference_losses(plan)) < 1e-5
    # The numbers are computed from the measured steps, and only from those.
    assert len(result.step_times_s) == plan.measure_steps and len(result.losses) == plan.total_steps
    expected = plan.tokens_per_step * plan.measure_steps / (sum(result.step_times_s) * plan.num_workers)
    assert result.tokens_per_s_per_gpu == pytest.approx(expected)
    assert result.step_time_p10_s <= result.step_time_median_s <= result.step_time_p90_s
    assert len(result.peak_memory_bytes) == 2 and min(result.peak_memory_bytes) > 0
    assert "MemTracker" in result.memory_method and result.mfu is None  # no known peak for a CPU
    assert result.launch_s > 0
    if plan.profile_comm:
        assert 0 < result.comm_share <= 1
    assert result.env_seen == {k: v for k, v in plan.env.items()}
    # Where every rank ran, as Ray Train placed it (one node here; multi-node: test_cluster_jobs).
    import ray

    node = ray.get_runtime_context().get_node_id()
    assert [(p["rank"], p["node_id"], p["local_rank"], p["local_world_size"]) for p in result.placement] == \
        [(0, node, 0, 2), (1, node, 1, 2)]
    # A measurement is never retried: Ray Train's preemption watcher is not started for it.
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    from paratune.trial import MEASUREMENT_CONTROLLER_ENV

    assert MEASUREMENT_CONTROLLER_ENV == {ENABLE_PREEMPTION_WATCHER_ENV_VAR: "0", HEALTH_CHECK_INTERVAL_S_ENV_VAR: "0.5"}
    assert "PreemptionWatcher" not in _actor_classes()
    assert "DatasetManager" not in _actor_classes()  # no datasets: no Ray Data actor per trial
    assert "TrainController" in _actor_classes()  # the check can see the run's actors


def _actor_classes() -> set[str]:
    """Every actor class this Ray instance has run (alive or dead)."""
    import ray._private.state

    return {a["ActorClassName"] for a in ray._private.state.actors().values()}


def _resources_released() -> None:
    """A failed trial leaves nothing holding the cluster: both CPUs free, no live placement group
    (the next trial would otherwise wait for CPUs, then time out)."""
    import time

    import ray
    from ray.util import placement_group_table

    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= 2
    live = [pg for pg in placement_group_table().values() if pg["state"] in ("CREATED", "PENDING", "RESCHEDULING")]
    assert not live, live


def test_env_reaches_workers_before_process_group_start(ray_local):
    # gloo reads GLOO_SOCKET_IFNAME while the process group is created: a bogus interface can
    # only fail the trial if the variable was in the worker's environment before that moment.
    bad = load_plan_dict({**BASE_PLAN, "env": {"GLOO_SOCKET_IFNAME": "paratune-no-such-if0"}})
    result = run_trial(bad)
    assert result.status == "failed" and result.reason is not None
    assert "paratune-no-such-if0" in result.message
    # The failed setup must not leak its placement group and starve the next trial.
    _resources_released()


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
    assert result.reason == "invalid_config" and "allowed presets" in result.message
    # Context parallelism on a cluster without GPUs: torch cannot ring CPU attention; refused with why.
    result = run_trial({**BASE_PLAN, "cp": 2, "micro_batch": 4})
    assert result.reason == "invalid_config" and "aten._scaled_dot_product_flash_attention_for_cpu" in result.message
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
    _resources_released()


def test_a_trial_that_cannot_reach_the_incumbent_stops_early_with_its_partial_figures(ray_local):
    from paratune.measure import StopRule

    plan = load_plan_dict({**BASE_PLAN, "measure_steps": 5, "track_memory": True})
    result = run_trial(plan, stop_rule=StopRule(incumbent_tokens_per_s_per_gpu=1e12, min_steps=2))
    assert result.status == "stopped_early" and not result.ok and result.stopped_early
    assert len(result.step_times_s) == 2 and len(result.losses) == plan.warmup_steps + 2
    assert result.tokens_per_s_per_gpu > 0 and "after 2 of 5 measured steps" in result.message
    assert result.peak_memory_bytes == [0, 0]  # its extra memory-tracked step was skipped
    # An incumbent it can beat runs every measured step: the same worker code in a reused group,
    # tests/test_session.py::test_the_stop_rule_works_in_a_reused_group.
