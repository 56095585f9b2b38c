"""The sweep's driver: `run_sweep` from a space to a winner, and the Ray Tune run of its trials.

Ray Tune + Optuna over a space's valid plans, every trial in MLflow, a winner ready to use. The
driver resolves the sweep's settings once (SweepSettings), starts or resumes its folder and its
MLflow parent run, prunes and ranks the plans with the cost model, runs the trials as one Tune
run (grid, TPE/random or calibrated: paratune.sweep.searchers), and ends with
paratune.sweep.finish. Every finished trial goes into the ledger first (paratune.sweep.ledger),
so `--resume` loses and repeats none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from paratune.trial.failures import explain
from paratune.config.plan import load_plan_dict
from paratune.out.progress import ProgressDisplay, SweepProgress
from paratune.sweep.space import Space
from paratune.sweep.cluster import (close_leases, close_pool, concurrency, device_tag, pool_runner, prune_unplaceable,
                                    start_leases, start_pool, trainable)
from paratune.sweep.finish import SweepOutcome, finish_sweep, write_page
from paratune.sweep.ledger import Ledger, SweepError, candidate_key, observe_calibration, point_key
from paratune.sweep.searchers import (TimePredictions, all_points, calibrated_searcher,
                                      optuna_searcher)
from paratune.sweep.stopping import SweepStopRule
from paratune.out.tables import env_label, shared_env, strategy_label
from paratune.cluster.launch import ensure_ray
from paratune.costs.risk import LaunchRisk


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SweepSettings:
    """One sweep's settings, resolved once: the space's `search` section with the caller's
    overrides, its memory budget, and the folder the sweep keeps its files in."""

    out_dir: Path
    trials: int
    algorithm: str
    seed: int
    budget_gb: float | None
    verbose: bool = False  # Ray Tune's own console output as well
    report_page: bool = True  # write the sweep report at the end

    @classmethod
    def resolve(cls, space: Space, out_dir: Path, trials: int | None = None, algorithm: str | None = None,
                seed: int | None = None, verbose: bool = False, report_page: bool = True) -> "SweepSettings":
        search = space.spec.search
        return cls(out_dir=out_dir.resolve(), trials=trials or search.trials, algorithm=algorithm or search.algorithm,
                   seed=search.seed if seed is None else seed, budget_gb=space.spec.objective.memory_budget_gb,
                   verbose=verbose, report_page=report_page)

    @property
    def state_path(self) -> Path:
        """sweep.json: the space's digest, the MLflow store and parent run (what --resume checks)."""
        return self.out_dir / "sweep.json"

    @property
    def stop_file(self) -> Path:
        """stopped.json: why the calibrated search stopped measuring, once it has."""
        return self.out_dir / "stopped.json"


@dataclass
class SweepRun:
    """A started sweep: the space it measures (pruned), its points' plans, its ledger and MLflow
    parent run, the cost models, and where its trials run (a worker-group pool or node leases)."""

    settings: SweepSettings
    space: Space
    plans: dict[str, dict[str, Any]]
    ledger: Ledger
    tracker: Any
    parent: str
    console: Console
    calibration: Any = None  # the roofline (estimate.Roofline), refitted on every trial; None: no predictions
    predictions: TimePredictions | None = None  # the calibrated search's step-time model
    fastest_first: list[str] = field(default_factory=list)  # candidate keys in launch order (paratune.costs.risk)
    pool: str | None = None
    leases: str | None = None


# --------------------------------------------------------------------------- the sweep
def _space_digest(space: Space) -> str:
    text = space.source.read_text() if space.source else json.dumps(space.spec.model_dump(), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sweep_state(settings: SweepSettings, digest: str, resume: bool) -> dict[str, Any]:
    """sweep.json when resuming (the same space's), else {}; a SweepError where neither can be."""
    state_path = settings.state_path
    if state_path.exists() and not resume:
        raise SweepError(f"{settings.out_dir}: a sweep already lives here; use --resume to continue it or another --out")
    if resume and state_path.exists():
        state = json.loads(state_path.read_text())
        if state["space_digest"] != digest:
            raise SweepError(f"{settings.out_dir}: the space file changed since this sweep started; use another --out")
        return state
    return {}


def _start_parent(space: Space, settings: SweepSettings, tracker, digest: str) -> dict[str, Any]:
    """A new sweep's MLflow parent run, and its sweep.json."""
    first = space.candidates[0].plan
    state = {"space_digest": digest, "tracking_uri": tracker.tracking_uri, "algorithm": settings.algorithm,
             "seed": settings.seed, "memory_budget_gb": settings.budget_gb,
             "parent_run_id": tracker.start_parent(
                 space.spec.name, space.source,
                 params={**{f"fixed.{k}": v for k, v in space.spec.fixed.items()}, "search.algorithm": settings.algorithm,
                         "search.trials": settings.trials, "search.seed": settings.seed,
                         "space.candidates": len(space.candidates), "space.combinations": space.total_combinations},
                 tags={"paratune.model": first.model, "paratune.world_size": str(first.num_workers),
                       "paratune.device": device_tag(), "paratune.space": space.spec.name})}
    settings.state_path.write_text(json.dumps(state, indent=2))
    return state


def run_sweep(space: Space, out_dir: Path, *, trials: int | None = None, algorithm: str | None = None,
              seed: int | None = None, resume: bool = False, tracking_uri: str | None = None,
              ray_address: str | None = None, console: Console | None = None, verbose: bool = False,
              report_page: bool = True, pool: str | None = None) -> SweepOutcome:
    """The whole sweep (see the module doc); `verbose`: Ray Tune's own console output as well.
    Ends by writing the sweep report (paratune.sweep.page) and logging it to the parent run;
    `report_page=False` skips it (seconds of plotting a test of something else need not pay).
    `pool`: the name of a running worker-group pool (paratune.cluster.session.get_pool_actor) to measure
    in, left running afterwards, so that sweeps one after another in one Ray session (a notebook,
    a test session) launch their workers once; by default each sweep starts and closes its own.
    A space with `reuse_workers: false` never uses one."""

    from paratune.out.tracking import SweepTracker

    console = console or Console()
    settings = SweepSettings.resolve(space, out_dir, trials, algorithm, seed, verbose, report_page)
    digest = _space_digest(space)
    state = _sweep_state(settings, digest, resume)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(settings.out_dir / "ledger.jsonl")
    tracker = SweepTracker(tracking_uri or state.get("tracking_uri"))
    ensure_ray(ray_address)
    space = prune_unplaceable(space, console)  # before MLflow: a sweep that cannot start leaves no run

    t_sweep = time.perf_counter()
    if not state:
        state = _start_parent(space, settings, tracker, digest)
    parent = state["parent_run_id"]
    space, calibration, fastest_first = _predict(space, settings.budget_gb, console)
    if calibration is not None and state.get("device") != calibration.device.name:  # the report's compare.png
        state["device"] = calibration.device.name  # finds the sweep's cluster by it (device x num_workers)
        settings.state_path.write_text(json.dumps(state, indent=2))
    console.print(space.pruning_report())
    shared = {**shared_env(c.plan.env for c in space.candidates),
              **{k: str(v[0]) for k, v in space.env_choices.items() if len(set(map(str, v))) == 1}}
    if shared:  # said once here; the trial lines show only the settings that differ
        console.print(f"every plan runs with {escape(env_label(shared))}")
    done = len(ledger.search_entries())
    remaining = max(0, settings.trials - done)
    if done:
        console.print(f"resuming: {done} finished trial(s) kept, {remaining} to run")
    if resume and ledger.entries:
        filled = tracker.sync_ledger(parent, ledger.entries)
        if filled:
            console.print(f"logged {filled} finished trial(s) to MLflow that the interrupted driver had not")
    plans = {point_key(p["choices"], p["env"]): space.plan_for(p["choices"], p["env"]).to_dict()
             for p in all_points(space)}
    remaining = min(remaining, len(plans) - len(ledger.keys()))
    stop_file = settings.stop_file
    reuse_workers = space.spec.search.reuse_workers
    own_pool = reuse_workers and pool is None
    pool = (pool or start_pool(console)) if reuse_workers else None
    leases = None if pool else start_leases()
    run = SweepRun(settings, space, plans, ledger, tracker, parent, console, calibration,
                   fastest_first=fastest_first, pool=pool, leases=leases)
    try:
        profile_s = 0.0
        if settings.algorithm == "calibrated":
            run.predictions, profile_s = _time_predictions(space, plans, calibration, pool, console)
            if run.predictions is not None and calibration is not None:  # P(fits), re-judged after each trial
                run.predictions.risk = LaunchRisk(calibration, run.predictions.plans, space.spec.estimate.margin,
                                                  space.spec.estimate.skip_predicted_oom)
        if remaining > 0 and not (settings.algorithm == "calibrated" and stop_file.exists()):
            _search(run, done, remaining)
        outcome = SweepOutcome(settings.out_dir, parent, ledger.entries, pruning=space.pruning_report())
        if stop_file.exists():
            outcome.stop_reason = json.loads(stop_file.read_text())["reason"]
            console.print(f"[bold]search stopped[/bold] after {len(ledger.search_entries())} of {len(plans)} plans: "
                          f"{escape(outcome.stop_reason)}")
            tracker.client.set_tag(parent, "paratune.stop_reason", outcome.stop_reason[:5000])
        if calibration is not None and not calibration.errors:  # resumed: calibrate on the ledger
            for e in ledger.search_entries():
                observe_calibration(calibration, e.result)
        if run.predictions is not None:
            outcome.time_model = _time_model_summary(run.predictions)
            _say_memory_recalibration(run.predictions, tracker, parent, outcome, console)
        finish_sweep(space, outcome, ledger, tracker, settings.budget_gb, console, calibration, pool)
    finally:
        if own_pool and pool is not None:
            close_pool(pool)
        if leases is not None:
            close_leases(leases)
    outcome.time_split["profile_s"] = profile_s
    outcome.time_split["sweep_wall_s"] = time.perf_counter() - t_sweep
    if settings.report_page:
        # `tune` ends saying where it is
        outcome.report_path = write_page(settings.out_dir, tracker, parent, console, announce=False)
    return outcome


def _search(run: SweepRun, done: int, remaining: int) -> None:
    """The trials, as a Ray Tune run: grid (every point, predicted fastest first), TPE/random
    (Optuna) or calibrated (the step-time model and the stopping rule). Tune's own console
    output only with `verbose`; paratune's progress line always."""
    from ray import tune

    from paratune.sweep.callbacks import LedgerCallback, QuietTuneOutput

    space, plans, ledger, settings = run.space, run.plans, run.ledger, run.settings
    algorithm, verbose, out_dir = settings.algorithm, settings.verbose, settings.out_dir
    search = space.spec.search
    early_stop_steps = search.early_stop_min_steps if search.early_stop else None
    progress = SweepProgress(total=done + remaining, done=done, first_done=done)
    display = ProgressDisplay(progress, run.console)
    callback = LedgerCallback(ledger, run.tracker, run.parent, settings.budget_gb, run.console, total=done + remaining,
                              plans=plans, calibration=run.calibration, predictions=run.predictions, progress=progress,
                              display=display)
    # Tune's trainable only hands a plan to its measurement (the worker-group pool or run_trial) and
    # reports: every trial asks the same resources, so one actor serves trial after trial
    # (reuse_actors) instead of a new Ray process, with its imports, per trial.
    tuned = tune.with_resources(
        tune.with_parameters(trainable, plans=plans, storage=str(out_dir / "ray"), pool=run.pool, leases=run.leases),
        {"CPU": 0, "memory": 1},  # the trial's workers hold the CPUs; 1 CPU here deadlocks 2-CPU clusters
    )
    param_space: dict[str, Any] = {}
    if algorithm == "grid":  # the exhaustive reference: every point measured fully, never stopped early
        # Env-major (plans of one env share a reused worker group), then predicted fastest first.
        rank = {key: i for i, key in enumerate(run.fastest_first)}
        todo = sorted((k for k in plans if k not in ledger.keys()),
                      key=lambda k: (json.dumps(json.loads(k)["env"], sort_keys=True), rank.get(candidate_key(k), len(rank))))
        tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=concurrency(space), reuse_actors=True)
        param_space = {"point": tune.grid_search(todo[:remaining])}
    elif algorithm == "calibrated" and run.predictions is not None:
        tune_config = tune.TuneConfig(
            search_alg=calibrated_searcher(run.predictions, ledger, settings.budget_gb, early_stop_steps,
                                           settings.stop_file,
                                           SweepStopRule() if search.stopping_rule else SweepStopRule(min_trials=10**9)),
            num_samples=remaining, max_concurrent_trials=concurrency(space), reuse_actors=True)
    else:
        if algorithm == "calibrated":
            run.console.print("[yellow]no step-time model: searching with TPE instead[/yellow]")
            algorithm = "tpe"
        tune_config = tune.TuneConfig(
            search_alg=optuna_searcher(space, algorithm, settings.seed, ledger, settings.budget_gb, settings.trials,
                                       first=[point_key(json.loads(key), (space.env_grid() or [{}])[0]) for key in
                                              run.fastest_first[: space.spec.estimate.start_from_predicted]],
                                       early_stop_steps=early_stop_steps),
            num_samples=remaining, max_concurrent_trials=concurrency(space), reuse_actors=True)
    callbacks = [callback] if verbose or not QuietTuneOutput.available else [callback, QuietTuneOutput()]
    tuner = tune.Tuner(tuned, param_space=param_space, tune_config=tune_config,
                       run_config=tune.RunConfig(name=f"tune-{len(ledger.entries)}", storage_path=str(out_dir / "tune"),
                                                 callbacks=callbacks, verbose=1 if verbose else 0))
    # Tune also logs where it wrote its state ("Wrote the latest version of all result files ..."):
    # paratune's own ledger is the sweep's record, so that line is Tune's detail too (--verbose).
    tune_logger = logging.getLogger("ray.tune")
    level = tune_logger.level
    # Quiet: Tune's legacy output flow (RAY_AIR_NEW_OUTPUT=0, read by tune.run when fit starts). The
    # new flow always appends a console reporter of its own beside ours and sets up only the first, and
    # that one's on_trial_error raised (its start time None) when a trial died with its node: Tune turned
    # it into a TuneError that ended the sweep (test_cluster_jobs' fault sweep). At verbose 0 the legacy
    # flow prints nothing. --verbose keeps Tune's new output.
    new_output = os.environ.get("RAY_AIR_NEW_OUTPUT")
    if not verbose:
        tune_logger.setLevel(logging.WARNING)
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        with display:
            tuner.fit()
    finally:
        tune_logger.setLevel(level)
        if not verbose:  # the caller's own setting back, or none
            os.environ.pop("RAY_AIR_NEW_OUTPUT")
            if new_output is not None:
                os.environ["RAY_AIR_NEW_OUTPUT"] = new_output


# --------------------------------------------------------------------------- the cost models
def _predict(space: Space, budget_gb: float | None, console: Console):
    """The cost model before anything runs: skip plans predicted not to fit (counted with the
    static pruning, reason and an example recorded), rank the rest by expected gain
    (paratune.costs.risk.order_by_expected_gain). Returns (the space without the skipped plans,
    the calibration, candidate keys in launch order)."""
    import dataclasses

    import ray

    from paratune.config.devices import device_for_cluster
    from paratune.costs.estimate import Roofline
    from paratune.costs.risk import order_by_expected_gain

    settings = space.spec.estimate
    first = space.candidates[0].plan
    try:
        device = device_for_cluster(settings.device, ray.cluster_resources(), first.num_workers)
        capacity = min(device.memory_gib, budget_gb) if budget_gb else device.memory_gib
        calibration = Roofline(device, capacity)
        estimates = {c.key: calibration.predict(c.plan, settings.margin) for c in space.candidates}
    except Exception as err:  # noqa: BLE001 - the sweep still runs, unguided, and says so
        console.print(f"[yellow]no predictions ({escape(explain(err))}); "
                      "every plan will be measured[/yellow]")
        return space, None, []
    # a plan within its memory band of the capacity (tight) is measured: the trial settles it
    kept = [c for c in space.candidates if estimates[c.key].measurable or not settings.skip_predicted_oom]
    if not kept:
        smallest = min(estimates.values(), key=lambda e: e.memory.total)
        raise SweepError(f"every plan is predicted not to fit on {device.name}; the smallest: "
                         f"{strategy_label(smallest.plan.to_dict())}: {smallest.overflow}. Raise "
                         "estimate.margin, add sharding/offload/checkpointing to the space, or set "
                         "estimate.skip_predicted_oom: false to measure anyway")
    removed, examples = space.removed.copy(), dict(space.examples)
    for c in space.candidates:
        if c not in kept:
            rule = (f"predicted out of memory on {device.name} (over {estimates[c.key].capacity_bytes / 2**30:.1f} GiB "
                    f"by > {settings.margin:.0%}, beyond the prediction's band)")
            if estimates[c.key].refusal:  # the device cannot run its levers (paratune.levers.device_refusal)
                rule = f"refused on {device.name}: {estimates[c.key].refusal.split(':')[0]}"
            removed[rule] += 1
            examples.setdefault(rule, f"{strategy_label(c.plan.to_dict())}: {estimates[c.key].overflow}")
    space = dataclasses.replace(space, candidates=kept, removed=removed, examples=examples)
    # Launch order: by expected gain (paratune.costs.risk: speed x P(fits), a doomed launch's time
    # counted), no longer fastest first: the fastest tight plan is often the one furthest over.
    key_of = {id(estimates[c.key]): c.key for c in kept}
    ordered = order_by_expected_gain(estimates[c.key] for c in kept)
    return space, calibration, [key_of[id(e)] for e in ordered]


def _time_predictions(space: Space, plans: dict[str, dict], calibration, pool: str | None,
                      console: Console) -> tuple[TimePredictions | None, float]:
    """The calibrated step-time model: the cluster's profile for these plans (stored per model,
    device, cluster and env, so later sweeps reuse it; measured now if not), or the roofline
    when profiling fails. Returns (predictions, seconds spent profiling)."""
    t0 = time.perf_counter()
    try:
        from paratune.costs.profile import ProfileStore, profile_requests_for
        from paratune.cluster.profiling import run_profile
        from paratune.costs.timemodel import StepTimeModel

        store = ProfileStore()
        device_name = calibration.device.name if calibration is not None else device_tag()
        profiles = []
        for request in profile_requests_for([load_plan_dict(p) for p in plans.values()]):
            profile = store.get(request, device_name)
            if profile is None:
                with console.status(f"profiling the cluster for the step-time model ({_request_label(request)})"):
                    profile = run_profile(request, runner=pool_runner(pool, request))
                store.put(profile, device_name)
                console.print(f"profiled {_request_label(request)} in {time.perf_counter() - t0:.0f} s")
            else:
                console.print(f"step-time model: the stored profile for {_request_label(request)}")
            profiles.append(profile)
        return TimePredictions(StepTimeModel(profiles), plans, "profile"), time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 - the sweep still runs, on the roofline, and says so
        console.print(f"[yellow]no profile ({escape(explain(err))}); the calibrated search "
                      "orders plans by the roofline instead[/yellow]")
        if calibration is None:
            return None, time.perf_counter() - t0
        from paratune.costs.estimate import Roofline
        from paratune.costs.predict import RooflinePredictor

        roofline = RooflinePredictor(Roofline(calibration.device, calibration.capacity_gib))  # its own refits
        return TimePredictions(roofline, plans, "roofline"), time.perf_counter() - t0


def _request_label(request) -> str:
    env = env_label(request.env)
    return f"{request.world_size} workers" + (f", {env}" if env else "")


def _time_model_summary(predictions: TimePredictions) -> dict[str, Any]:
    import statistics

    errors = predictions.errors()
    out: dict[str, Any] = {"source": predictions.source, "trials": len(errors),
                           "error_band": float(predictions.model.error_band())}
    if errors:
        out.update(median_abs_error=statistics.median(errors), worst_abs_error=max(errors))
    return out


def _say_memory_recalibration(predictions: TimePredictions, tracker, parent: str, outcome: SweepOutcome,
                              console: Console) -> None:
    """The memory scales the trials taught (into the parent run's calibration_ metrics, with the
    roofline's) and the plans passed over for them (said, and tagged on the parent run)."""
    risk = predictions.risk
    if risk is None:
        return
    outcome.calibration.update(risk.calibration.summary())
    if risk.passed_over:
        labels = {k: strategy_label(predictions.plans[k].to_dict()) for k in risk.passed_over}
        text = "\n".join(f"{labels[k]}: {why}" for k, why in risk.passed_over.items())
        console.print(f"{len(risk.passed_over)} plan(s) not launched: predicted out of memory once the trials "
                      f"recalibrated the memory model:\n{escape(text)}", soft_wrap=True)
        tracker.client.set_tag(parent, "paratune.skipped_after_recalibration", text[:5000])
