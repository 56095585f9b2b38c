"""Noise-aware verdict: rank plans by repeated measurements; differences inside the noise are ties,
and the simpler plan wins a tie."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from paratune.trial.results import TrialResult


def complexity(plan: dict[str, Any]) -> int:
    """How much machinery a plan uses: less sharding, no offload, defaults are simpler."""
    strategy = plan.get("strategy")
    score = {"ddp": 0, "fsdp": 2, "zero": 2}.get(strategy, 3)
    if strategy == "fsdp":
        f = plan["fsdp"]
        score += {"no_shard": 0, "grad_op": 1, "full": 2, "hybrid": 3}[f["sharding"]]
        score += 2 * bool(f.get("cpu_offload")) + bool(f.get("prefetch"))
    if strategy == "zero":
        z = plan["zero"]
        score += z["stage"] + 2 * bool(z.get("offload_optimizer")) + 2 * bool(z.get("offload_param"))
        score += bool(z.get("overlap_comm"))
    score += plan.get("activation_checkpointing", "none") != "none"
    score += len(plan.get("env") or {})
    return score


@dataclass
class Standing:
    """All measurements of one plan."""

    key: str
    label: str
    plan: dict[str, Any]
    results: list[TrialResult] = field(default_factory=list)

    @property
    def values(self) -> list[float]:
        return [r.tokens_per_s_per_gpu for r in self.results if r.ok and r.tokens_per_s_per_gpu]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    @property
    def band(self) -> float:
        """Absolute noise half-width: the larger of within-run step spread and across-run range."""
        if not self.values:
            return 0.0
        within = statistics.median(r.step_time_spread or 0.0 for r in self.results if r.ok)
        across = (max(self.values) - min(self.values)) / 2
        return max(self.median * within / 2, across)

    @property
    def relative_spread(self) -> float:
        return 2 * self.band / self.median if self.median else 0.0


@dataclass
class Verdict:
    ranked: list[Standing]  # best first
    winner: Standing | None
    tied_with_best: list[Standing]


def decide(standings: list[Standing]) -> Verdict:
    """Rank by median tokens/s/GPU; everything within the best's noise is a tie; simplest tied wins."""
    ok = sorted((s for s in standings if s.values), key=lambda s: -s.median)
    if not ok:
        return Verdict([], None, [])
    best = ok[0]
    tied = [s for s in ok if best.median - s.median <= best.band + s.band]
    winner = min(tied, key=lambda s: (complexity(s.plan), -s.median))
    return Verdict(ok, winner, tied)
