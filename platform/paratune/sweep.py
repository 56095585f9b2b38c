"""The sweep: Ray Tune + Optuna over a space's valid plans, every trial in MLflow, a winner ready to use.

Each Tune trial is a function trainable (reserving no CPU itself) that runs one measured
trial (its own Ray Train job). Every finished trial is appended to a ledger on disk before
anything else happens, so an interrupted sweep resumes (`--resume`) without losing or
re-running a finished trial; the ledger also warm-starts the searcher. A failed trial scores
0 tokens/s so the searcher learns from it, and a configuration is never proposed twice. A trial
the cluster failed (node_lost, insufficient_resources, invalid_placement) is recorded but never
scored, and `--resume` measures its plan again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ray.tune import Callback
from ray.tune.experimental.output import AirVerbosity
from ray.tune.experimental.output import ProgressReporter as AirProgressReporter
from rich.console import Console
from rich.markup import escape

from paratune import placement
from paratune.failures import CLUSTER_REASONS
from paratune.measure import StopRule
from paratune.plan import Plan, load_plan_dict
from paratune.progress import ProgressDisplay, SweepProgress, format_trial_line, status_text
from paratune.report import env_label, strategy_label
from paratune.search import Incumbent, StoppingRule
from paratune.space import Space
from paratune.trial import TrialResult, ensure_ray, run_trial

OBJECTIVE = "objective"


# --------------------------------------------------------------------------- points
def point_key(choices: dict[str, Any], env: dict[str, str]) -> str:
    return json.dumps({"choices": choices, "env": env}, sort_keys=True, default=str)


def _candidate_key(point: str) -> str:
    """The structural candidate a point belongs to (its choices, env aside; Candidate.key)."""
    return json.dumps(json.loads(point)["choices"], sort_keys=True, default=str)


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


# --------------------------------------------------------------------------- ledger
@dataclass
class LedgerEntry:
    number: int
    key: str
    result: TrialResult
    phase: str = "search"
    # What the cost model predicted for this trial before it ran (predicted_* and *_prediction_error,
    # as logged to MLflow), for the sweep report; empty when the sweep predicted nothing.
    predicted: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "key": self.key, "phase": self.phase,
                           "result": self.result.model_dump(), "predicted": self.predicted})

    @classmethod
    def from_json(cls, line: str) -> "LedgerEntry":
        d = json.loads(line)
        return cls(d["number"], d["key"], TrialResult.model_validate(d["result"]), d["phase"],
                   dict(d.get("predicted") or {}))  # ledgers written before it have none


class Ledger:
    """Append-only record of finished trials (one JSON line each, flushed as it happens)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: list[LedgerEntry] = []
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    try:
                        self.entries.append(LedgerEntry.from_json(line))
                    except (json.JSONDecodeError, KeyError):
                        pass  # a line cut by a crash mid-write: that trial was not finished

    def append(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)
        with self.path.open("a") as f:
            f.write(entry.to_json() + "\n")
            f.flush()

    def search_entries(self) -> list[LedgerEntry]:
        return [e for e in self.entries if e.phase == "search"]

    def keys(self) -> set[str]:
        """Points measured (failed included) and not to be run again: a trial the cluster failed
        (failures.CLUSTER_REASONS) says nothing about its plan, so a resumed sweep re-runs it."""
        return {e.key for e in self.search_entries() if not unscored(e.result)}


def unscored(result: TrialResult) -> bool:
    """A trial the cluster failed, not its plan: recorded, never scored."""
    return result.status == "failed" and result.reason in CLUSTER_REASONS


def objective_value(result: TrialResult, memory_budget_gb: float | None) -> float:
    """tokens/s/GPU, or 0 for a failed or over-budget trial (so the searcher learns to avoid it).
    A trial stopped early scores what its measured steps reached: a real figure below the
    incumbent, not a failure."""
    result = apply_budget(result, memory_budget_gb)
    usable = result.ok or result.stopped_early
    return float(result.tokens_per_s_per_gpu) if usable and result.tokens_per_s_per_gpu else 0.0


def incumbent_of(results: dict[str, TrialResult], memory_budget_gb: float | None) -> Incumbent | None:
    """The best fully measured plan (stopped-early and failed trials never are)."""
    full = {k: apply_budget(r, memory_budget_gb) for k, r in results.items()}
    full = {k: r for k, r in full.items() if r.ok and r.tokens_per_s_per_gpu}
    if not full:
        return None
    key = max(full, key=lambda k: full[k].tokens_per_s_per_gpu)
    return Incumbent(key, float(full[key].tokens_per_s_per_gpu), float(full[key].step_time_spread or 0.0))


def stop_rule_for(incumbent: Incumbent | None, min_steps: int) -> dict[str, Any] | None:
    """What a trial launched now is stopped against (measure.StopRule as a dict), if anything."""
    if incumbent is None:
        return None
    return StopRule(incumbent.tokens_per_s_per_gpu, incumbent.spread, min_steps)._asdict()


def apply_budget(result: TrialResult, memory_budget_gb: float | None) -> TrialResult:
    """A plan measured above the memory budget is a failed trial with reason oom (over budget)."""
    if result.ok and memory_budget_gb and result.peak_memory_bytes and \
            max(result.peak_memory_bytes) > memory_budget_gb * 2**30:
        peak = max(result.peak_memory_bytes) / 2**30
        return result.model_copy(update={"status": "failed", "reason": "oom",
                                         "message": f"over budget: peak {peak:.2f} GiB > memory_budget_gb {memory_budget_gb}"})
    return result


# --------------------------------------------------------------------------- Tune parts
def measure_plan(plan: dict[str, Any], stop_rule: dict[str, Any] | None, pool: str | None,
                 storage: str | None = None, leases: str | None = None) -> TrialResult:
    """One measured trial: in a reused worker group of the sweep's pool (paratune.session, which
    places whole nodes itself) when there is one, else in a worker group of its own, on whole
    nodes leased from the sweep's `leases` actor when the plan wants them (paratune.placement)."""
    rule = StopRule(**stop_rule) if stop_rule else None
    if pool:
        return pool_measure(pool, plan, rule)
    checked = load_plan_dict(plan)
    if leases is None or not placement.exclusive_nodes(checked):
        return run_trial(checked, storage_path=storage, stop_rule=rule)
    import uuid

    from paratune.trial import wants_gpu, worker_resources

    import ray

    use_gpu = wants_gpu(checked)
    demand = placement.demand_for(checked, worker_resources(checked, use_gpu, ray.nodes() if use_gpu else None))
    if placement.shortfall(demand, placement.alive_nodes()) is not None:
        return run_trial(checked, storage_path=storage, stop_rule=rule)  # says insufficient_resources
    owner = uuid.uuid4().hex[:8]
    nodes = placement.acquire_nodes(leases, owner, demand, bound_s=checked.trial_timeout_s)
    if nodes is None:
        return TrialResult.failed(checked, "insufficient_resources", f"no {demand.nodes_needed} whole node(s) "
                                  f"came free within trial_timeout_s={checked.trial_timeout_s:g}: {demand.describe()}")
    try:
        return run_trial(checked, storage_path=storage, stop_rule=rule, nodes=nodes)
    finally:
        placement.release_nodes(leases, owner)


def _trainable(config: dict[str, Any], *, plans: dict[str, dict], storage: str, pool: str | None = None,
               leases: str | None = None) -> None:
    """One Tune trial = one measured Ray Train trial. Never raises for a failing plan."""
    from ray import tune

    key = config["point"]
    result = measure_plan(plans[key], config.get("stop_rule"), pool, storage, leases)
    tune.report({OBJECTIVE: result.tokens_per_s_per_gpu or 0.0, "point": key,
                 "trial_result": result.model_dump_json()})


def _searcher(space: Space, algorithm: str, seed: int, ledger: Ledger, budget_gb: float | None, trials: int,
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
class RooflineTimeModel:
    """The roofline (estimate.Calibration) behind the step-time model's interface: what the
    calibrated search falls back to when the cluster cannot be profiled."""

    PRIOR_BAND = 0.25  # its out-of-sample median error was 18%, worst 35% (bench/results)

    def __init__(self, calibration):
        self.calibration = calibration
        self.errors: list[float] = []

    def predict(self, plan: Plan):
        return self.calibration.predict(plan).time

    def observe(self, plan: Plan, measured_step_s: float) -> dict[str, float]:
        out = self.calibration.observe(plan, None, measured_step_s)
        self.errors.append(abs(out["step_time_prediction_error"]))
        return {"predicted_step_time_s": out["predicted_step_time_s"],
                "step_time_prediction_error": out["step_time_prediction_error"]}

    def error_band(self) -> float:
        if len(self.errors) < 3:
            return self.PRIOR_BAND
        return max(sorted(self.errors)[int(0.9 * (len(self.errors) - 1))], 0.05)

    def summary(self) -> dict[str, float]:
        return {"error_band": self.error_band()}


class TimePredictions:
    """The sweep's step-time model over its points, shared by the searcher (what to measure
    next) and the ledger callback (predicted beside measured in MLflow): each trial is observed
    once, and its prediction is the one made before it ran (out of sample)."""

    def __init__(self, model, plans: dict[str, dict[str, Any]], source: str):
        self.model, self.source = model, source
        self.plans = {key: load_plan_dict(plan) for key, plan in plans.items()}
        self.observed: dict[str, dict[str, float]] = {}

    def tokens_per_s(self) -> dict[str, float]:
        return {key: float(self.model.predict(plan).tokens_per_s_per_gpu) for key, plan in self.plans.items()}

    def observe(self, key: str, result: TrialResult) -> dict[str, float]:
        if key in self.observed or key not in self.plans:
            return self.observed.get(key, {})
        out: dict[str, float] = {}
        if (result.ok or result.stopped_early) and result.step_time_median_s:
            out = dict(self.model.observe(self.plans[key], result.step_time_median_s))
        self.observed[key] = out
        return out

    def errors(self) -> list[float]:
        """|predicted / measured - 1| of every observed trial, each predicted before it ran."""
        return [abs(o["step_time_prediction_error"]) for o in self.observed.values() if "step_time_prediction_error" in o]


def _calibrated_searcher(predictions: TimePredictions, ledger: Ledger, budget_gb: float | None,
                         early_stop_steps: int | None, stop_file: Path, rule: StoppingRule | None = None):
    """A Tune searcher that measures the plan predicted fastest next and finishes by the
    stopping rule (paratune.search), refitting the model on every trial as it completes."""
    from ray.tune.search import Searcher

    rule = rule or StoppingRule()

    def label(key: str) -> str:
        return strategy_label(predictions.plans[key].to_dict()) + _env_label(predictions.plans[key])

    class CalibratedSearch(Searcher):
        def __init__(self) -> None:
            super().__init__(metric=OBJECTIVE, mode="max")
            self.results: dict[str, TrialResult] = {}
            self.pending: dict[str, str] = {}  # trial id -> point
            for entry in ledger.search_entries():  # resumed: the model learns from the ledger
                if unscored(entry.result):
                    continue  # the cluster failed it: measured again
                self.results[entry.key] = entry.result
                predictions.observe(entry.key, entry.result)

        def save(self, checkpoint_path: str) -> None:
            """paratune resumes from its ledger, not from Tune's searcher state."""

        def restore(self, checkpoint_path: str) -> None:
            """See save()."""

        def suggest(self, trial_id: str):
            incumbent = incumbent_of(self.results, budget_gb)
            full = sum(1 for r in self.results.values() if r.ok)
            decision = rule.decide(predictions.tokens_per_s(), set(self.results), set(self.pending.values()),
                                   incumbent, predictions.model.error_band(), full, label)
            if decision.stop:
                if self.pending:
                    return None  # running trials may still change the incumbent or the model
                stop_file.write_text(json.dumps({"reason": decision.reason, "after_trials": len(self.results)}))
                return Searcher.FINISHED
            self.pending[trial_id] = decision.next_key
            return {"point": decision.next_key,
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
            if not unscored(tr):
                predictions.observe(key, tr)

    return CalibratedSearch()


def _env_label(plan: Plan) -> str:
    return f" {env_label(plan.env)}" if plan.env else ""


# --------------------------------------------------------------------------- the sweep
@dataclass
class SweepReport:
    out_dir: Path
    parent_run_id: str
    entries: list[LedgerEntry]
    verdict: Any = None
    winner_dir: Path | None = None
    winner_parity: float | None = None  # the winner's max |loss - reference|
    # Plans passed over because their loss-parity check failed: label, key and why.
    parity_failures: list[dict[str, str]] = field(default_factory=list)
    time_split: dict[str, float] = field(default_factory=dict)
    pruning: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)  # the cost model's errors and constants
    stop_reason: str = ""  # why the calibrated search stopped measuring (its stated rule)
    # The step-time model's out-of-sample errors (each trial predicted before it ran).
    time_model: dict[str, Any] = field(default_factory=dict)
    # Every loss-parity check run at the end (parity.json): label, key, passed, losses compared.
    parity_checks: list[dict[str, Any]] = field(default_factory=list)
    report_path: Path | None = None  # report/report.html (paratune.sweep_report), when it could be written


class SweepError(RuntimeError):
    """A sweep that cannot start (its folder belongs to another space, or already has trials)."""


def _space_digest(space: Space) -> str:
    text = space.source.read_text() if space.source else json.dumps(space.spec.model_dump(), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _concurrency(space: Space) -> int:
    """Trials at once: on whole nodes (paratune.placement, default when gpus_per_node is set),
    the nodes that can host one trial's share / the nodes a trial needs, so concurrent trials
    never share a node; else the workers the cluster holds / a trial's workers."""
    import ray

    from paratune.trial import wants_gpu, worker_resources

    plan = max((c.plan for c in space.candidates), key=lambda p: p.num_workers)
    use_gpu = wants_gpu(plan)
    demand = placement.demand_for(plan, worker_resources(plan, use_gpu, ray.nodes() if use_gpu else None))
    return placement.trials_at_once(demand, placement.alive_nodes())


def run_sweep(space: Space, out_dir: Path, *, trials: int | None = None, algorithm: str | None = None,
              seed: int | None = None, resume: bool = False, tracking_uri: str | None = None,
              ray_address: str | None = None, console: Console | None = None, verbose: bool = False,
              report_page: bool = True, pool: str | None = None) -> SweepReport:
    """The whole sweep (see the module doc); `verbose`: Ray Tune's own console output as well.
    Ends by writing the sweep report (paratune.sweep_report) and logging it to the parent run;
    `report_page=False` skips it (seconds of plotting a test of something else need not pay).
    `pool`: the name of a running worker-group pool (paratune.session.get_pool_actor) to measure
    in, left running afterwards, so that sweeps one after another in one Ray session (a notebook,
    a test session) launch their workers once; by default each sweep starts and closes its own.
    A space with `reuse_workers: false` never uses one."""

    from paratune.tracking import SweepTracker

    console = console or Console()
    settings = space.spec.search
    trials = trials or settings.trials
    algorithm = algorithm or settings.algorithm
    seed = settings.seed if seed is None else seed
    budget_gb = space.spec.objective.memory_budget_gb
    out_dir = out_dir.resolve()
    state_path = out_dir / "sweep.json"
    digest = _space_digest(space)
    if state_path.exists() and not resume:
        raise SweepError(f"{out_dir}: a sweep already lives here; use --resume to continue it or another --out")
    if resume and state_path.exists():
        state = json.loads(state_path.read_text())
        if state["space_digest"] != digest:
            raise SweepError(f"{out_dir}: the space file changed since this sweep started; use another --out")
    else:
        state = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(out_dir / "ledger.jsonl")
    tracker = SweepTracker(tracking_uri or state.get("tracking_uri"))
    ensure_ray(ray_address)
    space = _prune_unplaceable(space, console)  # before MLflow: a sweep that cannot start leaves no run

    t_sweep = time.perf_counter()
    if not state:
        first = space.candidates[0].plan
        state = {"space_digest": digest, "tracking_uri": tracker.tracking_uri, "algorithm": algorithm, "seed": seed,
                 "memory_budget_gb": budget_gb,
                 "parent_run_id": tracker.start_parent(
                     space.spec.name, space.source,
                     params={**{f"fixed.{k}": v for k, v in space.spec.fixed.items()}, "search.algorithm": algorithm,
                             "search.trials": trials, "search.seed": seed, "space.candidates": len(space.candidates),
                             "space.combinations": space.total_combinations},
                     tags={"paratune.model": first.model, "paratune.world_size": str(first.num_workers),
                           "paratune.device": _device_tag(), "paratune.space": space.spec.name})}
        state_path.write_text(json.dumps(state, indent=2))
    parent = state["parent_run_id"]
    space, calibration, fastest_first = _predict(space, budget_gb, console)
    console.print(space.pruning_report())
    done = len(ledger.search_entries())
    remaining = max(0, trials - done)
    if done:
        console.print(f"resuming: {done} finished trial(s) kept, {remaining} to run")
    if resume and ledger.entries:
        filled = tracker.sync_ledger(parent, ledger.entries)
        if filled:
            console.print(f"logged {filled} finished trial(s) to MLflow that the interrupted driver had not")
    plans = {point_key(p["choices"], p["env"]): space.plan_for(p["choices"], p["env"]).to_dict()
             for p in all_points(space)}
    remaining = min(remaining, len(plans) - len(ledger.keys()))
    stop_file = out_dir / "stopped.json"
    own_pool = settings.reuse_workers and pool is None
    pool = (pool or _start_pool(console)) if settings.reuse_workers else None
    leases = None if pool else _start_leases()
    try:
        predictions, profile_s = None, 0.0
        if algorithm == "calibrated":
            predictions, profile_s = _time_predictions(space, plans, calibration, pool, console)
        if remaining > 0 and not (algorithm == "calibrated" and stop_file.exists()):
            _search(space, plans, algorithm, seed, trials, remaining, done, ledger, tracker, parent, budget_gb, console,
                    calibration, predictions, fastest_first, pool, out_dir, stop_file, leases, verbose)
        report = SweepReport(out_dir, parent, ledger.entries, pruning=space.pruning_report())
        if stop_file.exists():
            report.stop_reason = json.loads(stop_file.read_text())["reason"]
            console.print(f"[bold]search stopped[/bold] after {len(ledger.search_entries())} of {len(plans)} plans: "
                          f"{escape(report.stop_reason)}")
            tracker.client.set_tag(parent, "paratune.stop_reason", report.stop_reason[:5000])
        if calibration is not None and not calibration.errors:  # resumed: calibrate on the ledger
            for e in ledger.search_entries():
                _observe(calibration, e.result)
        if predictions is not None:
            report.time_model = _time_model_report(predictions)
        _finish(space, report, ledger, tracker, budget_gb, console, calibration, pool)
    finally:
        if own_pool and pool is not None:
            _close_pool(pool)
        if leases is not None:
            _close_leases(leases)
    report.time_split["profile_s"] = profile_s
    report.time_split["sweep_wall_s"] = time.perf_counter() - t_sweep
    if report_page:
        report.report_path = write_report(out_dir, tracker, parent, console, announce=False)  # `tune` ends saying it
    return report


def write_report(sweep_dir: Path, tracker, parent_run_id: str | None, console: Console,
                 announce: bool = True) -> Path | None:
    """The sweep report (paratune.sweep_report: report/report.html and its PNGs), logged to the
    parent run under "report". Never raises: the sweep's results are on disk and in MLflow
    already, and a report that cannot be drawn must not lose them; it says why instead."""
    try:
        from paratune.sweep_report import write_sweep_report

        path = Path(write_sweep_report(sweep_dir))
    except Exception as err:  # noqa: BLE001 - see the docstring
        console.print(f"[yellow]no sweep report ({type(err).__name__}: {escape(str(err))[:500]}); the results are "
                      f"in {sweep_dir}[/yellow]")
        return None
    if tracker is not None and parent_run_id:
        try:
            tracker.client.log_artifacts(parent_run_id, str(path.parent), artifact_path="report")
            tracker.add_to_note(parent_run_id, f"Report: `report/{path.name}` in this run's artifacts "
                                               f"(on disk: `{path}`).")
        except Exception as err:  # noqa: BLE001 - the report is on disk; MLflow lacks only its copy
            console.print(f"[yellow]the sweep report was not logged to MLflow ({type(err).__name__}: "
                          f"{escape(str(err))[:300]})[/yellow]")
    if announce:
        console.print(f"sweep report: {path}", soft_wrap=True)
    return path


def _search(space: Space, plans: dict[str, dict], algorithm: str, seed: int, trials: int, remaining: int, done: int,
            ledger: Ledger, tracker, parent: str, budget_gb: float | None, console: Console, calibration,
            predictions: TimePredictions | None, fastest_first: list[str], pool: str | None, out_dir: Path,
            stop_file: Path, leases: str | None = None, verbose: bool = False) -> None:
    """The trials, as a Ray Tune run: grid (every point, predicted fastest first), TPE/random
    (Optuna) or calibrated (the step-time model and the stopping rule). Tune's own console
    output only with `verbose`; paratune's progress line always."""
    from ray import tune

    settings = space.spec.search
    early_stop_steps = settings.early_stop_min_steps if settings.early_stop else None
    progress = SweepProgress(total=done + remaining, done=done, first_done=done)
    display = ProgressDisplay(progress, console)
    callback = _LedgerCallback(ledger, tracker, parent, budget_gb, console, total=done + remaining, plans=plans,
                               calibration=calibration, predictions=predictions, progress=progress, display=display)
    # Tune's trainable only hands a plan to its measurement (the worker-group pool or run_trial) and
    # reports: every trial asks the same resources, so one actor serves trial after trial
    # (reuse_actors) instead of a new Ray process, with its imports, per trial.
    trainable = tune.with_resources(
        tune.with_parameters(_trainable, plans=plans, storage=str(out_dir / "ray"), pool=pool, leases=leases),
        {"CPU": 0, "memory": 1},  # the trial's workers hold the CPUs; 1 CPU here deadlocks 2-CPU clusters
    )
    param_space: dict[str, Any] = {}
    if algorithm == "grid":  # the exhaustive reference: every point measured fully, never stopped early
        # Env-major (plans of one env share a reused worker group), then predicted fastest first.
        rank = {key: i for i, key in enumerate(fastest_first)}
        todo = sorted((k for k in plans if k not in ledger.keys()),
                      key=lambda k: (json.dumps(json.loads(k)["env"], sort_keys=True), rank.get(_candidate_key(k), len(rank))))
        tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=_concurrency(space), reuse_actors=True)
        param_space = {"point": tune.grid_search(todo[:remaining])}
    elif algorithm == "calibrated" and predictions is not None:
        tune_config = tune.TuneConfig(
            search_alg=_calibrated_searcher(predictions, ledger, budget_gb, early_stop_steps, stop_file,
                                            StoppingRule() if settings.stopping_rule else StoppingRule(min_trials=10**9)),
            num_samples=remaining, max_concurrent_trials=_concurrency(space), reuse_actors=True)
    else:
        if algorithm == "calibrated":
            console.print("[yellow]no step-time model: searching with TPE instead[/yellow]")
            algorithm = "tpe"
        tune_config = tune.TuneConfig(
            search_alg=_searcher(space, algorithm, seed, ledger, budget_gb, trials,
                                 first=[point_key(json.loads(key), (space.env_grid() or [{}])[0]) for key in
                                        fastest_first[: space.spec.estimate.start_from_predicted]],
                                 early_stop_steps=early_stop_steps),
            num_samples=remaining, max_concurrent_trials=_concurrency(space), reuse_actors=True)
    callbacks = [callback] if verbose else [callback, _QuietTuneOutput()]
    tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config,
                       run_config=tune.RunConfig(name=f"tune-{len(ledger.entries)}", storage_path=str(out_dir / "tune"),
                                                 callbacks=callbacks, verbose=1 if verbose else 0))
    # Tune also logs where it wrote its state ("Wrote the latest version of all result files ..."):
    # paratune's own ledger is the sweep's record, so that line is Tune's detail too (--verbose).
    tune_logger = logging.getLogger("ray.tune")
    level = tune_logger.level
    if not verbose:
        tune_logger.setLevel(logging.WARNING)
    try:
        with display:
            tuner.fit()
    finally:
        tune_logger.setLevel(level)


def _time_predictions(space: Space, plans: dict[str, dict], calibration, pool: str | None,
                      console: Console) -> tuple[TimePredictions | None, float]:
    """The calibrated step-time model: the cluster's profile for these plans (stored per model,
    device, cluster and env, so later sweeps reuse it; measured now if not), or the roofline
    when profiling fails. Returns (predictions, seconds spent profiling)."""
    t0 = time.perf_counter()
    try:
        from paratune.profile import ProfileStore, profile_requests_for, run_profile
        from paratune.timemodel import StepTimeModel

        store = ProfileStore()
        device_name = calibration.device.name if calibration is not None else _device_tag()
        profiles = []
        for request in profile_requests_for([load_plan_dict(p) for p in plans.values()]):
            profile = store.get(request, device_name)
            if profile is None:
                with console.status(f"profiling the cluster for the step-time model ({_request_label(request)})"):
                    profile = run_profile(request, runner=_pool_runner(pool, request))
                store.put(profile, device_name)
                console.print(f"profiled {_request_label(request)} in {time.perf_counter() - t0:.0f} s")
            else:
                console.print(f"step-time model: the stored profile for {_request_label(request)}")
            profiles.append(profile)
        return TimePredictions(StepTimeModel(profiles), plans, "profile"), time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 - the sweep still runs, on the roofline, and says so
        console.print(f"[yellow]no profile ({type(err).__name__}: {escape(str(err))[:300]}); the calibrated search "
                      "orders plans by the roofline instead[/yellow]")
        if calibration is None:
            return None, time.perf_counter() - t0
        from paratune.estimate import Calibration

        roofline = RooflineTimeModel(Calibration(calibration.device, calibration.capacity_gib))  # its own refits
        return TimePredictions(roofline, plans, "roofline"), time.perf_counter() - t0


def _request_label(request) -> str:
    env = env_label(request.env)
    return f"{request.world_size} workers" + (f", {env}" if env else "")


def _time_model_report(predictions: TimePredictions) -> dict[str, Any]:
    import statistics

    errors = predictions.errors()
    out: dict[str, Any] = {"source": predictions.source, "trials": len(errors),
                           "error_band": float(predictions.model.error_band())}
    if errors:
        out.update(median_abs_error=statistics.median(errors), worst_abs_error=max(errors))
    return out


# --------------------------------------------------------------------------- worker-group reuse
# The driver holds a handle to each pool it starts: Ray garbage-collects a named actor, groups
# and all, once no handle to it is left, and the trainables' handles come and go with each trial.
_POOL_HANDLES: dict[str, Any] = {}


def _start_pool(console: Console) -> str | None:
    """The name of this sweep's pool of reusable worker groups (paratune.session: a 0-CPU actor
    every trainable reaches by name), or None (every trial then launches its own workers)."""
    try:
        import uuid

        from paratune.session import get_pool_actor

        name = f"paratune-sweep-pool-{uuid.uuid4().hex[:8]}"
        _POOL_HANDLES[name] = get_pool_actor(name)
        return name
    except Exception as err:  # noqa: BLE001 - measuring without reuse is slower, not wrong
        console.print(f"[yellow]worker groups will not be reused ({type(err).__name__}: {escape(str(err))[:200]})[/yellow]")
        return None


def _start_leases() -> str:
    """The sweep's record of whole nodes held by its trials (paratune.placement.NodeLeases), when
    trials launch their own worker groups; the driver holds the handle (see _POOL_HANDLES)."""
    import uuid

    name = f"paratune-sweep-leases-{uuid.uuid4().hex[:8]}"
    _POOL_HANDLES[name] = placement.get_leases_actor(name)
    return name


def _close_leases(name: str) -> None:
    import ray

    actor = _POOL_HANDLES.pop(name, None)
    if actor is not None:
        ray.kill(actor, no_restart=True)


def _prune_unplaceable(space: Space, console: Console) -> Space:
    """Plans this cluster can never hold are removed before anything starts, by rule, with what
    they need and what the cluster has (an autoscaler can add nodes: then nothing is removed,
    and each trial waits for its nodes, bounded). A `device: cuda` space on a cluster with no GPU
    yet waits for one the same way, or is an error: it never falls back to the CPU."""
    import dataclasses

    import ray

    from paratune.trial import wants_gpu, worker_resources

    first = space.candidates[0].plan
    if first.device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
        gpu_demand = placement.Demand(1, {"GPU": 1}, None, False)
        missing = placement.wait_for_room(gpu_demand, placement.wait_for_nodes_bound_s(), console.print) \
            if placement.autoscaler_configured() else placement.shortfall(gpu_demand, placement.alive_nodes())
        if missing is not None:
            raise SweepError(f"device: 'cuda' in the space, but {missing.removeprefix('insufficient_resources: ')}; "
                             "start GPU nodes (or set PARATUNE_AUTOSCALER=1 to wait for an autoscaler), or use device: "
                             "auto|cpu")
    if placement.autoscaler_configured():
        return space
    nodes = placement.alive_nodes()
    removed, examples, kept = space.removed.copy(), dict(space.examples), []
    for c in space.candidates:
        use_gpu = wants_gpu(c.plan)
        demand = placement.demand_for(c.plan, worker_resources(c.plan, use_gpu, ray.nodes() if use_gpu else None))
        missing = placement.shortfall(demand, nodes)
        if missing is None:
            kept.append(c)
            continue
        rule = f"insufficient_resources: needs {demand.describe()}"
        removed[rule] += 1
        examples.setdefault(rule, missing)
    if not kept:
        raise SweepError(f"the cluster cannot hold any plan of the space: {next(iter(examples.values()))}")
    return dataclasses.replace(space, candidates=kept, removed=removed, examples=examples)


def pool_measure(pool: str, plan: dict[str, Any], rule: StopRule | None) -> TrialResult:
    """The trial in one of the pool's worker groups. Never raises for a failing plan."""
    import ray

    from paratune.failures import classify
    from paratune.session import get_pool_actor

    try:
        out = ray.get(get_pool_actor(pool).measure.remote(plan, rule._asdict() if rule else None))
    except Exception as err:  # noqa: BLE001 - the pool actor itself died: a failed trial, not a lost sweep
        return TrialResult.failed(plan, *classify(err))
    return TrialResult.model_validate(out)


def _close_pool(pool: str) -> None:
    import ray

    from paratune.session import get_pool_actor

    actor = _POOL_HANDLES.pop(pool, None) or get_pool_actor(pool)
    try:
        ray.get(actor.close.remote(), timeout=300)
    finally:
        ray.kill(actor, no_restart=True)


def _pool_runner(pool: str | None, request):
    """run_profile's runner: the profile runs in the pool's worker group for the request's
    workers and env (the group the plans with that env then reuse), or None: a group of its own."""
    if pool is None:
        return None
    import ray

    from paratune.profile import workers_plan
    from paratune.session import get_pool_actor

    def runner(function_path: str, payload: dict[str, Any]) -> dict[str, Any]:
        plan = workers_plan(request).to_dict()
        return ray.get(get_pool_actor(pool).run.remote(plan, function_path, payload, request.timeout_s))

    return runner


def _predict(space: Space, budget_gb: float | None, console: Console):
    """The cost model before anything runs: skip plans predicted not to fit (counted with the
    static pruning, reason and an example recorded), rank the rest by predicted speed.
    Returns (the space without the skipped plans, the calibration, candidate keys fastest first)."""
    import dataclasses

    import ray

    from paratune.estimate import Calibration, device_for_cluster

    settings = space.spec.estimate
    first = space.candidates[0].plan
    try:
        device = device_for_cluster(settings.device, ray.cluster_resources(), first.num_workers)
        capacity = min(device.memory_gib, budget_gb) if budget_gb else device.memory_gib
        calibration = Calibration(device, capacity)
        estimates = {c.key: calibration.predict(c.plan, settings.margin) for c in space.candidates}
    except Exception as err:  # noqa: BLE001 - the sweep still runs, unguided, and says so
        console.print(f"[yellow]no predictions ({type(err).__name__}: {escape(str(err))[:300]}); "
                      "every plan will be measured[/yellow]")
        return space, None, []
    kept = [c for c in space.candidates if estimates[c.key].fits or not settings.skip_predicted_oom]
    if not kept:
        smallest = min(estimates.values(), key=lambda e: e.memory.total)
        raise SweepError(f"every plan is predicted not to fit on {device.name}; the smallest: "
                         f"{strategy_label(smallest.plan.to_dict())}: {smallest.overflow}. Raise "
                         "estimate.margin, add sharding/offload/checkpointing to the space, or set "
                         "estimate.skip_predicted_oom: false to measure anyway")
    removed, examples = space.removed.copy(), dict(space.examples)
    for c in space.candidates:
        if c not in kept:
            rule = f"predicted out of memory on {device.name} (over {estimates[c.key].capacity_bytes / 2**30:.1f} GiB by > {settings.margin:.0%})"
            removed[rule] += 1
            examples.setdefault(rule, f"{strategy_label(c.plan.to_dict())}: {estimates[c.key].overflow}")
    space = dataclasses.replace(space, candidates=kept, removed=removed, examples=examples)
    fastest_first = sorted(kept, key=lambda c: -estimates[c.key].time.tokens_per_s_per_gpu)
    return space, calibration, [c.key for c in fastest_first]


def _observe(calibration, result: TrialResult) -> dict[str, float]:
    """Predicted beside measured for one trial (and a refit of the time model)."""
    if calibration is None:
        return {}
    plan = load_plan_dict(result.plan)
    peak = max(result.peak_memory_bytes) if result.ok and result.peak_memory_bytes else None
    return calibration.observe(plan, peak, result.step_time_median_s if result.ok else None)


def _device_tag() -> str:
    import ray

    res = ray.cluster_resources()
    return f"{int(res.get('GPU', 0))} GPU" if res.get("GPU") else f"cpu ({int(res.get('CPU', 0))} CPUs)"


def predicted_only(metrics: dict[str, float]) -> dict[str, float]:
    """The predictions among a trial's extra metrics (predicted_*, *_prediction_error): what the
    ledger keeps beside the measurement, without the model's fitted constants."""
    return {k: float(v) for k, v in metrics.items()
            if (k.startswith("predicted_") or k.endswith("_prediction_error")) and isinstance(v, (int, float))}


class _QuietTuneOutput(AirProgressReporter):
    """Ray Tune's console output, silenced: its banner table, "View detailed results here", the
    TensorBoard hint and its trial tables say nothing a paratune user needs (paratune prints
    progress itself, paratune.progress). tune.run reports to the first such reporter among the
    callbacks, so the one Tune appends by itself (at AirVerbosity 0 here) only ever gets calls
    that print nothing at that verbosity. `paratune tune --verbose` leaves Tune's own in place."""

    _heartbeat_threshold = _start_end_verbosity = _intermediate_result_verbosity = AirVerbosity.DEFAULT

    def __init__(self) -> None:
        super().__init__(AirVerbosity.SILENT)

    def experiment_started(self, *args: Any, **kwargs: Any) -> None:
        """Tune prints the banner, the result folder and the TensorBoard hint here, whatever the verbosity."""

    def print_heartbeat(self, trials, *args: Any, force: bool = False) -> None:
        """No trial-status table (paratune's progress line says how far the sweep is)."""


class _LedgerCallback(Callback):
    """Driver side: as each trial finishes, record it in the ledger and MLflow, and say so (with
    the sweep's progress: paratune.progress)."""

    def __init__(self, ledger: Ledger, tracker, parent: str, budget_gb: float | None, console: Console, total: int,
                 plans: dict[str, dict], calibration=None, predictions: TimePredictions | None = None,
                 progress: SweepProgress | None = None, display: ProgressDisplay | None = None):
        self.ledger, self.tracker, self.parent, self.plans = ledger, tracker, parent, plans
        self.calibration, self.predictions = calibration, predictions
        self.budget_gb, self.console, self.total = budget_gb, console, total
        self.progress = progress or SweepProgress(total)
        self.display = display

    def __getstate__(self) -> dict:
        # Tune pickles its callbacks with the experiment state; the live MLflow client and
        # console stay behind (paratune resumes from its own ledger, never from Tune's state).
        return {"total": self.total}

    def _record(self, key: str, result: TrialResult, trial_id: str | None = None) -> None:
        if key in self.ledger.keys():
            return
        number = len(self.ledger.search_entries()) + 1
        result = apply_budget(result, self.budget_gb)
        metrics = _observe(self.calibration, result)
        predicted = self.predictions.observe(key, result) if self.predictions is not None else {}
        metrics.update(predicted)  # the calibrated model's step time replaces the roofline's
        # The ledger first (the durable record), then MLflow (idempotent; a resume fills gaps).
        self.ledger.append(LedgerEntry(number, key, result, "search", predicted_only(metrics)))
        log_trial_or_say(self.tracker, self.parent, number, result, self.console, extra_metrics=metrics)
        if result.ok:
            what = f"{result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
        elif result.stopped_early:
            what = f"[yellow]stopped early[/yellow] ({escape(result.message or '')})"
        else:
            what = f"[red]{result.reason}[/red]: {escape(result.message or '')}"
        if "step_time_prediction_error" in predicted:
            what += f" (predicted {predicted['predicted_step_time_s']:.3g} s/step, {predicted['step_time_prediction_error']:+.0%})"
        env = env_label(result.plan.get("env"))
        label = strategy_label(result.plan) + (f" {env}" if env else "")
        self.progress.finish(trial_id, label, result.tokens_per_s_per_gpu, result.ok)
        live = self.display is not None and self.display.is_live  # the live line shows the rest
        self.console.print(format_trial_line(number, self.total, label, what,
                                             None if live else escape(status_text(self.progress))),
                           soft_wrap=True)  # one line per trial, however narrow the log's console

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.start(trial.trial_id)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        if "trial_result" in last:
            self._record(last["point"], TrialResult.model_validate_json(last["trial_result"]), trial.trial_id)
        self.progress.running.discard(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info):
        key = trial.config.get("point")
        if key in self.plans:
            error = info.get("error") or getattr(trial, "error_msg", None) or "the Tune trial itself failed"
            self._record(key, TrialResult.failed(self.plans[key], "error", str(error)[:2000]), trial.trial_id)
        self.progress.running.discard(trial.trial_id)


def log_trial_or_say(tracker, parent: str, number: int, result: TrialResult, console: Console,
                     phase: str = "search", extra_metrics: dict[str, float] | None = None) -> None:
    """Log a trial to MLflow, or say why not and go on. The ledger is the sweep's record and MLflow
    its view: a tracking server down past MLflow's own retries must not end a sweep of hours. The
    trial is logged when the sweep ends (sync_ledger), or by `--resume`."""
    try:
        tracker.log_trial(parent, number, result, phase=phase, extra_metrics=extra_metrics)
    except Exception as err:  # noqa: BLE001 - see the docstring
        console.print(f"[yellow]MLflow: {phase} trial {number} not logged ({type(err).__name__}: "
                      f"{escape(str(err))[:300]}); it is in the ledger, and is logged when the sweep ends "
                      "or on --resume[/yellow]", soft_wrap=True)


def _finish(space: Space, report: SweepReport, ledger: Ledger, tracker, budget_gb: float | None, console: Console,
            calibration=None, pool: str | None = None) -> None:
    """Re-measure the top plans side by side, decide with the noise, check parity, export."""
    from paratune.export import export_winner
    from paratune.verdict import Standing, complexity, decide

    settings = space.spec.search
    standings: dict[str, Standing] = {}
    for e in ledger.entries:
        if e.result.ok:
            s = standings.setdefault(e.key, Standing(e.key, strategy_label(e.result.plan), e.result.plan))
            s.results.append(e.result)
    top = sorted(standings.values(), key=lambda s: -s.median)[: settings.top_k]
    rounds_done = max((sum(1 for e in ledger.entries if e.phase == "remeasure" and e.key == s.key) for s in top), default=0)
    if len(top) > 1:
        for round_ in range(rounds_done, settings.remeasure_rounds):
            for s in top:  # interleaved: every plan once per round, so drift hits all alike
                result = apply_budget(measure_plan(s.plan, None, pool), budget_gb)
                number = len(ledger.entries) + 1
                ledger.append(LedgerEntry(number, s.key, result, "remeasure"))
                log_trial_or_say(tracker, report.parent_run_id, number, result, console, phase="remeasure")
                s.results.append(result)
                console.print(f"re-measure {round_ + 1}/{settings.remeasure_rounds} {s.label}: "
                              f"{result.tokens_per_s_per_gpu or 0:,.0f} tokens/s/GPU")
    verdict = decide(list(standings.values()))
    # A fast plan that trains wrong is never the winner: check parity, fall back down the ranking.
    # A check that cannot run is a failed check with its reason, never the end of the sweep.
    winner, parity = None, None
    order: list[Standing] = []
    for s in [verdict.winner, *sorted(verdict.tied_with_best, key=lambda t: complexity(t.plan)), *verdict.ranked]:
        if s is not None and s not in order:
            order.append(s)
    for candidate in order:
        check = winner_parity(candidate.plan, candidate.results[0])
        report.parity_checks.append(check.to_record(candidate.label, candidate.key))
        if check.passed:
            winner, parity = candidate, check
            break
        report.parity_failures.append({"label": candidate.label, "key": candidate.key, "reason": check.reason})
        console.print(f"[red]{escape(candidate.label)} fails loss parity ({escape(check.reason)}); not a winner[/red]")
    verdict.winner = winner
    report.verdict = verdict
    # For the sweep report (paratune.sweep_report): every check, the losses it compared.
    (report.out_dir / "parity.json").write_text(json.dumps(report.parity_checks, indent=1) + "\n")
    report.winner_parity = parity.max_abs_loss_diff if parity is not None else None
    launch = sum(e.result.launch_s or 0 for e in ledger.entries)
    measured = sum(sum(e.result.step_times_s) for e in ledger.entries)
    wall = sum(e.result.wall_s or 0 for e in ledger.entries)
    report.time_split = {"trials_wall_s": wall, "launch_s": launch, "measured_s": measured,
                         "other_s": max(0.0, wall - launch - measured)}
    best_metrics: dict[str, float] = {}
    summary: dict[str, Any] | None = None
    if winner is not None:
        plan = load_plan_dict(winner.plan)
        summary = {"sweep": space.spec.name, "label": winner.label, "tokens_per_s_per_gpu_median": winner.median,
                   "relative_spread": winner.relative_spread, "measurements": len(winner.values),
                   "parity_max_abs_loss_diff": parity.max_abs_loss_diff, "parity_proxy": parity.proxy,
                   "parity_failed_above": report.parity_failures,
                   "tied_with": [s.label for s in verdict.tied_with_best],
                   "mfu": winner.results[0].mfu, "peak_memory_bytes": winner.results[0].peak_memory_bytes}
        report.winner_dir = out_dir_winner = report.out_dir / "winner"
        export_winner(plan, out_dir_winner, summary)
        # The child runs' names with best_ before them, so the parent lines up with its trials.
        first = winner.results[0]
        best_metrics = {"tokens_per_s_per_gpu": winner.median, "measurement_spread": winner.relative_spread,
                        "parity_max_abs_loss_diff": parity.max_abs_loss_diff,
                        **({"mfu": first.mfu} if first.mfu is not None else {}),
                        **({"step_time_spread": first.step_time_spread} if first.step_time_spread is not None else {}),
                        **({"peak_memory_gib": max(first.peak_memory_bytes) / 2**30} if first.peak_memory_bytes else {})}
    if calibration is not None:
        report.calibration = {"device": calibration.device.name, **calibration.summary()}
    from paratune.tracking import sweep_note

    note = sweep_note(summary, report.winner_dir, report.parity_failures)
    try:
        _log_sweep_end(tracker, report, ledger, best_metrics, winner.plan if winner else None, note, console)
    except Exception as err:  # noqa: BLE001 - the results are on disk: MLflow down must not lose them
        console.print(f"[yellow]MLflow: the sweep's end is not logged ({type(err).__name__}: {escape(str(err))[:300]}); "
                      f"its results are in {report.out_dir}; the same command with `--resume` logs them[/yellow]",
                      soft_wrap=True)


def _log_sweep_end(tracker, report: SweepReport, ledger: Ledger, best_metrics: dict[str, float],
                   winner: dict[str, Any] | None, note: str, console: Console) -> None:
    """The parent run's last writes: what MLflow missed of the ledger (the server was down, or a
    lost answer left a run half-written), parity failures, calibration, winner, status."""
    from mlflow.entities import Metric

    filled = tracker.sync_ledger(report.parent_run_id, ledger.entries)
    if filled:
        console.print(f"logged {filled} trial(s) to MLflow that it missed during the sweep")
    if report.parity_failures:
        tracker.client.set_tag(report.parent_run_id, "paratune.parity_failures",
                               "\n".join(f"{f['label']}: {f['reason']}" for f in report.parity_failures)[:5000])
    if report.calibration:
        tracker.client.log_batch(report.parent_run_id, metrics=[
            Metric(f"calibration_{k}", float(v), 0, 0) for k, v in report.calibration.items() if isinstance(v, float)])
    tracker.finish_parent(report.parent_run_id, best_metrics, winner, report.winner_dir, note=note)


def parity_tolerance(plan: Plan) -> float:
    return 1e-4 if plan.precision == "fp32" else 0.05


PARITY_MAX_REFERENCE_PARAMS = 200_000_000
# The proxy that stands in for a bigger model: a few small layers of the same family.
PROXY_HEAD_DIM = 16
PROXY_VOCAB = 512
PROXY_SEQ_LEN = 64
# Config keys that hold one entry per layer (transformers checks their length against the layers).
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


@dataclass(frozen=True)
class Parity:
    """One plan's loss-parity check against the single-process reference.

    A check that could not run (proxy not buildable, proxy trial failed, reference crashed)
    did not show that the plan trains correctly, so it fails, and `reason` says why.
    """

    passed: bool
    max_abs_loss_diff: float  # math.inf when nothing could be compared
    reason: str = ""  # why it failed; empty when it passed
    proxy: dict[str, Any] | None = None  # the proxy's shape (model overrides) when one stood in
    # What was compared (the plan's per-step losses, or its proxy's; the reference's): the sweep
    # report draws them. Empty where the check stopped before it had them.
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)

    def to_record(self, label: str, key: str) -> dict[str, Any]:
        """One entry of parity.json (math.inf and NaN as null: JSON has neither)."""
        return {"label": label, "key": key, "passed": self.passed, "max_abs_loss_diff": _finite(self.max_abs_loss_diff),
                "losses": [_finite(v) for v in self.losses], "reference_losses": [_finite(v) for v in self.reference_losses],
                "proxy": self.proxy, "reason": self.reason}


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def proxy_shape(plan: Plan) -> dict[str, Any]:
    """Model overrides that shrink the plan's model to a CPU-sized proxy on which the plan stays valid.

    The proxy keeps the family (model_type and every other config key, GQA or not) and is sized
    to the plan's degrees: heads and KV heads multiples of tp, vocab divisible by tp, at least as
    many layers as pipeline stages, hidden = heads x a small head dim.
    """
    from paratune.models import ffn_width_key, load_config_dict

    config = load_config_dict(plan.model, plan.model_overrides)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 1)
    tp = plan.tp
    grouped = heads > kv_heads
    # kv_heads is a multiple of tp (the plan is valid) and so is the rounded bound: so is their minimum.
    proxy_kv = min(kv_heads, _round_up(2 if grouped else 4, tp))
    proxy_heads = proxy_kv * 2 if grouped else proxy_kv
    hidden = proxy_heads * PROXY_HEAD_DIM
    stages = plan.pp * (2 if plan.pp_schedule == "interleaved_1f1b" else 1)
    proxy_layers = max(2, stages)
    # Tokens from a tokenizer can be any id of the model's vocab (already divisible by tp).
    vocab = int(config["vocab_size"]) if plan.data.tokenizer is not None else _round_up(PROXY_VOCAB, tp)
    shape: dict[str, Any] = {"num_hidden_layers": proxy_layers, "hidden_size": hidden,
                             ffn_width_key(config): 2 * hidden, "num_attention_heads": proxy_heads,
                             "vocab_size": vocab}
    if "num_key_value_heads" in config or grouped:  # families without GQA (GPT-NeoX, OPT) have no such key
        shape["num_key_value_heads"] = proxy_kv
    if "head_dim" in config:
        shape["head_dim"] = PROXY_HEAD_DIM
    for key in PER_LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, list) and len(value) == layers:
            shape[key] = [value[i % layers] for i in range(proxy_layers)]
    return shape


def parity_proxy(plan: Plan) -> Plan:
    """The same plan (strategy, degrees, batch split, precision) on the proxy model, short and cheap.

    Raises PlanError if even the sized proxy breaks a plan rule (winner_parity turns that into
    a failed check)."""
    return plan.with_changes(model_overrides={**plan.model_overrides, **proxy_shape(plan)},
                             seq_len=min(plan.seq_len, PROXY_SEQ_LEN), warmup_steps=1, measure_steps=2,
                             grad_accum=plan.grad_accum)


def winner_parity(plan: Plan | dict[str, Any], result: TrialResult) -> Parity:
    """Whether the plan's per-step losses match the single-process reference on the same global
    batch (max difference within parity_tolerance).

    For a model too big to train on the driver's CPU, the same plan is re-run on a proxy sized
    to the plan (parity_proxy) and that run is compared instead. Never raises: `_finish` calls
    it after the last trial, and an exception there would lose the whole sweep's winner.
    """
    from paratune.models import build_config, parameter_counts
    from paratune.reference import max_loss_difference, reference_losses

    shape, step = None, "loading the plan"
    losses: list[float] = []
    reference: list[float] = []
    try:
        plan = plan if isinstance(plan, Plan) else load_plan_dict(plan)
        step = "building the model"
        if parameter_counts(build_config(plan.model, plan.model_overrides))["total"] > PARITY_MAX_REFERENCE_PARAMS:
            step = "sizing the proxy"
            shape = proxy_shape(plan)
            plan = parity_proxy(plan)
            step = "building the proxy"
            size = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
            if size > PARITY_MAX_REFERENCE_PARAMS:
                return Parity(False, math.inf, f"proxy has {size:,} parameters, over the "
                              f"{PARITY_MAX_REFERENCE_PARAMS:,} a reference on the driver's CPU allows", shape)
            step = "running the proxy trial"
            result = run_trial(plan)
            if not result.ok:
                message = f"proxy trial failed: {result.reason}: {result.message or ''}"
                return Parity(False, math.inf, message[:2000], shape, list(result.losses))
        losses = list(result.losses)
        step = "running the reference"
        reference = list(reference_losses(plan, steps=len(losses)))
        diff = max_loss_difference(losses, reference)
    except Exception as err:  # noqa: BLE001 - any check that cannot run is a failed check, with its reason
        message = f"parity check failed while {step}: {type(err).__name__}: {err}"
        return Parity(False, math.inf, message[:2000], shape, losses, reference)
    tolerance = parity_tolerance(plan)
    if diff <= tolerance:
        return Parity(True, diff, "", shape, losses, reference)
    return Parity(False, diff, f"max |loss - reference| {diff:.3g} over tolerance {tolerance:g}", shape, losses,
                  reference)
