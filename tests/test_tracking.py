"""MLflow bookkeeping against a real (SQLite) store: each trial once, whatever the driver went
through; no secret ever logged."""

import pytest

from paratune.plan import PlanError, load_plan_dict
from paratune.sweep import LedgerEntry
from paratune.tracking import SweepTracker, redact
from paratune.trial import TrialResult

from conftest import BASE_PLAN


def _result(ok: bool = True, message: str | None = None) -> TrialResult:
    plan = load_plan_dict(BASE_PLAN).to_dict()
    if ok:
        return TrialResult(status="ok", plan=plan, world_size=2, tokens_per_s_per_gpu=100.0, losses=[3.0, 2.0])
    return TrialResult.failed(plan, "error", message or "boom")


@pytest.fixture
def tracker(tmp_path):
    return SweepTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")


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
    entries = [LedgerEntry(n, f"k{n}", _result(ok=n != 3)) for n in (1, 2, 3)]
    assert tracker.sync_ledger(parent, entries) == 2
    assert _numbers(tracker, parent) == [("search", 1), ("search", 2), ("search", 3)]
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
