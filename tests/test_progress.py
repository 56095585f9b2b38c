"""The sweep's progress line, as pure functions: durations, the ETA from the pace so far, the
live line and the plain per-trial line (what `ray job logs` shows)."""

import io

from rich.console import Console

from paratune.out.progress import (
    ProgressDisplay,
    SweepProgress,
    eta_s,
    format_duration,
    format_progress,
    format_trial_line,
    progress_line,
    status_text,
)


def test_durations_are_short_and_unknowns_say_so():
    assert [format_duration(s) for s in (0, 45.4, 60, 185, 3600, 3725)] == ["0s", "45s", "1m00s", "3m05s", "1h00m",
                                                                          "1h02m"]
    assert format_duration(None) == format_duration(float("nan")) == format_duration(-1) == "?"


def test_eta_is_the_pace_of_the_finished_trials_times_what_is_left():
    assert eta_s(0, 8, 30.0) is None  # no trial finished: no pace yet
    assert eta_s(2, 8, 60.0) == 180.0  # 30 s per trial (concurrency included), 6 left
    assert eta_s(8, 8, 240.0) == 0.0
    assert eta_s(9, 8, 240.0) == 0.0  # never negative


def test_the_live_line_and_the_plain_trial_line_carry_the_same_fields():
    line = format_progress(3, 8, 1, 130.0, 220.0, "ddp mb4", 12345.6)
    assert line == "trials 3/8 | running 1 | elapsed 2m10s | ETA 3m40s | best ddp mb4: 12,346 tokens/s/GPU"
    assert format_progress(0, 8, 2, 5.0, None) == "trials 0/8 | running 2 | elapsed 5s | ETA ? | best -"
    plain = format_trial_line(3, 8, "ddp mb4", "12,346 tokens/s/GPU", "running 1 | elapsed 2m10s | ETA 3m40s | best -")
    assert plain == "trial 3/8 ddp mb4: 12,346 tokens/s/GPU | running 1 | elapsed 2m10s | ETA 3m40s | best -"
    assert format_trial_line(3, 8, "ddp mb4", "oom") == "trial 3/8 ddp mb4: oom"  # the live line shows the rest


def test_progress_counts_running_and_keeps_the_best_full_measurement():
    p = SweepProgress(total=4, started_at=1000.0)
    p.start("a")
    p.start("b")
    p.finish("a", "fsdp full", 900.0, full=True)
    p.finish("b", "zero 2", 5000.0, full=False)  # stopped early / failed: never the best
    f = p.fields(now=1060.0)
    assert (f["done"], f["running"], f["best_label"], f["best_value"]) == (2, 0, "fsdp full", 900.0)
    assert f["eta_s"] == 60.0  # 30 s per trial, 2 left
    assert progress_line(p, now=1060.0) == ("trials 2/4 | running 0 | elapsed 1m00s | ETA 1m00s | "
                                            "best fsdp full: 900 tokens/s/GPU")
    assert status_text(p, now=1060.0).startswith("running 0 | elapsed 1m00s")


def test_a_resumed_sweep_paces_only_the_trials_it_ran():
    p = SweepProgress(total=6, done=3, first_done=3, started_at=0.0)
    assert p.fields(now=50.0)["eta_s"] is None  # the 3 from the ledger took no time in this run
    p.finish(None, "ddp", 1.0, full=True)
    assert p.fields(now=50.0)["eta_s"] == 100.0  # 50 s for 1 trial, 2 left


def test_no_live_line_outside_a_terminal_only_the_final_figures():
    out = io.StringIO()
    p = SweepProgress(total=2)
    with ProgressDisplay(p, Console(file=out, width=20)) as display:
        assert not display.is_live
        p.finish(None, "ddp", 10.0, full=True)
    # The search ended after 1 of at most 2 trials (a stopping rule): nothing is left, on one line.
    assert out.getvalue().startswith("trials 1/2 | running 0 |") and "| ETA 0s |" in out.getvalue()
    assert out.getvalue().count("\n") == 1
