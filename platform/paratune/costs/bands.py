"""How far a prediction is expected to be off: error bands measured against published runs.

`prediction_band(plan, device)` is the one place a plan's expected error is read (`paratune
plan` prints it, a sweep decides with it, `plan --compare` reads it). Tokens/s/GPU: the 80th
percentile of |predicted / published - 1| over the rows of the published corpus (bench/published/,
replayed by bench/published.py, which writes presets/prediction_bands.json) that share the plan's
kind (`band_categories`: float8 recipe, tp, pp, cp, checkpointing, compile), the widest of those
with MIN_ROWS rows or more, and at least the corpus's whole band, widened by the factor that makes
rows of another source on another device fall within it as often as it says (the file's
`out_of_sample_factor`). Memory: the memory model's error on paratune's own measured peaks
(GPU_MEMORY_BAND), the CUDA-only terms named apart. On the CPU entry (gloo workers): the CPU
benchmarks' own figures (CPU_BANDS). `memory_verdict` says whether a plan's predicted
peak is clear of the device's capacity, over it, or within its band of it (`tight`: the trial
settles it; an out-of-memory trial is data).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Literal

from paratune.config.devices import Device
from paratune.config.plan import Plan

BANDS_FILE = "presets/prediction_bands.json"
MIN_ROWS = 4  # a kind's band needs at least this many corpus rows, else the corpus's whole band
PERCENTILE = 0.8  # the share of rows a band covers (as paratune.costs.timemodel's error_band)
# The CPU entry (gloo workers, this machine's kind): the roofline's out-of-sample step-time error
# (paratune.costs.predict.RooflinePredictor.PRIOR_BAND: median 18%, worst 35% in bench/results), and
# the memory model's held-out worst (bench/results/estimate_accuracy.md, part 3: held-out
# families, -7.7% at its worst measurement).
CPU_BANDS = {"tokens": 0.25, "memory": 0.08}
# A plan's memory band on a GPU: the memory model's error on paratune's own measured peaks (the CPU
# trials' MemTracker peaks above: what it predicts is paratune's own code, the same on a GPU), the
# CUDA-only bytes counted as named point terms (paratune.costs.cuda_memory). No published run sets
# it: bench/published.py judges it on the runs whose code matches paratune's ("like for like").
GPU_MEMORY_BAND = CPU_BANDS["memory"]
GPU_MEMORY_BASIS = ("paratune's own measured peaks (held-out families, bench/results/estimate_accuracy.md) "
                    "+ named CUDA terms (paratune.costs.cuda_memory)")
Verdict = Literal["fits", "tight", "over"]


@dataclass(frozen=True)
class PredictionBand:
    """A prediction's expected relative error (|predicted / measured - 1| for 80% of the runs
    like it), for tokens/s/GPU and for peak memory per GPU, and which rows say so."""

    tokens: float
    memory: float
    tokens_basis: str
    memory_basis: str

    def tokens_text(self, value: float) -> str:
        """"1,030 tokens/s/GPU +- 9%"'s number part: "1,030 +-9%"."""
        return f"{value:,.0f} +-{self.tokens:.0%}"


def band_categories(plan: Plan) -> list[str]:
    """The kinds a plan belongs to, the keys of a band table ("all" first)."""
    out = ["all"]
    if plan.float8 != "none":
        out.append(f"float8:{plan.float8}")
    for degree in ("tp", "pp", "cp", "ep"):
        if getattr(plan, degree) > 1:
            out.append(degree)
    if plan.activation_checkpointing != "none":
        out.append(f"ac:{plan.activation_checkpointing}")
    if plan.compile:
        out.append("compile")
    return out


def percentile_band(errors: list[float], share: float = PERCENTILE) -> float:
    """The |error| `share` of the rows stay within (the nearest-rank percentile)."""
    values = sorted(abs(e) for e in errors)
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(share * len(values)) - 1))]


def bands_from_errors(rows: list[tuple[list[str], float]]) -> dict[str, dict]:
    """{category: {"band", "rows"}} from (categories, relative error) pairs."""
    by: dict[str, list[float]] = {}
    for categories, error in rows:
        for c in categories:
            by.setdefault(c, []).append(error)
    return {c: {"band": percentile_band(errs), "rows": len(errs)} for c, errs in sorted(by.items())}


@lru_cache(maxsize=1)
def _table() -> dict:
    try:
        return json.loads(resources.files("paratune").joinpath(BANDS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet: the CPU figures everywhere
        return {}


def pick_band(table: dict, categories: list[str], fallback: float, what: str = "it") -> tuple[float, str]:
    """(band, which rows) from a {category: {"band", "rows"}} table: the widest of the plan's
    categories with MIN_ROWS rows, "all" among them; `fallback` without an "all" row."""
    return _pick(table, categories, fallback, what)


def _pick(table: dict, categories: list[str], fallback: float, what: str) -> tuple[float, str]:
    usable = {c: table[c] for c in categories if c in table and table[c].get("rows", 0) >= MIN_ROWS
              and not math.isnan(table[c].get("band", math.nan))}
    if "all" not in usable:
        return fallback, f"no corpus band for {what}: the CPU benchmarks' {fallback:.0%}"
    widest = max(usable, key=lambda c: usable[c]["band"])
    sources = usable[widest].get("sources")
    # a kind all of whose rows come from one source: its band has met no other source's runs
    single = f" of one source ({sources[0]}): not judged out of sample" if sources and len(sources) == 1 else ""
    return usable[widest]["band"], f"{widest} ({usable[widest]['rows']} published rows{single})"


def prediction_band(plan: Plan, device: Device) -> PredictionBand:
    """The plan's expected error on the device: on a GPU the published corpus's band for the
    widest of its kinds (`band_categories`) with MIN_ROWS rows; on the CPU entry CPU_BANDS."""
    if device.name == "cpu" and device.gpu is None:
        return PredictionBand(CPU_BANDS["tokens"], CPU_BANDS["memory"], "CPU benchmarks (bench/results)",
                              "CPU held-out families (bench/results/estimate_accuracy.md)")
    table = _table().get("gpu", {})
    categories = band_categories(plan)
    tokens, tokens_basis = _pick(table.get("tokens", {}), categories, CPU_BANDS["tokens"], "tokens/s/GPU")
    return PredictionBand(tokens, GPU_MEMORY_BAND, tokens_basis, GPU_MEMORY_BASIS)


def memory_verdict(predicted_bytes: float, limit_bytes: float, band: float) -> Verdict:
    """"fits" when even band more than predicted fits the limit, "over" when even band less does
    not, else "tight" (within the band of the limit: only a trial can say)."""
    if predicted_bytes * (1 + band) <= limit_bytes:
        return "fits"
    if predicted_bytes * (1 - band) > limit_bytes:
        return "over"
    return "tight"


# The 80th percentile of |z| for a standard normal: a band that holds PERCENTILE of the rows is
# this many standard deviations of the (log) error wide.
_Z_AT_PERCENTILE = 1.2815515655446004


def fit_probability(predicted_bytes: float, limit_bytes: float, band: float) -> float:
    """The probability that a plan predicted to peak at `predicted_bytes` fits `limit_bytes`, its
    measured peak taken as predicted x exp(e) with e normal and |e| within log(1 + band) for
    PERCENTILE of plans (what the band states). 1 when there is no room for doubt (band 0 and
    under the limit), 0 above it."""
    if predicted_bytes <= 0:
        return 1.0
    if limit_bytes <= 0:
        return 0.0
    margin = math.log(limit_bytes / predicted_bytes)
    sigma = math.log1p(max(band, 0.0)) / _Z_AT_PERCENTILE
    if sigma <= 0:
        return 1.0 if margin >= 0 else 0.0
    return 0.5 * math.erfc(-margin / (sigma * math.sqrt(2)))
