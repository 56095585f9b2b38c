"""What the sweep measures next: the candidate tree, the Optuna searcher and the calibrated searcher.

A searcher is a Ray Tune Searcher (imported when one is built, so the tree and the time models
load without Ray Tune). The Optuna searcher (TPE or random) never proposes a point twice and
warm-starts from the ledger; the calibrated searcher measures next the plan of highest expected
gain (the step-time model's speed x P(fits), paratune.costs.risk, its memory re-judged on every
trial's peak and out-of-memory failure) and stops by paratune.sweep.stopping's rule.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

from paratune.config.plan import Plan, load_plan_dict
from paratune.costs.risk import LaunchRisk
from paratune.sweep.space import Space
from paratune.sweep.ledger import (OBJECTIVE, Ledger, apply_budget, incumbent_of, objective_value, point_key,
                                   stop_rule_for, unscored)
from paratune.sweep.stopping import SweepStopRule
from paratune.out.tables import env_label, strategy_label, varying_env
from paratune.trial.results import TrialResult


# --------------------------------------------------------------------------- points
def all_points(space: Space) -> list[dict[str, Any]]:
    """Every proposable point: valid structural candidates x env combinations (the grid)."""
    return [{"choices": c.choices, "env": env} for c in space.candidates for env in space.env_grid()]


class CandidateTree:
    """The valid candidates as a tree of knobs, walked one knob at a time.

    Each knob is offered only the values that still lead to a valid plan given the choices
    above it, so a walk can only end at a statically valid plan. A knob whose offered values
    are restricted gets its own parameter name, since Optuna needs one fixed set of choices
    per name.
    """

    def __init__(self, space: Space):
        self.space = space
        self.candidates = [c.choices for c in space.candidates]
        self.dims: list[str] = []
        for c in self.candidates:
            self.dims.extend(d for d in c if d not in self.dims)
        self.full = {d: sorted({json.dumps(c[d]) for c in self.candidates if d in c}) for d in self.dims}

    def walk(self, pick: Callable[[str, str, list[str]], str]) -> dict[str, Any]:
        """pick(knob, param_name, offered JSON values) -> the chosen JSON value."""
        remaining = self.candidates
        for dim in self.dims:
            offered = sorted({json.dumps(c[dim]) for c in remaining if dim in c})
            if not offered:
                continue
            name = dim.replace(".", ":") + ("" if offered == self.full[dim] else "|" + ",".join(offered))
            value = pick(dim, name, offered)
            remaining = [c for c in remaining if json.dumps(c.get(dim)) == value]
        return remaining[0]

    def define_by_run(self) -> Callable:
        """An Optuna define-by-run space that can only produce statically valid plans."""

        def sample(trial) -> dict[str, Any]:
            choices = self.walk(lambda dim, name, offered: trial.suggest_categorical(name, offered)
                                if len(offered) > 1 else offered[0])
            env = {k: trial.suggest_categorical(f"env:{k}", [str(v) for v in vs]) if len(vs) > 1 else str(vs[0])
                   for k, vs in self.space.env_choices.items()}
            return {"point": point_key(choices, env)}

        return sample

    def optuna_params(self, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(params, distributions) under which define_by_run yields `key`: to replay a known point."""
        from optuna.distributions import CategoricalDistribution

        point = json.loads(key)
        params: dict[str, Any] = {}
        dists: dict[str, Any] = {}

        def pick(dim: str, name: str, offered: list[str]) -> str:
            value = json.dumps(point["choices"][dim])
            if len(offered) > 1:
                params[name], dists[name] = value, CategoricalDistribution(offered)
            return value

        self.walk(pick)
        for k, vs in self.space.env_choices.items():
            if len(vs) > 1:
                params[f"env:{k}"] = point["env"][k]
                dists[f"env:{k}"] = CategoricalDistribution([str(v) for v in vs])
        return params, dists


# --------------------------------------------------------------------------- Optuna
def optuna_searcher(space: Space, algorithm: str, seed: int, ledger: Ledger, budget_gb: float | None, trials: int,
                    first: list[str] | None = None, early_stop_steps: int | None = None):
    """OptunaSearch (TPE or random) that never proposes a point twice, starts from the ledger and
    then measures `first` (the plans predicted fastest) before sampling."""
    import optuna
    from ray.tune.search import Searcher
    from ray.tune.search.optuna import OptunaSearch

    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(5, trials // 3)))
               if algorithm == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    every_point = [point_key(p["choices"], p["env"]) for p in all_points(space)]
    tree = CandidateTree(space)
    fallback = random.Random(seed)

    class DedupOptunaSearch(OptunaSearch):
        def __init__(self) -> None:
            super().__init__(space=tree.define_by_run(), metric=OBJECTIVE, mode="max", sampler=sampler)
            self.known: dict[str, float] = {}  # point -> objective of finished trials
            self.results: dict[str, TrialResult] = {}  # point -> finished trial (for the incumbent)
            self.pending: set[str] = set()
            for entry in ledger.search_entries():  # warm start: finished trials go into the study
                if unscored(entry.result):
                    continue  # the cluster failed it: not a value of the plan (resume re-runs it)
                value = objective_value(entry.result, budget_gb)
                params, dists = tree.optuna_params(entry.key)
                self._ot_study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value))
                self.known[entry.key] = value
                self.results[entry.key] = entry.result
            for key in first or []:
                if key not in self.known:
                    self._ot_study.enqueue_trial(tree.optuna_params(key)[0])

        def save(self, checkpoint_path: str) -> None:
            """No Tune checkpoint of the searcher: paratune resumes from its ledger instead."""

        def restore(self, checkpoint_path: str) -> None:
            """See save()."""

        def suggest(self, trial_id: str):
            config = self._suggest(trial_id)
            if isinstance(config, dict) and early_stop_steps:
                config["stop_rule"] = stop_rule_for(incumbent_of(self.results, budget_gb), early_stop_steps)
            return config

        def _suggest(self, trial_id: str):
            untried = [k for k in every_point if k not in self.known and k not in self.pending]
            if not untried:
                return Searcher.FINISHED
            for attempt in range(50):
                alt = f"{trial_id}~{attempt}"
                config = super().suggest(alt)
                key = config["point"]
                if key in self.known:  # tell the study what it already knows, ask again
                    super().on_trial_complete(alt, {OBJECTIVE: self.known[key]})
                    continue
                if key in self.pending:
                    self._ot_study.tell(self._ot_trials.pop(alt), state=optuna.trial.TrialState.FAIL)
                    continue
                self._ot_trials[trial_id] = self._ot_trials.pop(alt)
                self.pending.add(key)
                return {"point": key}
            # The sampler keeps returning tried points: hand it an untried one (as it would a warm
            # start) so the budget is spent on new measurements.
            key = fallback.choice(untried)
            self._ot_study.enqueue_trial(tree.optuna_params(key)[0])
            config = super().suggest(trial_id)
            self.pending.add(config["point"])
            return {"point": config["point"]}

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
            value = 0.0
            key = None
            if result and "trial_result" in result:
                tr = TrialResult.model_validate_json(result["trial_result"])
                value = objective_value(tr, budget_gb)
                key = result.get("point")
                if unscored(tr) and trial_id in self._ot_trials:  # the cluster failed it: a failed
                    # Optuna trial (TPE ignores it), not a plan worth 0; never proposed again here
                    self._ot_study.tell(self._ot_trials.pop(trial_id), state=optuna.trial.TrialState.FAIL)
                    self.pending.discard(key)
                    self.known[key] = value
                    return
            super().on_trial_complete(trial_id, {OBJECTIVE: value})
            if key:
                self.pending.discard(key)
                self.known[key] = value
                self.results[key] = tr

    return DedupOptunaSearch()


# --------------------------------------------------------------------------- calibrated search
class TimePredictions:
    """The sweep's step-time model over its points, shared by the searcher (what to measure
    next) and the ledger callback (predicted beside measured in MLflow): each trial is observed
    once, and its prediction is the one made before it ran (out of sample)."""

    def __init__(self, model, plans: dict[str, dict[str, Any]], source: str):
        self.model, self.source = model, source
        self.plans = {key: load_plan_dict(plan) for key, plan in plans.items()}
        self.observed: dict[str, dict[str, float]] = {}
        # Each plan's P(fits), re-judged from the trials' peaks and out-of-memory failures
        # (paratune.costs.risk); set by the driver where the roofline predicts memory.
        self.risk: LaunchRisk | None = None

    def tokens_per_s(self) -> dict[str, float]:
        return {key: float(self.model.predict(plan).tokens_per_s_per_gpu) for key, plan in self.plans.items()}

    def observe(self, key: str, result: TrialResult) -> dict[str, float]:
        """Once per trial, `result` judged against the memory budget (ledger.apply_budget): the
        step-time model refitted; the memory calibration told its peak or its running out of
        memory, with what was judged of it at launch (P(fits) ...)."""
        if key in self.observed or key not in self.plans:
            return self.observed.get(key, {})
        out: dict[str, float] = {}
        if (result.ok or result.stopped_early) and result.step_time_median_s:
            out = dict(self.model.observe(self.plans[key], result.step_time_median_s,
                                          routing_balance=result.routing_balance))  # MoE: measured imbalance
        if self.risk is not None:
            oom = result.status == "failed" and result.reason == "oom"
            peak = max(result.peak_memory_bytes) if result.peak_memory_bytes and (result.ok or oom) else None
            out.update(self.risk.at_launch.get(key, {}))
            out.update(self.risk.observe(key, peak, oom, result.launch_s))
        self.observed[key] = out
        return out

    def errors(self) -> list[float]:
        """|predicted / measured - 1| of every observed trial, each predicted before it ran."""
        return [abs(o["step_time_prediction_error"]) for o in self.observed.values() if "step_time_prediction_error" in o]


def calibrated_searcher(predictions: TimePredictions, ledger: Ledger, budget_gb: float | None,
                        early_stop_steps: int | None, stop_file: Path, rule: SweepStopRule | None = None):
    """A Tune searcher that measures next, among the plans the stopping rule (paratune.sweep.stopping)
    says can still win, the one of highest expected gain (`predictions.risk`; without it the
    fastest), and finishes by that rule, refitting the models on every trial as it completes."""
    from ray.tune.search import Searcher

    rule = rule or SweepStopRule()

    shown = varying_env(p.env for p in predictions.plans.values())

    def label(key: str) -> str:
        return strategy_label(predictions.plans[key].to_dict()) + env_suffix(predictions.plans[key], shown)

    class CalibratedSearch(Searcher):
        def __init__(self) -> None:
            super().__init__(metric=OBJECTIVE, mode="max")
            self.results: dict[str, TrialResult] = {}
            self.pending: dict[str, str] = {}  # trial id -> point
            for entry in ledger.search_entries():  # resumed: the model learns from the ledger
                if unscored(entry.result):
                    continue  # the cluster failed it: measured again
                self.results[entry.key] = entry.result
                predictions.observe(entry.key, apply_budget(entry.result, budget_gb))

        def save(self, checkpoint_path: str) -> None:
            """paratune resumes from its ledger, not from Tune's searcher state."""

        def restore(self, checkpoint_path: str) -> None:
            """See save()."""

        def suggest(self, trial_id: str):
            incumbent = incumbent_of(self.results, budget_gb)
            full = sum(1 for r in self.results.values() if r.ok)
            tokens, band, risk = predictions.tokens_per_s(), predictions.model.error_band(), predictions.risk
            running = set(self.pending.values())
            if risk is not None:  # re-judged on the trials so far: plans now over by their band are not launched
                skipped = risk.skipped(k for k in tokens if k not in self.results and k not in running)
                tokens = {k: v for k, v in tokens.items() if k not in skipped}
            decision = rule.decide(tokens, set(self.results), running, incumbent, band, full, label)
            if decision.stop:
                if self.pending:
                    return None  # running trials may still change the incumbent or the model
                reason = decision.reason
                if risk is not None and risk.passed_over and not [k for k in tokens if k not in self.results]:
                    reason = (f"every plan has been measured but {len(risk.passed_over)} predicted out of memory "
                              "once the trials recalibrated the memory model")
                stop_file.write_text(json.dumps({"reason": reason, "after_trials": len(self.results)}))
                return Searcher.FINISHED
            key = decision.next_key
            if risk is not None:  # the stopping rule's candidates, launched by expected gain (P(fits) counted)
                open_keys = [k for k in tokens if k not in self.results and k not in running and
                             (incumbent is None or full < rule.min_trials or rule.can_win(tokens[k], incumbent, band))]
                order = risk.order(tokens, open_keys, band)
                key = order[0].item if order else key
                risk.launched(key, order[0] if order else None)
            self.pending[trial_id] = key
            return {"point": key,
                    "stop_rule": stop_rule_for(incumbent, early_stop_steps) if early_stop_steps else None}

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            key = self.pending.pop(trial_id, None)
            if result and "trial_result" in result:
                tr = TrialResult.model_validate_json(result["trial_result"])
                key = result.get("point", key)
            elif key is not None:
                tr = TrialResult.failed(predictions.plans[key].to_dict(), "error", "the Tune trial itself failed")
            else:
                return
            self.results[key] = tr  # unscored too: the search never proposes it twice in one run
            if not unscored(tr):  # judged against the budget: over it is out of memory, for the calibration
                predictions.observe(key, apply_budget(tr, budget_gb))

    return CalibratedSearch()


def env_suffix(plan: Plan, keys: set[str] | None = None) -> str:
    """' K=V ...' after a plan's label (only `keys`, where given), or '' when there is none."""
    env = env_label(plan.env, keys)
    return f" {env}" if env else ""
