"""One interface for step-time models: predict a plan's step, observe a measured one, state the error.

`TimePredictor` is what a sweep's searcher and `paratune plan --profile` ask for a plan's step
time. Two models implement it: the calibrated one, composed from measured profiles
(paratune.costs.timemodel.StepTimeModel), and the roofline (`RooflinePredictor`, over
paratune.costs.estimate.Roofline), which the sweep falls back to when the cluster cannot be profiled.
Both answer with a `StepPrediction` and refit on every observed trial, so each prediction is the
one made before the trial ran (out of sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from paratune.config.plan import Plan

if TYPE_CHECKING:
    from paratune.costs.estimate import Roofline, TimeEstimate


@dataclass
class StepPrediction:
    """A plan's predicted step time, its tokens/s/GPU and the calibrated parts (seconds)."""

    step_s: float
    tokens_per_s_per_gpu: float
    parts: dict[str, float]
    profile_env: dict[str, str] = field(default_factory=dict)
    note: str | None = None  # e.g. "no profile for env ...: used the nearest"

    def time_estimate(self) -> "TimeEstimate":
        """As an estimate's time (paratune.costs.estimate.TimeEstimate): compute and communication
        from the parts (communication counted as exposed: the parts are what the step waits on)."""
        from paratune.costs.estimate import TimeEstimate

        comm = sum(v for k, v in self.parts.items() if k.endswith("_comm"))
        return TimeEstimate(compute_s=self.parts.get("compute", 0.0), comm_s=comm, exposed_comm_s=comm, bubble=0.0,
                            step_s=self.step_s, tokens_per_s_per_gpu=self.tokens_per_s_per_gpu)


@runtime_checkable
class TimePredictor(Protocol):
    """A step-time model a sweep refits as trials complete."""

    def predict(self, plan: Plan) -> StepPrediction:
        """The plan's step time, tokens/s/GPU and its parts, from what was observed so far."""
        ...

    def observe(self, plan: Plan, measured_step_s: float, routing_balance: float | None = None) -> dict[str, float]:
        """The prediction made before this trial beside its measured step (at least
        `predicted_step_time_s` and `step_time_prediction_error`), then refit on it; a MoE trial's
        measured `routing_balance` (max / mean tokens per expert) prices ep plans from then on."""
        ...

    def error_band(self) -> float:
        """The relative error a prediction is trusted to (the stopping rule's band)."""
        ...

    def summary(self) -> dict[str, float]:
        """Flat numbers for MLflow and the sweep's report."""
        ...


class RooflinePredictor:
    """The roofline (paratune.costs.estimate.Roofline) as a TimePredictor: what the calibrated search
    falls back to when the cluster cannot be profiled (sweep.RooflineTimeModel until the layout
    pass switches the sweep here)."""

    PRIOR_BAND = 0.25  # its out-of-sample median error was 18%, worst 35% (bench/results)

    def __init__(self, roofline: "Roofline"):
        self.roofline = roofline
        self.errors: list[float] = []

    @property
    def calibration(self) -> "Roofline":  # sweep.RooflineTimeModel's attribute name
        return self.roofline

    def predict(self, plan: Plan) -> StepPrediction:
        t = self.roofline.predict(plan).time
        parts = {"compute": t.compute_s / (1 - t.bubble), "exposed_comm": t.exposed_comm_s}
        parts["overhead"] = t.step_s - parts["compute"] - parts["exposed_comm"]
        return StepPrediction(step_s=t.step_s, tokens_per_s_per_gpu=t.tokens_per_s_per_gpu,
                              parts={k: v for k, v in parts.items() if v != 0.0})

    def observe(self, plan: Plan, measured_step_s: float, routing_balance: float | None = None) -> dict[str, float]:
        out = self.roofline.observe(plan, None, measured_step_s, routing_balance=routing_balance)
        self.errors.append(abs(out["step_time_prediction_error"]))
        return {"predicted_step_time_s": out["predicted_step_time_s"],
                "step_time_prediction_error": out["step_time_prediction_error"]}

    def error_band(self) -> float:
        if len(self.errors) < 3:
            return self.PRIOR_BAND
        return max(sorted(self.errors)[int(0.9 * (len(self.errors) - 1))], 0.05)

    def summary(self) -> dict[str, float]:
        return {"error_band": self.error_band()}
