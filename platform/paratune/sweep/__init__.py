"""The sweep: Ray Tune + Optuna over a space's valid plans, every trial in MLflow, a winner ready to use.

The package's modules, one job each:
    ledger     the record of finished trials and how a trial is scored (no Ray)
    stopping   when the calibrated search stops measuring (SweepStopRule)
    searchers  what to measure next: the candidate tree, the Optuna and calibrated searchers
    cluster    where trials run: the Tune trainable, the worker-group pool, node leases, pruning
    callbacks  Ray Tune's callbacks: each finished trial into the ledger and MLflow
    driver     run_sweep and the Tune run of its trials (SweepSettings)
    finish     re-measure, the winner by noise and loss parity, export, the last MLflow writes
    folder, figures, page   the sweep report (HTML) from the sweep folder alone (no Ray)

The old `paratune.sweep` names stay importable from here, each loaded on first use (PEP 562),
so `import paratune.sweep.page` (the `paratune report` path) never loads Ray Tune.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module in this package, or a full module path; its name there)
_MOVED: dict[str, tuple[str, str]] = {
    **{name: ("ledger", name) for name in (
        "OBJECTIVE", "SweepError", "point_key", "candidate_key", "LedgerEntry", "Ledger", "unscored",
        "objective_value", "incumbent_of", "stop_rule_for", "apply_budget", "predicted_only",
        "observe_calibration", "log_trial_or_say")},
    **{name: ("stopping", name) for name in ("Incumbent", "Decision", "SweepStopRule", "StoppingRule")},
    **{name: ("searchers", name) for name in (
        "all_points", "CandidateTree", "optuna_searcher", "TimePredictions",
        "calibrated_searcher", "env_suffix")},
    **{name: ("cluster", name) for name in (
        "measure_plan", "trainable", "pool_measure", "start_pool", "close_pool", "start_leases", "close_leases",
        "prune_unplaceable", "concurrency", "device_tag", "pool_runner")},
    **{name: ("callbacks", name) for name in ("LedgerCallback", "QuietTuneOutput")},
    **{name: ("driver", name) for name in (
        "run_sweep", "SweepSettings", "SweepRun")},
    **{name: ("finish", name) for name in (
        "SweepOutcome", "SweepReport", "finish_sweep", "log_sweep_end", "write_page", "write_report")},
    **{name: ("paratune.parity", name) for name in (
        "parity_tolerance", "Parity", "PARITY_MAX_REFERENCE_PARAMS", "PROXY_HEAD_DIM", "PROXY_VOCAB", "PROXY_SEQ_LEN",
        "PER_LAYER_KEYS", "proxy_shape", "parity_proxy", "winner_parity")},
}


def __getattr__(name: str) -> Any:
    """An old `paratune.sweep.NAME`, from the module it moved to (imported now, not before)."""
    try:
        module, attr = _MOVED[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    where = module if "." in module else f"{__name__}.{module}"
    value = getattr(importlib.import_module(where), attr)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MOVED})
