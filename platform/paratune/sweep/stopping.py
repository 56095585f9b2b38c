"""When the calibrated search stops measuring: the plans predicted best first, until none left can win.

The step-time model (paratune.costs.timemodel, calibrated on a profile of the cluster and refitted on
every measured trial) predicts every plan's tokens/s/GPU with an error band it has measured on
the trials so far. The sweep measures the plan predicted fastest among those not yet measured,
and stops by a stated rule (`SweepStopRule`): once no unmeasured plan, even at its prediction
plus the model's error band, beats the incumbent plus the incumbent's noise band, measuring more
cannot change the winner except by luck the noise already covers.

Pure functions of keys and numbers, so the rule is tested without Ray and replayed by
bench/search_efficiency.py exactly as the sweep applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratune.costs.measure import noise_band


@dataclass(frozen=True)
class Incumbent:
    """The best plan measured so far (a full measurement, not one stopped early)."""

    key: str
    tokens_per_s_per_gpu: float
    spread: float = 0.0  # its (p90 - p10) / median

    @property
    def noise(self) -> float:
        return noise_band(self.spread)


@dataclass(frozen=True)
class Decision:
    stop: bool
    next_key: str | None
    reason: str


@dataclass(frozen=True)
class SweepStopRule:
    """What stops a sweep (measure.TrialStopRule stops one trial). Stop when every unmeasured plan
    satisfies predicted x (1 + error band) <= incumbent x (1 + incumbent noise): none can beat
    the incumbent by more than noise plus the model's error.
    `min_trials` full measurements come first (the band means little before the model has seen
    a trial), and the trial budget still caps the sweep."""

    min_trials: int = 2

    def can_win(self, predicted_tokens_per_s: float, incumbent: Incumbent, band: float) -> bool:
        return predicted_tokens_per_s * (1 + band) > incumbent.tokens_per_s_per_gpu * (1 + incumbent.noise)

    def decide(self, predicted: dict[str, float], done: set[str], pending: set[str], incumbent: Incumbent | None,
               band: float, measured_trials: int, label=lambda key: key) -> Decision:
        """The next plan to measure (the fastest predicted among those neither measured nor
        running), or stop with the reason. `predicted`: tokens/s/GPU per plan key."""
        open_keys = [k for k in predicted if k not in done and k not in pending]
        if not open_keys:
            return Decision(True, None, "every plan has been measured")
        best = max(open_keys, key=lambda k: predicted[k])
        if incumbent is None or measured_trials < self.min_trials or self.can_win(predicted[best], incumbent, band):
            return Decision(False, best, "")
        return Decision(True, None, (
            f"no unmeasured plan can win: the best of the {len(open_keys)} left, {label(best)}, is predicted at "
            f"{predicted[best]:,.0f} tokens/s/GPU; + the model's error band {band:.0%} = "
            f"{predicted[best] * (1 + band):,.0f} <= the incumbent {label(incumbent.key)} "
            f"{incumbent.tokens_per_s_per_gpu:,.0f} + its noise {incumbent.noise:.0%} = "
            f"{incumbent.tokens_per_s_per_gpu * (1 + incumbent.noise):,.0f}"))


