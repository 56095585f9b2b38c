"""MLflow bookkeeping against a real (SQLite) store: each trial once, whatever the driver went
through; no secret ever logged."""

import json
from pathlib import Path

import pytest

from paratune.config.plan import PlanError, load_plan_dict
from paratune.sweep.ledger import LedgerEntry
from paratune.out.tracking import SweepTracker, redact
from paratune.cluster.trial import TrialResult

from conftest import BASE_PLAN


def _result(ok: bool = True, message: str | None = None) -> TrialResult:
    plan = load_plan_dict(BASE_PLAN).to_dict()
    if ok:
        return TrialResult(status="ok", plan=plan, world_size=2, tokens_per_s_per_gpu=100.0, losses=[3.0, 2.0])
    return TrialResult.failed(plan, "error", message or "boom")


@pytest.fixture
def tracker(mlflow_uri):
    return SweepTracker(mlflow_uri)


def _numbers(tracker, parent):
    return sorted((r.data.tags["paratune.phase"], int(r.data.tags["paratune.trial_number"]))
                  for r in tracker.child_runs(parent))


def test_logging_a_trial_twice_keeps_one_run(tracker):
    parent = tracker.start_parent("s", None, {}, {})
    first = tracker.log_trial(parent, 1, _result())
    assert tracker.log_trial(parent, 1, _result()) == first
    tracker.log_trial(parent, 1, _result(), phase="remeasure")  # another phase: another run
    assert _numbers(tracker, parent) == [("remeasure", 1), ("search", 1)]


def test_resume_fills_what_the_killed_driver_missed_and_drops_partial_runs(tracker):
    parent = tracker.start_parent("s", None, {}, {})
    tracker.log_trial(parent, 1, _result())
    # Killed mid-logging: a run without the completion mark.
    tracker.client.create_run(tracker.experiment_id, tags={"mlflow.parentRunId": parent, "paratune.phase": "search",
                                                           "paratune.trial_number": "2"})
    # Trial 2 and 3 reached the ledger, not MLflow.
    entries = [LedgerEntry(n, f"k{n}", _result(ok=n != 3), predicted={"predicted_step_time_s": 0.1 * n})
               for n in (1, 2, 3)]
    assert tracker.sync_ledger(parent, entries) == 2
    assert _numbers(tracker, parent) == [("search", 1), ("search", 2), ("search", 3)]
    # What the cost model predicted before the trial ran comes along, as the live sweep logs it.
    filled = {int(r.data.tags["paratune.trial_number"]): r.data.metrics for r in tracker.child_runs(parent)}
    assert filled[2]["predicted_step_time_s"] == pytest.approx(0.2) and "predicted_step_time_s" not in filled[1]
    assert tracker.sync_ledger(parent, entries) == 0


def test_secrets_are_scrubbed_and_refused(tracker, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    text = "worker env: HF_TOKEN=hf_abcdefghijkl AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG NCCL_DEBUG=INFO"
    assert redact(text) == ("worker env: HF_TOKEN=<HF_TOKEN redacted> AWS_SECRET_ACCESS_KEY=<AWS_SECRET_ACCESS_KEY "
                            "redacted> NCCL_DEBUG=INFO")
    parent = tracker.start_parent("s", None, {}, {})
    run_id = tracker.log_trial(parent, 1, _result(ok=False, message=text))
    run = tracker.client.get_run(run_id)
    assert "hf_abcdefghijkl" not in str(run.data.tags) + str(run.data.params)
    for name in ("PARATUNE_HF_TOKEN", "NCCL_API_KEY", "TORCH_DISTRIBUTED_PASSWORD"):
        with pytest.raises(PlanError, match=f"env.{name}: looks like a credential"):
            load_plan_dict({**BASE_PLAN, "env": {name: "x"}})


def test_the_experiment_opens_as_model_training_and_trials_carry_their_own_times(tmp_path, mlflow_uri):
    """MLflow's UI decides how to open an experiment by its kind tag: a model-training experiment
    opens on its runs, not on a GenAI overview of traces. A child run spans the trial itself
    (started_at to started_at + wall_s), not the milliseconds it took to log it."""
    from paratune.out.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, start_training_run

    uri = mlflow_uri
    client = SweepTracker(uri).client
    client.set_experiment_tag(client.get_experiment_by_name("paratune").experiment_id, EXPERIMENT_KIND_TAG,
                              "genai_development")  # e.g. made by an older paratune, or by hand
    tracker = SweepTracker(uri)
    assert tracker.client.get_experiment(tracker.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert EXPERIMENT_KIND == "custom_model_development"
    other = start_training_run(uri, load_plan_dict(BASE_PLAN), "x", 10, 5, experiment="training")
    assert client.get_experiment(client.get_run(other).info.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND

    parent = tracker.start_parent("s", None, {}, {})
    result = _result().model_copy(update={"started_at": 1_700_000_000.25, "wall_s": 42.5, "mfu": 0.1,
                                          "peak_memory_bytes": [2**30, 3 * 2**29], "step_time_spread": 0.05})
    run = tracker.client.get_run(tracker.log_trial(parent, 1, result))
    assert (run.info.start_time, run.info.end_time) == (1_700_000_000_250, 1_700_000_042_750)  # ms
    # What a user compares, top level and named alike on every trial.
    assert {"tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "step_time_spread"} <= set(run.data.metrics)
    assert run.data.metrics["peak_memory_gib"] == 1.5
    refused = TrialResult.failed(result.plan, "insufficient_resources", "no node")  # never launched: no times
    run = tracker.client.get_run(tracker.log_trial(parent, 2, refused))
    assert run.info.end_time >= run.info.start_time > 1_700_000_000_250


def test_the_parent_describes_the_winner_and_how_to_train_with_it(tracker, tmp_path):
    from paratune.out.export import export_winner
    from paratune.out.tracking import NOTE_TAG, sweep_note

    winner_dir = tmp_path / "sweep" / "winner"
    summary = {"label": "fsdp full mb4", "tokens_per_s_per_gpu_median": 12345.6, "relative_spread": 0.08,
               "measurements": 3, "mfu": 0.0123, "peak_memory_bytes": [2**30, 2**31], "parity_max_abs_loss_diff": 2e-6,
               "tied_with": ["fsdp full mb4"], "parity_bound": "4 x the largest deviation, step by step, of 9 runs"}
    export_winner(load_plan_dict(BASE_PLAN), winner_dir, summary)
    parent = tracker.start_parent("s", None, {}, {})
    note = sweep_note(summary, winner_dir, [{"label": "zero 3", "reason": "max |loss - reference| 0.2 over 1e-4"}])
    tracker.finish_parent(parent, {"tokens_per_s_per_gpu": 12345.6, "mfu": 0.0123, "peak_memory_gib": 2.0,
                                   "step_time_spread": 0.05}, load_plan_dict(BASE_PLAN).to_dict(), winner_dir,
                          note=note)
    run = tracker.client.get_run(parent)
    text = run.data.tags[NOTE_TAG]
    assert "**Winner: fsdp full mb4**" in text and "12,346 tokens/s/GPU" in text and "±4.0%" in text
    assert "MFU 1.23%" in text and "peak memory 2.00 GiB per rank" in text and "zero 3" in text
    assert "max |Δ| 2.0e-06, within the model's rounding envelope (4 x the largest deviation" in text
    assert "Tied" not in text  # only with itself
    assert text.index("Train with it") < text.index("zero 3")  # the commands before the detail
    plan = str((winner_dir / "plan.yaml").resolve())
    assert f"-- python -m paratune train {plan} --steps 1000 --checkpoint-every 100" in text  # on the cluster
    assert f"paratune train {plan} --steps 1000" in text  # where the sweep ran
    assert {"best_tokens_per_s_per_gpu", "best_mfu", "best_peak_memory_gib", "best_step_time_spread"} <= \
        set(run.data.metrics)
    tracker.add_to_note(parent, "Report: `report/report.html`")
    tracker.add_to_note(parent, "Report: `report/report.html` again")  # written twice: said once
    text = tracker.client.get_run(parent).data.tags[NOTE_TAG]
    assert text.count("Report:") == 1 and text.endswith("again") and text.startswith("**Winner")
    assert sweep_note(None, None).startswith("**No winner**")


def test_the_winners_commands_fit_where_the_sweep_ran(tmp_path, monkeypatch):
    """winner/train.sh trains where the sweep ran with `paratune` as the shell finds it; winner/job.sh
    submits to the Ray cluster with paratune's own entry point and the driver's environment inline,
    so it needs nothing from the directory it is typed in (no jobs/ folder, no runtime-env file)."""
    import shlex
    import sys

    from paratune.out.export import export_winner, on_a_cluster, own_command

    monkeypatch.setenv("PARATUNE_HOME", "/data/paratune_runs")
    monkeypatch.delenv("PARATUNE_STORAGE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the venv not activated: its script's full path
    winner = tmp_path / "sweep" / "winner"
    export_winner(load_plan_dict(BASE_PLAN), winner, {"label": "ddp"})
    plan = str((winner / "plan.yaml").resolve())
    train = shlex.split((winner / "train.sh").read_text().splitlines()[-1])
    assert train[:3] == [own_command(), "train", plan] and own_command() == str(Path(sys.executable).parent / "paratune")
    job = (winner / "job.sh").read_text().splitlines()[-1]
    words = shlex.split(job)
    assert words[:5] == ["ray", "job", "submit", "--address", "http://127.0.0.1:8265"]
    assert json.loads(words[words.index("--runtime-env-json") + 1]) == {"env_vars": {"PARATUNE_HOME": "/data/paratune_runs"}}
    assert words[words.index("--") + 1:][:5] == ["python", "-m", "paratune", "train", plan]
    for address, joined in (("127.0.0.1:6379", True), ("local", False), ("", False)):
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert on_a_cluster() is joined
