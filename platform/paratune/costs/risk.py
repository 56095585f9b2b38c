"""Which plan to launch first when a launch may run out of memory: P(fits), expected gain, recalibration.

A sweep used to launch the plan predicted fastest first, and a plan within its memory band of the
capacity (`tight`) counts as worth a trial; so the fastest tight plan, often the one predicted
furthest over, went first, and on 32-512 GPUs each launch that runs out of memory costs minutes.
Here each plan worth a trial gets:

- P(fits): paratune.costs.bands.fit_probability of its predicted peak (the larger of the step's
  peak and construction's, times the sweep's memory scale for its kind: `MemoryCalibration`)
  against the capacity, within its memory band (0 for a plan the device refuses).
- An expected gain, in tokens/s/GPU (the model):

      expected_gain = P x tokens - (1 - P) x cost x reference

  `tokens`: its predicted tokens/s/GPU; `reference`: the best P x tokens among the plans on offer
  (what the time a doomed launch burns could have measured instead); `cost`: the share of a full
  trial's time a launch that runs out of memory burns (`oom_cost_share`: it dies in construction
  or the first step, after the launch, so (launch + one step) / (launch + warm-up and measured
  steps); on large clusters the launch dominates and the share is near 1). A plan that surely
  fits keeps its predicted speed; a plan at P = 0.5 with cost 1 is worth half its speed less half
  the best's.
- Not worth a launch first (`NOT_WORTH_A_LAUNCH` = 0.1): P(fits) below 0.1 is exactly a plan
  predicted over the capacity by more than its memory band (P = 0.1 at predicted = capacity x
  (1 + band): the band holds 80% of plans, so only the 10% tail the model over-predicts most
  could fit it). Such a plan goes after every other while a plan predicted to fit (P >= 0.5) is
  within its own tokens band of the best predicted speed: that plan may well be as fast, and
  measuring it costs no doomed launch. Without one it is ordered by its expected gain.

`order_by_expected_gain(estimates)` orders a space's estimates so (what
paratune.costs.estimate.estimate_space returns); `rank_launches` is the same on plain numbers (the
calibrated search's step-time model gives the speeds there). `MemoryCalibration` learns a memory
scale per plan kind from the sweep's trials: measured / predicted peaks, and the lower bound an
out-of-memory trial sets (its peak exceeded the capacity, so the scale >= capacity / predicted);
`LaunchRisk` re-judges the remaining plans with it before each launch. Pure: no Ray, no sweep.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Sequence

from paratune.config.plan import Plan
from paratune.costs.bands import band_categories, fit_probability, memory_verdict

# paratune.costs.estimate's Estimate and Roofline: not imported, not even for type checking, since
# estimate_space orders with this module (an import back is a cycle, tests/test_layout.py).
Estimate = Any
Roofline = Any

NOT_WORTH_A_LAUNCH = 0.1  # P(fits) below it: over the capacity by more than the memory band (see above)
PREDICTED_TO_FIT = 0.5  # P(fits) at or above it: the prediction itself is within the capacity
# A launch's time before the first step when no trial has measured one: Ray's worker group, the
# process group's rendezvous and the model's construction take minutes on 32-512 GPUs; 120 s is
# the low end. With it the cost share of an out-of-memory launch is near 1 for any GPU plan.
DEFAULT_LAUNCH_S = 120.0


# --------------------------------------------------------------------------- one plan
def judged_peak(e: Estimate) -> float:
    """The bytes a plan must hold at once: its step's peak or its construction's, the larger."""
    return max(e.memory.total, e.construction)


def tensor_limit(e: Estimate) -> float:
    """The bytes the plan's tensors get (the estimate's `tensor_limit_bytes`: the capacity less the
    CUDA context, NCCL's buffers and cuBLAS's workspace on a GPU; the skip rule's margin aside)."""
    return e.tensor_limit_bytes


def plan_fit_probability(e: Estimate, scale: float = 1.0) -> float:
    """P(fits) of an estimate: its peak (x the calibrated `scale`) against what its tensors get
    (`tensor_limit`) within its memory band; 0 for a plan the device refuses."""
    if e.refusal:
        return 0.0
    band = e.band.memory if e.band is not None else 0.0
    return fit_probability(judged_peak(e) * scale, tensor_limit(e), band)


def oom_cost_share(plan: Plan, step_s: float, launch_s: float = DEFAULT_LAUNCH_S) -> float:
    """The share of a full trial's time a launch that runs out of memory burns: it pays the launch
    and dies in construction or its first step, where a trial that fits runs its warm-up and
    measured steps: (launch + step) / (launch + steps x step)."""
    steps = max(1, plan.warmup_steps + plan.measure_steps)
    step_s = max(0.0, step_s if math.isfinite(step_s) else 0.0)
    whole = launch_s + steps * step_s
    return 1.0 if whole <= 0 else min(1.0, (launch_s + step_s) / whole)


def expected_gain(tokens: float, p_fits: float, cost: float, reference: float) -> float:
    """P x tokens - (1 - P) x cost x reference (the module's model)."""
    return p_fits * tokens - (1 - p_fits) * cost * reference


# --------------------------------------------------------------------------- an order
@dataclass(frozen=True)
class LaunchOption:
    """One plan on offer: `item` (an Estimate, a sweep's point key ...), its predicted speed and
    tokens band, P(fits), and the cost share of a launch that runs out of memory."""

    item: Any
    tokens: float
    tokens_band: float
    p_fits: float
    cost: float = 1.0


@dataclass(frozen=True)
class LaunchValue:
    """A plan as judged for launching: its option, expected gain, and whether it waits (`deferred`:
    not worth a launch while a plan predicted to fit may be as fast; `why` says so)."""

    option: LaunchOption
    expected_gain: float
    deferred: bool
    why: str = ""

    @property
    def item(self) -> Any:
        return self.option.item

    @property
    def predicted_over(self) -> bool:
        """The prediction itself (x the calibrated scale) is over the capacity (P(fits) < 0.5)."""
        return self.option.p_fits < PREDICTED_TO_FIT


def rank_launches(options: Sequence[LaunchOption], threshold: float = NOT_WORTH_A_LAUNCH) -> list[LaunchValue]:
    """Options in launch order: those worth a launch by expected gain (highest first, then faster),
    then the deferred ones (P(fits) < `threshold` while a plan predicted to fit is within its
    tokens band of the best speed on offer) the same way."""
    if not options:
        return []
    reference = max(o.p_fits * o.tokens for o in options)
    best = max(o.tokens for o in options)
    rival = next((o for o in sorted(options, key=lambda o: -o.tokens)
                  if o.p_fits >= PREDICTED_TO_FIT and o.tokens * (1 + o.tokens_band) >= best), None)
    judged = []
    for o in options:
        deferred = o.p_fits < threshold and rival is not None and rival is not o
        why = (f"P(fits) {o.p_fits:.0%} < {threshold:.0%} while a plan predicted to fit is within its tokens band "
               f"({rival.tokens_band:.0%}) of the best") if deferred else ""
        judged.append(LaunchValue(o, expected_gain(o.tokens, o.p_fits, o.cost, reference), deferred, why))
    return sorted(judged, key=lambda v: (v.deferred, -v.expected_gain, -v.option.tokens))


def premature_risky_launches(order: Sequence[LaunchValue]) -> list[tuple[int, int]]:
    """(position of a plan predicted over the capacity, position of a later plan predicted to fit
    within its tokens band of the best): the launches the order should not make. Empty is right."""
    if not order:
        return []
    best = max(v.option.tokens for v in order)
    fitting = [j for j, v in enumerate(order)
               if not v.predicted_over and v.option.tokens * (1 + v.option.tokens_band) >= best]
    return [(i, j) for i, v in enumerate(order) if v.predicted_over for j in fitting if j > i]


def estimate_options(estimates: Iterable[Estimate], calibration: MemoryCalibration | None = None,
                     launch_s: float | None = None) -> list[LaunchOption]:
    """LaunchOptions of estimates worth a trial (`Estimate.measurable`), P(fits) with the
    calibration's scale for each plan's kind (none: 1)."""
    launch = launch_s if launch_s is not None else (calibration.launch_s() if calibration else DEFAULT_LAUNCH_S)
    out = []
    for e in estimates:
        if not e.measurable:
            continue
        scale = calibration.scale(e.plan) if calibration is not None else 1.0
        out.append(LaunchOption(e, e.time.tokens_per_s_per_gpu, e.band.tokens if e.band is not None else 0.0,
                                plan_fit_probability(e, scale), oom_cost_share(e.plan, e.time.step_s, launch)))
    return out


def order_by_expected_gain(estimates: Iterable[Estimate], calibration: MemoryCalibration | None = None,
                           launch_s: float | None = None) -> list[Estimate]:
    """A space's estimates in launch order: those worth a trial (fit or tight) by expected gain,
    the not-worth-a-launch ones after them (`rank_launches`), then those that are not worth a
    trial, smallest predicted memory first (what estimate_space returns)."""
    estimates = list(estimates)
    ranked = [v.item for v in rank_launches(estimate_options(estimates, calibration, launch_s))]
    rest = sorted((e for e in estimates if not e.measurable), key=lambda e: e.memory.total)
    return ranked + rest


# --------------------------------------------------------------------------- recalibration
def plan_kind(plan: Plan) -> str:
    """A plan's memory kind: its band categories together (paratune.costs.bands.band_categories),
    e.g. "all" or "all+tp+ac:full": plans that the memory model treats alike."""
    return "+".join(band_categories(plan))


@dataclass
class MemoryCalibration:
    """The memory model's scale per plan kind (`plan_kind`), learnt from a sweep's trials.

    A measured peak gives the kind a ratio measured / predicted; a trial out of memory (its peak
    above the capacity) a lower bound capacity / predicted (and its ratio, when its peak was
    measured: a trial over the memory budget). A kind's scale is the median of its ratios, at
    least its lower bound. A kind with no trial yet takes the median ratio of every measured
    trial (the model's shared bias; an out-of-memory lower bound binds its own kind only), else 1.
    Launch times of the trials say what a doomed launch costs (`launch_s`)."""

    ratios: dict[str, list[float]] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    launches: list[float] = field(default_factory=list)

    def observe(self, plan: Plan, predicted_bytes: float, capacity_bytes: float,
                measured_peak_bytes: float | None = None, out_of_memory: bool = False,
                launch_s: float | None = None) -> dict[str, float]:
        """Take one trial in; returns the kind's scale before and after (for the trial's record)."""
        kind = plan_kind(plan)
        before = self.kind_scale(kind)
        if predicted_bytes > 0 and measured_peak_bytes:
            self.ratios.setdefault(kind, []).append(measured_peak_bytes / predicted_bytes)
        if out_of_memory and predicted_bytes > 0 and capacity_bytes > 0:
            self.floors[kind] = max(self.floors.get(kind, 0.0), capacity_bytes / predicted_bytes)
        if launch_s is not None and launch_s > 0:
            self.launches.append(float(launch_s))
        return {"memory_scale_before": before, "memory_scale_after": self.kind_scale(kind)}

    def kind_scale(self, kind: str) -> float:
        """The scale of one kind (see the class)."""
        own = self.ratios.get(kind)
        if own or kind in self.floors:
            return max(statistics.median(own) if own else 1.0, self.floors.get(kind, 0.0))
        pooled = [r for rs in self.ratios.values() for r in rs]
        return statistics.median(pooled) if pooled else 1.0

    def scale(self, plan: Plan) -> float:
        return self.kind_scale(plan_kind(plan))

    def launch_s(self) -> float:
        """The median launch a trial measured (a worker group reused costs less), else DEFAULT_LAUNCH_S."""
        return statistics.median(self.launches) if self.launches else DEFAULT_LAUNCH_S

    def summary(self) -> dict[str, float]:
        """{memory_scale[kind]: scale} of every kind with a trial, for MLflow."""
        return {f"memory_scale_{k.replace('+', '_').replace(':', '_')}": self.kind_scale(k)
                for k in sorted(set(self.ratios) | set(self.floors))}


class LaunchRisk:
    """A sweep's plans' launch risk, re-judged as trials come back: the roofline's estimate of each
    point (memory does not depend on the fitted time constants), a MemoryCalibration, and what was
    judged of each plan when it was launched (its record: P(fits), calibrated peak, scale)."""

    def __init__(self, roofline: Roofline, plans: dict[Hashable, Plan], margin: float = 0.0,
                 skip_predicted_oom: bool = True):
        by_structure: dict[str, Estimate] = {}  # env choices change no memory: one estimate for them all
        self.estimates: dict[Hashable, Estimate] = {}
        for key, plan in plans.items():
            structure = json.dumps({**plan.to_dict(), "env": None}, sort_keys=True, default=str)
            if structure not in by_structure:
                by_structure[structure] = roofline.predict(plan, margin)
            self.estimates[key] = by_structure[structure]
        self.calibration = MemoryCalibration()
        self.skip_predicted_oom = skip_predicted_oom
        self.at_launch: dict[Hashable, dict[str, float]] = {}
        self.observed: set[Hashable] = set()
        self.passed_over: dict[Hashable, str] = {}  # never launched: over once recalibrated (`skipped`)

    def p_fits(self, key: Hashable) -> float:
        e = self.estimates[key]
        return plan_fit_probability(e, self.calibration.scale(e.plan))

    def verdict(self, key: Hashable) -> str:
        """fits / tight / over of the calibrated peak (paratune.costs.bands.memory_verdict)."""
        e = self.estimates[key]
        if e.refusal:
            return "over"
        band = e.band.memory if e.band is not None else 0.0
        return memory_verdict(judged_peak(e) * self.calibration.scale(e.plan), tensor_limit(e), band)

    def skipped(self, keys: Iterable[Hashable]) -> dict[Hashable, str]:
        """The keys the calibrated memory now puts over the capacity beyond its band (skipped when
        the space skips predicted out-of-memory plans), with why."""
        if not self.skip_predicted_oom:
            return {}
        out = {}
        for key in keys:
            self.passed_over.pop(key, None)
            if key in self.estimates and self.verdict(key) == "over":
                e = self.estimates[key]
                scale = self.calibration.scale(e.plan)
                out[key] = (f"predicted {judged_peak(e) * scale / 2**30:.2f} GiB (x{scale:.2f}, the memory scale of its "
                            f"kind {plan_kind(e.plan)} after the sweep's trials) > {tensor_limit(e) / 2**30:.2f} GiB "
                            "beyond its band")
        self.passed_over.update(out)
        return out

    def order(self, tokens: dict[Hashable, float], keys: Iterable[Hashable], tokens_band: float) -> list[LaunchValue]:
        """`keys` in launch order (rank_launches), speeds from `tokens` (the search's model, with its
        error band), P(fits) from the calibrated memory."""
        launch = self.calibration.launch_s()
        options = []
        for key in keys:
            e = self.estimates.get(key)
            if e is None:
                options.append(LaunchOption(key, tokens[key], tokens_band, 1.0, 1.0))
                continue
            step_s = e.plan.tokens_per_step / max(tokens[key], 1e-12) / e.plan.num_workers
            options.append(LaunchOption(key, tokens[key], tokens_band, self.p_fits(key),
                                        oom_cost_share(e.plan, step_s, launch)))
        return rank_launches(options)

    def launched(self, key: Hashable, value: LaunchValue | None = None) -> dict[str, float]:
        """Record what was judged of `key` as it is launched (for its trial's record)."""
        e = self.estimates.get(key)
        if e is None:
            return {}
        scale = self.calibration.scale(e.plan)
        record = {"predicted_fit_probability": self.p_fits(key), "predicted_memory_scale": scale,
                  "predicted_peak_memory_calibrated_gib": judged_peak(e) * scale / 2**30,
                  "predicted_memory_limit_gib": tensor_limit(e) / 2**30}
        if value is not None:
            record["predicted_expected_gain"] = value.expected_gain
        self.at_launch[key] = record
        return record

    def observe(self, key: Hashable, measured_peak_bytes: float | None, out_of_memory: bool,
                launch_s: float | None = None) -> dict[str, float]:
        """Take a finished trial in (once per key): its measured peak, whether it ran out of memory."""
        e = self.estimates.get(key)
        if e is None or key in self.observed:
            return {}
        self.observed.add(key)
        return self.calibration.observe(e.plan, judged_peak(e), tensor_limit(e), measured_peak_bytes,
                                        out_of_memory, launch_s)
