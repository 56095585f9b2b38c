"""How far a sweep is and when it will end: one line, live in a terminal, plain in a log.

A sweep runs for minutes to hours; without this the terminal shows only what each trial
measured, never how many are left. The figures (done/total, running, elapsed, ETA, best so
far) are kept in `SweepProgress` and formatted by pure functions (tests/test_progress.py), so
the live line (rich, in a terminal) and the plain lines (one per finished trial, as under `ray
job logs`, where a redrawn line would be noise) say the same thing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.text import Text


def format_duration(seconds: float | None) -> str:
    """45s, 3m05s, 1h02m: short enough for one line, exact enough to plan around."""
    if seconds is None or seconds != seconds or seconds < 0:  # None, NaN or negative: unknown
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    """Seconds until `total` trials are done, at the pace of the trials finished so far.

    The pace is elapsed time per finished trial, so concurrent trials and the time between
    trials (Tune, MLflow, worker-group reuse) are counted as they were. None before the first
    trial ends (no pace yet); 0 when nothing is left."""
    if done >= total:
        return 0.0
    if done <= 0 or elapsed_s <= 0:
        return None
    return elapsed_s / done * (total - done)


@dataclass
class SweepProgress:
    """The sweep's counters. `total` is the trial budget: the calibrated search may stop before
    it (its stopping rule), so the ETA is an upper bound there."""

    total: int
    done: int = 0  # finished trials of this run of the sweep (a resume counts from its ledger)
    started_at: float = field(default_factory=time.time)  # epoch s
    running: set[str] = field(default_factory=set)  # Tune trial ids
    best_label: str | None = None
    best_value: float | None = None
    first_done: int = 0  # trials already in the ledger when this run started (not in the pace)
    finished: bool = False  # the search ended (a calibrated one may stop before `total`): nothing left

    def start(self, trial_id: str) -> None:
        self.running.add(trial_id)

    def finish(self, trial_id: str | None, label: str, tokens_per_s: float | None, full: bool) -> None:
        """A trial ended; `full`: fully measured (only those can be the best so far)."""
        if trial_id is not None:
            self.running.discard(trial_id)
        self.done += 1
        if full and tokens_per_s and (self.best_value is None or tokens_per_s > self.best_value):
            self.best_label, self.best_value = label, float(tokens_per_s)

    def fields(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        elapsed = max(0.0, now - self.started_at)
        return {"done": self.done, "total": self.total, "running": len(self.running), "elapsed_s": elapsed,
                "eta_s": 0.0 if self.finished else eta_s(self.done - self.first_done, self.total - self.first_done,
                                                         elapsed),
                "best_label": self.best_label, "best_value": self.best_value}


def format_status(running: int, elapsed_s: float, eta: float | None, best_label: str | None = None,
                  best_value: float | None = None) -> str:
    """`running 1 | elapsed 2m10s | ETA 3m40s | best ddp ...: 1,234 tokens/s/GPU`."""
    eta_text = "ETA ?" if eta is None else f"ETA {format_duration(eta)}"
    best = f"best {best_label}: {best_value:,.0f} tokens/s/GPU" if best_label and best_value else "best -"
    return f"running {running} | elapsed {format_duration(elapsed_s)} | {eta_text} | {best}"


def format_progress(done: int, total: int, running: int, elapsed_s: float, eta: float | None,
                    best_label: str | None = None, best_value: float | None = None) -> str:
    """The live line: `trials 3/8 | running 1 | elapsed 2m10s | ETA 3m40s | best ...`."""
    return f"trials {done}/{total} | " + format_status(running, elapsed_s, eta, best_label, best_value)


def format_trial_line(number: int, total: int, label: str, what: str, status: str | None = None) -> str:
    """One finished trial; with `status` (format_status) when no live line shows it (not a terminal)."""
    line = f"trial {number}/{total} {label}: {what}"
    return f"{line} | {status}" if status else line


def progress_line(progress: SweepProgress, now: float | None = None) -> str:
    f = progress.fields(now)
    return f"trials {f['done']}/{f['total']} | " + status_text(progress, now)


def status_text(progress: SweepProgress, now: float | None = None) -> str:
    f = progress.fields(now)
    return format_status(f["running"], f["elapsed_s"], f["eta_s"], f["best_label"], f["best_value"])


class _Line:
    """A rich renderable that formats the line when drawn, so elapsed and ETA tick between trials."""

    def __init__(self, progress: SweepProgress):
        self.progress = progress

    def __rich__(self) -> Text:
        return Text(progress_line(self.progress), style="bold cyan")


class ProgressDisplay:
    """The live line in a terminal (rich Live, redrawn each second under the printed lines);
    nothing extra elsewhere: there every finished trial's line carries the same fields."""

    def __init__(self, progress: SweepProgress, console: Console):
        self.progress, self.console = progress, console
        self.live = None

    @property
    def is_live(self) -> bool:
        return self.live is not None

    def __enter__(self) -> "ProgressDisplay":
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            from rich.live import Live

            self.live = Live(_Line(self.progress), console=self.console, refresh_per_second=1, transient=True)
            self.live.start()
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.progress.finished = exc_type is None  # Tune returned: no trial is left to run
        if self.live is not None:
            self.live.stop()
            self.live = None
        self.console.print(progress_line(self.progress), soft_wrap=True)  # the final figures, in every mode
