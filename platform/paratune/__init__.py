"""paratune: find the fastest parallel training configuration that still trains correctly.

The public API (what the README documents; everything else may change between releases):

    plan = paratune.load_plan("plan.yaml")              # or load_plan_dict({...}); Plan, PlanError
    paratune.check_plan(plan)                            # every rule a trial checks before launch: PlanError
    space = paratune.load_space("space.yaml")            # Space
    result = paratune.run_trial(plan)                    # TrialResult: tokens/s/GPU, memory, losses
    outcome = paratune.run_sweep(space, Path("out"))     # SweepOutcome: the winner and its files
    guess = paratune.estimate(plan, paratune.load_devices()["h100-sxm"])  # Estimate, no GPU needed
    check = paratune.winner_parity(plan, result)         # Parity: the plan's losses against one process

Each name is imported on first use, so `import paratune` stays light (no torch, no Ray) for the
commands that need neither.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

__version__ = "0.1.0"

# Ray 2.49-2.50 run Train V2 only with this documented switch set before ray.train is imported (2.51+
# default it on); paratune's API (ray.train.UserCallback, FailureConfig(controller_failure_limit),
# Tune function trainables launching a TorchTrainer) is V2's. Ray Tune hands it on to its trainables.
_os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

# public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "Plan": "paratune.config.plan", "PlanError": "paratune.config.plan", "load_plan": "paratune.config.plan",
    "load_plan_dict": "paratune.config.plan", "check_plan": "paratune.checks.refusals",
    "Space": "paratune.sweep.space", "load_space": "paratune.sweep.space",
    "run_trial": "paratune.cluster.trial", "TrialResult": "paratune.trial.results",
    "run_sweep": "paratune.sweep.driver", "SweepOutcome": "paratune.sweep.finish",
    "estimate": "paratune.costs.estimate", "Estimate": "paratune.costs.estimate",
    "load_devices": "paratune.config.devices", "Device": "paratune.config.devices",
    "winner_parity": "paratune.sweep.parity", "Parity": "paratune.sweep.parity",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    try:
        module = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'paratune' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
