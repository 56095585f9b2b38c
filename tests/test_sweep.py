"""A real sweep: Ray Tune + Optuna on in-process Ray, trials as Ray Train jobs, a real MLflow store."""

import json

import pytest
import yaml
from mlflow.tracking import MlflowClient

from paratune.config.plan import load_plan
from paratune.sweep.space import load_space
from paratune.sweep.ledger import Ledger, SweepError
from paratune.sweep.driver import run_sweep

pytestmark = pytest.mark.integration

FIXED = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2, "warmup_steps": 1,
         "measure_steps": 2, "profile_comm": False, "lr": 0.01, "trial_timeout_s": 300}


def _space(tmp_path, name, space, search, budget=None, estimate=None, fixed=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "fixed": {**FIXED, **(fixed or {})}, "space": space, "search": search,
                                    "objective": {"memory_budget_gb": budget}, "estimate": estimate or {}}))
    return load_space(path)


@pytest.fixture(scope="module")
def sweep_pool(ray_local):
    """One worker-group pool for the sweeps of this module: they launch their 2 workers once
    (run_sweep(pool=...)), as sweeps one after another in one Ray session do. (A sweep's own pool,
    the default, started and closed with it: the sweep jobs of tests/test_cluster_jobs.py.) Closed
    at the module's end, so the CPUs its idle group holds go back before the next module's workers
    need them."""
    from paratune.cluster.pool import get_pool_actor

    name = "paratune-test-sweep-pool"
    actor = get_pool_actor(name)
    yield name
    ray_local.get(actor.close.remote())
    ray_local.kill(actor)


def _children(client, parent_id, phase):
    runs = client.search_runs([client.get_run(parent_id).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent_id}' and tags.`paratune.phase` = '{phase}'")
    return sorted(runs, key=lambda r: r.info.start_time)


def test_grid_sweep_logs_to_mlflow_and_resumes_without_rerunning(ray_local, tmp_path, capsys, mlflow_uri, sweep_pool):
    # DeepSpeed's default 5e8-element buckets take ~2 GB per rank: over a 1 GB budget, so the
    # zero trial fails (oom, over budget) while the ddp ones succeed.
    # (The cost model would skip it before launch; here it is told not to, so that a plan measured
    # over budget is still caught.)
    space = _space(tmp_path, "grid", {"strategy": {"ddp": {"bucket_cap_mb": [25]}, "zero": {"stage": [2]}},
                                      "micro_batch": [2, 4]},
                   {"algorithm": "grid", "trials": 2, "top_k": 2, "remeasure_rounds": 1}, budget=1.0,
                   estimate={"skip_predicted_oom": False})
    uri = mlflow_uri
    out = tmp_path / "sweep"
    first = run_sweep(space, out, tracking_uri=uri, pool=sweep_pool)
    _assert_progress_without_tune_banner(capsys.readouterr(), total=2)
    client = MlflowClient(uri)
    # Grid order follows the prediction weighed by the risk of a launch (paratune.costs.risk): the
    # ddp plans, predicted to fit, micro-batch 4 (fewer micro-batches) before 2; the zero plan,
    # predicted over the budget, last.
    searched = [e for e in first.entries if e.phase == "search"]
    assert [(e.result.plan["strategy"], e.result.plan["micro_batch"]) for e in searched] == [("ddp", 4), ("ddp", 2)]
    assert len(_children(client, first.parent_run_id, "search")) == 2
    assert len(_children(client, first.parent_run_id, "remeasure")) == 2  # both ok: the top 2 measured again
    with pytest.raises(SweepError, match="use --resume"):
        run_sweep(space, out, tracking_uri=uri)

    # "Interrupted" after 2 of 3 trials: resume runs only the missing one (the zero plan: over budget).
    report = run_sweep(space, out, trials=3, resume=True, tracking_uri=uri, pool=sweep_pool)
    assert report.parent_run_id == first.parent_run_id
    ledger = Ledger(out / "ledger.jsonl")
    search = ledger.search_entries()
    assert [e.number for e in search] == [1, 2, 3] and len({e.key for e in search}) == 3
    children = _children(client, report.parent_run_id, "search")
    assert len(children) == 3 and len(_children(client, report.parent_run_id, "remeasure")) == 2  # top 2, once

    ok = [r for r in children if r.data.tags["paratune.status"] == "ok"]
    failed = [r for r in children if r.data.tags["paratune.status"] == "failed"]
    assert len(ok) == 2 and len(failed) == 1
    assert failed[0].data.tags["paratune.failure_reason"] == "oom"
    assert "over budget" in failed[0].data.tags["paratune.failure_message"]
    assert failed[0].data.params["zero.stage"] == "2" and failed[0].data.params["failure_reason"] == "oom"
    for run in ok:
        assert {"strategy", "micro_batch", "grad_accum", "global_batch", "ddp.bucket_cap_mb"} <= set(run.data.params)
        assert {"tokens_per_s_per_gpu", "step_time_median_s", "step_time_spread", "peak_memory_gib"} <= set(run.data.metrics)
        assert len(client.get_metric_history(run.info.run_id, "loss")) == 3  # every step's loss
        assert run.data.metrics["failed"] == 0.0

    parent = client.get_run(report.parent_run_id)
    assert parent.data.metrics["best_tokens_per_s_per_gpu"] > 0
    assert parent.data.tags["paratune.winner"].startswith("ddp")
    assert parent.data.params["fixed.model"] == "tiny-llama"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"space", "winner", "report"}
    winner = load_plan(out / "winner" / "plan.yaml")
    assert winner.strategy == "ddp" and winner.global_batch == 8
    assert report.winner_parity is not None and report.winner_parity < 1e-4
    _assert_mlflow_as_users_expect(client, report, children, ledger)
    _assert_report_and_its_inputs(client, report, ledger)
    summary = json.loads((out / "winner" / "summary.json").read_text())
    assert summary["measurements"] >= 2

    space.source.write_text(space.source.read_text().replace("trials: 2", "trials: 5"))
    with pytest.raises(SweepError, match="space file changed"):
        run_sweep(load_space(space.source), out, resume=True, tracking_uri=uri)


def test_tpe_skips_predicted_oom_starts_from_the_predicted_best_and_logs_the_calibration(ray_local, tmp_path, mlflow_uri, sweep_pool):
    # ZeRO-2 with DeepSpeed's default buckets is predicted at ~4 GiB per rank: over the 1 GiB
    # budget, skipped before launch. The two DDP plans are measured, the predicted-faster one
    # (no recomputation) first; TPE never proposes a point twice and stops when the space is spent.
    space = _space(tmp_path, "tpe", {"strategy": {"ddp": {}, "zero": {"stage": [2]}}, "micro_batch": [4],
                                     "activation_checkpointing": ["full", "none"]},
                   {"algorithm": "tpe", "trials": 4, "remeasure_rounds": 0, "seed": 3}, budget=1.0,
                   estimate={"device": "cpu", "start_from_predicted": 1})
    uri = mlflow_uri
    report = run_sweep(space, tmp_path / "sweep", tracking_uri=uri, report_page=False, pool=sweep_pool)
    assert "2 x predicted out of memory on cpu" in report.pruning and "comm_buffers" in report.pruning
    search = [e for e in report.entries if e.phase == "search"]
    assert len(search) == 2 and len({e.key for e in search}) == 2  # 2 points left: the sweep stops there
    assert all(e.result.plan["strategy"] == "ddp" for e in search)
    assert search[0].result.plan["activation_checkpointing"] == "none"
    assert report.verdict.winner is not None

    client = MlflowClient(uri)
    for run in _children(client, report.parent_run_id, "search"):
        metrics = run.data.metrics
        assert {"predicted_peak_memory_gib", "predicted_step_time_s", "memory_prediction_error",
                "step_time_prediction_error"} <= set(metrics)
        assert abs(metrics["memory_prediction_error"]) < 0.5
    parent = client.get_run(report.parent_run_id).data.metrics
    assert "calibration_memory_prediction_error_median_abs" in parent and parent["calibration_compute_efficiency"] > 0
    assert report.calibration["device"] == "cpu"


def test_sweep_over_parallel_degrees_logs_them(ray_local, tmp_path, mlflow_uri, sweep_pool):
    space = _space(tmp_path, "degrees", {"strategy": {"fsdp": {"sharding": ["full"]}}, "micro_batch": [1],
                                         "tp": "auto", "pp": "auto"},
                   {"algorithm": "grid", "trials": 3, "remeasure_rounds": 0})
    # 2 workers: dp2, tp2, pp2 are valid; tp2 x pp2 needs 4 workers and is pruned.
    assert len(space.candidates) == 3 and sum(space.removed.values()) == 1
    uri = mlflow_uri
    groups_before = _pool_groups(sweep_pool)
    report = run_sweep(space, tmp_path / "sweep", tracking_uri=uri, report_page=False, pool=sweep_pool)
    # One trial at a time on 2 CPUs, so one Tune trainable process served all three (reuse_actors).
    results = [json.loads(f.read_text().splitlines()[0]) for f in (tmp_path / "sweep" / "tune").rglob("result.json")]
    assert len(results) == 3 and len({r["pid"] for r in results}) == 1, [r["pid"] for r in results]
    # The pool passed in served all three in one group, the one the module's earlier sweeps left,
    # and is still running.
    groups = _pool_groups(sweep_pool)
    assert len(groups) == 1 and not groups[0]["ended"], groups
    served_before = {g["group_id"]: g["requests_served"] for g in groups_before}
    assert groups[0]["requests_served"] == served_before.get(groups[0]["group_id"], 0) + 3
    assert groups[0]["group_id"] in served_before
    runs = _children(MlflowClient(uri), report.parent_run_id, "search")
    degrees = {(r.data.params["tp"], r.data.params["pp"]) for r in runs}
    assert degrees == {("1", "1"), ("2", "1"), ("1", "2")}
    assert all(r.data.tags["paratune.status"] == "ok" for r in runs), [r.data.tags for r in runs]


def test_calibrated_sweep_profiles_measures_the_predicted_fastest_first_and_stops_by_its_rule(ray_local, tmp_path, mlflow_uri, sweep_pool):
    # Micro-batch 1 means 4 micro-batches per step: on a tiny model several times slower than
    # micro-batch 4, and the profiled model should say so; the rule then stops before them.
    from paratune.costs.profile import ProfileStore, profile_requests_for
    from paratune.costs.timemodel import StepTimeModel

    space = _space(tmp_path, "calibrated", {"strategy": {"ddp": {}}, "micro_batch": [1, 4],
                                            "activation_checkpointing": ["none", "full"]},
                   {"algorithm": "calibrated", "trials": 4, "remeasure_rounds": 0}, estimate={"device": "cpu"})
    uri = mlflow_uri
    report = run_sweep(space, tmp_path / "sweep", tracking_uri=uri, report_page=False, pool=sweep_pool)
    search = [e for e in report.entries if e.phase == "search"]
    assert "no unmeasured plan can win" in report.stop_reason and len(search) < 4
    assert all(e.result.plan["micro_batch"] == 4 for e in search)

    # The profile is stored for later sweeps, and the first trial is the plan it predicts fastest.
    plans = [c.plan for c in space.candidates]
    profiles = [ProfileStore().get(r, "cpu") for r in profile_requests_for(plans)]
    assert all(p is not None for p in profiles)
    model = StepTimeModel(profiles)
    fastest = max(plans, key=lambda p: model.predict(p).tokens_per_s_per_gpu)
    assert search[0].result.plan == fastest.to_dict()

    assert report.time_model["source"] == "profile" and report.time_model["trials"] == len(search)
    assert report.time_model["worst_abs_error"] >= report.time_model["median_abs_error"] >= 0
    client = MlflowClient(uri)
    assert "no unmeasured plan can win" in client.get_run(report.parent_run_id).data.tags["paratune.stop_reason"]
    for run in _children(client, report.parent_run_id, "search"):
        assert {"predicted_step_time_s", "step_time_prediction_error"} <= set(run.data.metrics)


def test_a_sweep_stops_early_the_trial_that_cannot_reach_its_incumbent(ray_local, tmp_path, mlflow_uri, sweep_pool):
    # Every plan is measured (no stopping rule): micro-batch 16 first (predicted fastest), then
    # micro-batch 1 (16 micro-batches per step, several times slower even on a machine another
    # test process shares: 8 against 1 was not, once, outside both noise bands there), whose
    # first 2 of 4 measured steps are far below it: stopped early, recorded with its partial
    # figures, KILLED (not FAILED) in MLflow, never the winner.
    space = _space(tmp_path, "early", {"strategy": {"ddp": {}}, "micro_batch": [1, 16]},
                   {"algorithm": "calibrated", "trials": 2, "stopping_rule": False, "remeasure_rounds": 0},
                   estimate={"device": "cpu"}, fixed={"measure_steps": 4, "global_batch": 32})
    uri = mlflow_uri
    report = run_sweep(space, tmp_path / "sweep", tracking_uri=uri, report_page=False, pool=sweep_pool)
    first, second = [e.result for e in report.entries if e.phase == "search"]
    assert first.ok and first.plan["micro_batch"] == 16 and len(first.step_times_s) == 4
    assert second.status == "stopped_early" and second.plan["micro_batch"] == 1
    assert len(second.step_times_s) == 2 and 0 < second.tokens_per_s_per_gpu < first.tokens_per_s_per_gpu
    assert "after 2 of 4 measured steps" in second.message
    runs = _children(MlflowClient(uri), report.parent_run_id, "search")
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
    assert runs[1].data.metrics["stopped_early"] == 1.0 and runs[1].data.metrics["failed"] == 0.0
    assert report.verdict.winner.plan["micro_batch"] == 16


def test_plans_the_cluster_cannot_hold_are_pruned_and_a_cuda_space_without_gpus_is_an_error(ray_local, tmp_path, mlflow_uri):
    """Before any worker starts and before MLflow hears of the sweep: a space whose plans need more
    workers than the 2-CPU cluster holds fails naming what they need and what the cluster has
    (never Ray Train's 60 s start timeout); device: cuda with no GPU never falls back to the CPU."""
    import ray

    uri = mlflow_uri
    big = _space(tmp_path, "big", {"strategy": {"ddp": {}}, "micro_batch": [1, 2]}, {"algorithm": "grid", "trials": 1},
                 fixed={"num_workers": 4})
    with pytest.raises(SweepError, match=r"cannot hold any plan of the space: insufficient_resources: the plan needs "
                                         r"4 workers x \{CPU 1\}; the cluster has 1 node\(s\): .*CPU 2 -> 2 worker\(s\)"):
        run_sweep(big, tmp_path / "big", tracking_uri=uri)
    cuda = _space(tmp_path, "cuda", {"strategy": {"ddp": {}}, "micro_batch": [2]}, {"algorithm": "grid", "trials": 1},
                  fixed={"device": "cuda"})
    assert ray.cluster_resources().get("GPU", 0) == 0
    with pytest.raises(SweepError, match=r"device: 'cuda' in the space, but the plan needs 1 workers x \{GPU 1\}.*GPU 0"):
        run_sweep(cuda, tmp_path / "cuda", tracking_uri=uri)
    assert not (tmp_path / "mlflow.db").exists() or not MlflowClient(uri).search_runs(
        [e.experiment_id for e in MlflowClient(uri).search_experiments()])


def _pool_groups(name: str) -> list[dict]:
    """The worker groups of a running pool actor (paratune.cluster.session), ended ones left out."""
    import ray

    from paratune.cluster.pool import get_pool_actor

    return [g for g in ray.get(get_pool_actor(name).groups.remote()) if not g["ended"]]


# --------------------------------------------------------------------------- helpers of the grid sweep test
def _assert_progress_without_tune_banner(captured, total: int) -> None:
    """Outside a terminal (as under `ray job logs`): a plain line per finished trial with done/total,
    running, elapsed, ETA and the best so far; none of Ray Tune's banner, folder or TensorBoard hints."""
    import re

    text = captured.out + captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("trial ")]
    assert len(lines) == total, captured.out
    for line in lines:
        assert re.match(rf"trial \d/{total} .+ \| running \d+ \| elapsed \S+ \| ETA \S+ \| best ", line), line
    assert lines[-1].split(" | ")[3] == "ETA 0s", lines[-1]
    assert re.search(rf"^trials {total}/{total} \| running 0 \| elapsed", captured.out, re.M), captured.out
    for banner in ("View detailed results", "tensorboard", "Configuration for experiment", "Search algorithm",
                   "Trial status"):
        assert banner.lower() not in text.lower(), banner
    assert "no sweep report" not in captured.out  # written (run_sweep leaves saying where to `paratune tune`)


def _assert_mlflow_as_users_expect(client, report, children, ledger) -> None:
    """A model-training experiment; each trial run spans the trial; the parent says the winner and
    how to train with it."""
    from paratune.out.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, NOTE_TAG

    parent = client.get_run(report.parent_run_id)
    assert client.get_experiment(parent.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    by_number = {e.number: e.result for e in ledger.search_entries()}
    for run in children:
        result = by_number[int(run.data.tags["paratune.trial_number"])]
        assert run.info.start_time == round(result.started_at * 1000)
        assert run.info.end_time == round((result.started_at + result.wall_s) * 1000)
        # The trial's time, not the milliseconds of logging it: at least its own measured steps
        # (a reused group's trial here can take under a second: 983 ms measured).
        assert run.info.end_time - run.info.start_time >= 1000 * sum(result.step_times_s) - 1
        assert sum(result.step_times_s) > 0 or not result.ok
    note = parent.data.tags[NOTE_TAG]
    assert f"**Winner: {report.verdict.winner.label}**" in note and "tokens/s/GPU" in note
    plan_path = (report.out_dir / "winner" / "plan.yaml").resolve()
    assert f"python -m paratune train {plan_path}" in note and f" train {plan_path} --steps 1000" in note
    assert "report/report.html" in note
    assert {"best_tokens_per_s_per_gpu", "best_peak_memory_gib", "best_step_time_spread"} <= set(parent.data.metrics)


def _assert_report_and_its_inputs(client, report, ledger) -> None:
    """The sweep report on disk and in the parent run; the predictions and parity checks it draws."""
    assert report.report_path == report.out_dir / "report" / "report.html" and report.report_path.exists()
    logged = {a.path for a in client.list_artifacts(report.parent_run_id, "report")}
    assert "report/report.html" in logged and any(p.endswith(".png") for p in logged)
    for e in ledger.search_entries():  # the space predicts (estimate: device auto): every ok trial has it
        if e.result.ok:
            assert {"predicted_peak_memory_gib", "memory_prediction_error"} <= set(e.predicted), e.predicted
        assert all(k.startswith("predicted_") or k.endswith("_prediction_error") for k in e.predicted)
    checks = json.loads((report.out_dir / "parity.json").read_text())
    winner = [c for c in checks if c["key"] == report.verdict.winner.key]
    assert len(winner) == 1 and winner[0]["passed"] is True and winner[0]["label"] == report.verdict.winner.label
    assert winner[0]["max_abs_loss_diff"] < 1e-4 and len(winner[0]["losses"]) == len(winner[0]["reference_losses"]) > 0
    assert winner[0]["proxy"] is None
