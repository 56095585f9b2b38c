"""Your own training loop, tuned (paratune.trial.user_loop): the session's timing rules on a real
one-process gloo group, the refusals before launch, and the example loop swept over ddp and
fsdp on Ray with a loop that raises beside it, ranked and logged to MLflow."""

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient

from paratune import cli
from paratune.costs import measure
from paratune.trial import user_loop
from paratune.config.plan import load_plan_dict
from paratune.sweep.space import space_from_dict, with_train_loop
from paratune.cluster.trial import check_before_launch

REPO = Path(__file__).resolve().parents[1]
HERE = str(Path(__file__).resolve().parent)
EXAMPLE = "examples.user_loop.train:loop"
FAILING = "examples.user_loop.train:failing_loop"
FIXED = {"model": "tiny-llama", "num_workers": 2, "device": "cpu", "seq_len": 32, "global_batch": 4,
         "micro_batch": 2, "warmup_steps": 1, "measure_steps": 2, "trial_timeout_s": 300}


# --------------------------------------------------------------------------- session API, one process
def sleepy_loop(config):
    """Step i sleeps 10 ms x (i + 1) and logs loss i."""
    for step in user_loop.steps():
        time.sleep(0.01 * (step + 1))
        user_loop.log_loss(float(step))


def quitting_loop(config):
    for step in user_loop.steps():
        if step == 1:
            break


def idle_loop(config):
    return None


@pytest.fixture
def one_rank(tmp_path):
    """A real gloo group of one process (the session's collectives run on it)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _plan(loop: str, **fields):
    env = {user_loop.TRAIN_LOOP_ENV: loop, user_loop.TRAIN_LOOP_PATH_ENV: HERE}
    return load_plan_dict({**FIXED, "num_workers": 1, "env": env, **fields})


def test_steps_time_measured_steps_only_and_keep_losses(one_rank):
    plan = _plan(f"{__name__}:sleepy_loop", warmup_steps=2, measure_steps=3)
    out = user_loop.run(plan, 0, 1, torch.device("cpu"))
    assert len(out["step_times_s"]) == 3  # the 2 warm-up steps are not measured
    for i, t in enumerate(out["step_times_s"]):  # measured step i is step i + 2: sleeps (i + 3) x 10 ms
        assert 0.01 * (i + 3) <= t < 0.01 * (i + 3) + 0.05
    assert out["losses"] == [0.0, 1.0, 2.0, 3.0, 4.0] and out["stopped_early"] is False
    assert out["first_step_epoch_s"] is not None and out["peak_memory_bytes"][0] > 0


def test_steps_stop_early_when_the_incumbent_is_out_of_reach(one_rank):
    plan = _plan(f"{__name__}:sleepy_loop", warmup_steps=1, measure_steps=5)
    rule = measure.TrialStopRule(incumbent_tokens_per_s_per_gpu=1e12, min_steps=2)
    out = user_loop.run(plan, 0, 1, torch.device("cpu"), stop_rule=rule)
    assert out["stopped_early"] is True and len(out["step_times_s"]) == 2
    assert out["memory_window_steps"] == [1, 2]  # the allocator's window: the measured steps run


def test_the_peak_window_is_the_trials_measured_steps(one_rank):
    """The GPU allocator's peak of a user loop covers what a trial's covers: reset after warm-up
    (not before the loop builds its model), read after the last measured step."""
    plan = _plan(f"{__name__}:sleepy_loop", warmup_steps=2, measure_steps=3)
    out = user_loop.run(plan, 0, 1, torch.device("cpu"))
    assert out["memory_window_steps"] == [2, 4]


def sharded_loop(config):
    """The example's model, prepared (FSDP2 under an fsdp plan) and stepped."""
    from paratune.model.build import build_config, build_model

    plan = user_loop.plan()
    config = build_config(plan.model, plan.model_overrides)
    model, optimizer = user_loop.prepare(build_model(config, seed=plan.seed), torch.optim.AdamW)
    batches = user_loop.batches(config.vocab_size)
    for step in user_loop.steps():
        for ids in batches(step):
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        user_loop.log_loss(0.0)


@pytest.mark.parametrize("strategy, moved_whole", [("fsdp", False), ("ddp", True)])
def test_fsdp_prepare_shards_the_model_where_it_was_built(one_rank, monkeypatch, strategy, moved_whole):
    """FSDP2 moves each unit's states to the mesh's device as it shards it, so `prepare` must not
    move the whole model first (on a GPU that put the unsharded model into the peak). A CPU device
    cannot show where bytes land; what is checked is that the root is never moved whole under
    fsdp (DDP replicates: there it is)."""
    moved: list[str] = []
    real_to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        moved.append(type(self).__name__)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    out = user_loop.run(_plan(f"{__name__}:sharded_loop", strategy=strategy), 0, 1, torch.device("cpu"))
    assert len(out["step_times_s"]) == 2
    assert ("LlamaForCausalLM" in moved) is moved_whole, moved


@pytest.mark.parametrize("loop, match", [("quitting_loop", "after 1 of 3 steps"), ("idle_loop", "ran no step")])
def test_a_loop_that_skips_steps_is_an_error(one_rank, loop, match):
    with pytest.raises(user_loop.UserLoopError, match=match):
        user_loop.run(_plan(f"{__name__}:{loop}"), 0, 1, torch.device("cpu"))


def test_session_api_outside_a_trial_says_so():
    with pytest.raises(user_loop.UserLoopError, match="no trial is running"):
        user_loop.plan()


# --------------------------------------------------------------------------- refused before launch
@pytest.mark.parametrize("fields, field", [({"strategy": "zero"}, "strategy: 'zero'"), ({"tp": 2}, "tp: 2"),
                                           ({"activation_checkpointing": "full"}, "activation_checkpointing")])
def test_plans_a_user_loop_cannot_take_are_invalid_before_launch(fields, field):
    result = check_before_launch(_plan(EXAMPLE, **{**fields, "num_workers": 2}))
    assert result.status == "failed" and result.reason == "invalid_config"
    assert field in result.message and "allowed with --train-loop" in result.message


@pytest.mark.parametrize("value, says", [("no_colon", "got 'no_colon'"),
                                         ("nosuch_pkg.train:loop", "cannot be imported"),
                                         ("examples.user_loop.train:nope", "has no function 'nope'")])
def test_bad_train_loop_is_refused_before_launch(tmp_path, capsys, monkeypatch, value, says):
    monkeypatch.chdir(REPO)
    out = tmp_path / "sweep"
    rc = cli.main(["tune", str(REPO / "examples/user_loop/space.yaml"), "--train-loop", value, "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 2 and "--train-loop" in text and says in text and "allowed" in text
    assert not out.exists()  # nothing started: no sweep folder


# --------------------------------------------------------------------------- a real sweep on Ray
# `e2e` (make test-e2e): `make test` keeps the session's timing rules on a real gloo group (above) and a
# sweep on Ray ranked and logged to MLflow (test_sweep).
@pytest.mark.integration
@pytest.mark.e2e
def test_example_loop_swept_over_ddp_and_fsdp_ranked_and_logged(ray_local, tmp_path, mlflow_uri, monkeypatch):
    from paratune.cluster.pool import get_pool_actor
    from paratune.sweep.driver import run_sweep

    monkeypatch.chdir(REPO)
    space = space_from_dict({"name": "user-loop", "fixed": {**FIXED, "profile_comm": False},
                             "space": {"strategy": {"ddp": {}, "fsdp": {}},
                                       "env": {user_loop.TRAIN_LOOP_ENV: [EXAMPLE, FAILING]}},
                             "search": {"algorithm": "grid", "trials": 4, "top_k": 2, "remeasure_rounds": 0}})
    space = with_train_loop(space, EXAMPLE)  # the import check; the path every worker imports from
    # (space.env sweeps the loop itself: the example and one that raises, beside each other)
    assert all(c.plan.env[user_loop.TRAIN_LOOP_PATH_ENV] == str(REPO) for c in space.candidates)
    name = "paratune-test-user-loop-pool"
    actor = get_pool_actor(name)
    try:
        outcome = run_sweep(space, tmp_path / "sweep", tracking_uri=mlflow_uri, pool=name, report_page=False)
    finally:
        ray_local.get(actor.close.remote())
        ray_local.kill(actor)
    results = [e.result for e in outcome.entries]
    assert len(results) == 4
    by = {(r.plan["strategy"], r.plan["env"][user_loop.TRAIN_LOOP_ENV]): r for r in results}
    for strategy in ("ddp", "fsdp"):
        ok = by[(strategy, EXAMPLE)]
        assert ok.ok and ok.tokens_per_s_per_gpu > 0 and len(ok.step_times_s) == 2 and len(ok.losses) == 3
        assert all(0 < loss < 20 for loss in ok.losses) and ok.optimizer_class == "AdamW"
        bad = by[(strategy, FAILING)]
        assert bad.status == "failed" and bad.reason == "error" and "user loop failed at step 1" in bad.message
    fsdp, ddp = by[("fsdp", EXAMPLE)], by[("ddp", EXAMPLE)]
    assert fsdp.local_parameter_counts[0] < ddp.local_parameter_counts[0]  # fsdp sharded the loop's model
    assert abs(fsdp.losses[0] - ddp.losses[0]) < 1e-3  # the same training, either layout
    assert outcome.verdict is not None and outcome.verdict.winner is not None
    assert outcome.verdict.winner.plan["env"][user_loop.TRAIN_LOOP_ENV] == EXAMPLE
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(outcome.parent_run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{outcome.parent_run_id}'"
                                  " and tags.`paratune.phase` = 'search'")
    statuses = sorted(r.data.tags["paratune.status"] for r in children)
    assert statuses == ["failed", "failed", "ok", "ok"]
