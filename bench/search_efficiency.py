"""How much of a space must a sweep measure to find its best plan? TPE, random, calibrated.

1. Measure every plan of bench/search_efficiency_space.yaml on CPU (a real grid sweep through
   `run_sweep`, worker groups reused): the exhaustive table, with each plan's step times.
2. Profile the cluster for those plans (paratune.costs.profile) and build the step-time model.
3. Replay each searcher against the table for 10 seeds. A replayed measurement of a plan is a
   bootstrap resample (seeded) of its measured steps, so every seed sees different noise; the
   quality of a search after n trials is the *table* value of the plan it would pick (the best
   it observed), relative to the table's best. Every searcher gets early stopping as the sweep
   gives it (measure.TrialStopRule against its incumbent), and each trial costs its measured wall
   time (a stopped trial: its launch and the steps it ran). The calibrated search is the sweep's
   own: paratune.sweep.stopping.SweepStopRule over StepTimeModel predictions, refitted after every trial.
4. The model's ranking: predicted (profile only, before any trial) vs measured tokens/s: Kendall
   tau and whether the measured best is in the predicted top 3; and each trial's step time
   predicted before it ran, in the calibrated order (out of sample).

    .venv/bin/python bench/search_efficiency.py [--reuse DIR]   # writes bench/results/search_efficiency.*
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

from paratune.costs.measure import TrialStopRule, step_stats, tokens_per_second_per_gpu  # noqa: E402
from paratune.config.plan import load_plan_dict  # noqa: E402
from paratune.out.tables import env_label, strategy_label  # noqa: E402
from paratune.sweep.stopping import Incumbent, SweepStopRule  # noqa: E402
from paratune.sweep.space import load_space  # noqa: E402
from paratune.sweep.searchers import CandidateTree  # noqa: E402
from paratune.sweep.ledger import Ledger  # noqa: E402
from paratune.sweep.driver import run_sweep  # noqa: E402

HERE = Path(__file__).parent
SEEDS = range(10)
TARGET = 0.97  # within 3% of the grid's best
EARLY_STOP_STEPS = 2


# --------------------------------------------------------------------------- measuring
def measure_grid(space, out_dir: Path) -> dict[str, dict[str, Any]]:
    """Every point of the space measured fully (the grid never stops a trial early)."""
    ledger_path = out_dir / "ledger.jsonl"
    if not ledger_path.exists():
        run_sweep(space, out_dir, algorithm="grid", tracking_uri=f"sqlite:///{out_dir.parent / 'search_eff_mlflow.db'}")
    table = {}
    for e in Ledger(ledger_path).search_entries():
        r = e.result
        table[e.key] = {"plan": r.plan, "ok": r.ok, "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu or 0.0,
                        "step_times_s": r.step_times_s, "wall_s": r.wall_s or 0.0, "launch_s": r.launch_s or 0.0,
                        "spread": r.step_time_spread or 0.0,
                        "group_request": r.group_request}
    return table


def env_of(row: dict[str, Any]) -> str:
    return json.dumps(row["plan"].get("env") or {}, sort_keys=True)


def launch_costs(table: dict[str, dict[str, Any]]) -> tuple[dict[str, float], float]:
    """(a fresh worker group's launch per env: the grid's first trial of each group, the trial a
    reused group's launch): a replayed search pays the fresh one whenever its env changes."""
    fresh: dict[str, list[float]] = {}
    reused = []
    for row in table.values():
        if row["group_request"] == 1 or row["group_request"] is None:
            fresh.setdefault(env_of(row), []).append(row["launch_s"])
        else:
            reused.append(row["launch_s"])
    return {env: statistics.median(v) for env, v in fresh.items()}, statistics.median(reused or [0.0])


def build_profiles(plans: list, out_dir: Path) -> tuple[list, float]:
    """The step-time model's profiles for these plans, measured now (cached in out_dir)."""
    from paratune.costs.profile import ProfileStore, profile_requests_for
    from paratune.cluster.profiling import run_profile

    store = ProfileStore(out_dir / "profiles")
    t0 = time.perf_counter()
    profiles = []
    for request in profile_requests_for(plans):
        profile = store.get(request, "cpu")
        if profile is None:
            profile = run_profile(request)
            store.put(profile)
        profiles.append(profile)
    return profiles, time.perf_counter() - t0


# --------------------------------------------------------------------------- replaying
class Replay:
    """Measurements replayed from the table: bootstrap-resampled steps, early stopping, cost."""

    def __init__(self, table: dict[str, dict[str, Any]], seed: int):
        self.table, self.seed = table, seed
        self.fresh_launch, self.reused_launch = launch_costs(table)
        self.env: str | None = None  # the env of the worker group the last trial ran in
        self.best = max(v["tokens_per_s_per_gpu"] for v in table.values())
        self.observed: dict[str, dict[str, Any]] = {}  # key -> what the search saw
        self.spent_s = 0.0
        self.curve: list[float] = []  # after each trial: table value of the plan the search would pick
        self.wall: list[float] = []  # ... and the seconds spent so far

    def measure(self, key: str) -> dict[str, Any]:
        row = self.table[key]
        plan = load_plan_dict(row["plan"])
        seen: dict[str, Any] = {"ok": row["ok"], "stopped": False}
        # Its measured wall time, with the launch it pays here: a fresh group when the env
        # changes (the previous group is closed: one group fits on the cluster), else a reused one.
        launch = self.fresh_launch.get(env_of(row), row["launch_s"]) if env_of(row) != self.env else self.reused_launch
        cost = row["wall_s"] - row["launch_s"] + launch
        self.env = env_of(row) if row["ok"] else None  # a failure ends its group
        if row["ok"]:
            rng = random.Random(f"{self.seed}:{key}")
            steps = [rng.choice(row["step_times_s"]) for _ in row["step_times_s"]]
            incumbent = self.incumbent()
            if incumbent is not None:
                rule = TrialStopRule(incumbent.tokens_per_s_per_gpu, incumbent.spread, EARLY_STOP_STEPS)
                for n in range(EARLY_STOP_STEPS, len(steps)):
                    if rule.cannot_reach(plan.tokens_per_step, steps[:n], plan.num_workers):
                        cost -= sum(row["step_times_s"]) - sum(steps[:n])  # the steps it did not run
                        steps, seen["stopped"] = steps[:n], True
                        break
            stats = step_stats(steps)
            seen.update(tokens_per_s_per_gpu=tokens_per_second_per_gpu(plan.tokens_per_step, steps, plan.num_workers),
                        step_time_median_s=stats.median, spread=(stats.p90 - stats.p10) / stats.median)
        else:
            seen.update(tokens_per_s_per_gpu=0.0, step_time_median_s=None, spread=0.0)
        self.observed[key] = seen
        self.spent_s += cost
        picked = self.incumbent()
        self.curve.append(self.table[picked.key]["tokens_per_s_per_gpu"] / self.best if picked else 0.0)
        self.wall.append(self.spent_s)
        return seen

    def incumbent(self) -> Incumbent | None:
        full = {k: v for k, v in self.observed.items() if v["ok"] and not v["stopped"]}
        if not full:
            return None
        key = max(full, key=lambda k: full[k]["tokens_per_s_per_gpu"])
        return Incumbent(key, full[key]["tokens_per_s_per_gpu"], full[key]["spread"])

    def value(self, key: str) -> float:
        return self.observed[key]["tokens_per_s_per_gpu"] or 0.0

    def reached_at(self) -> int | None:
        return next((i + 1 for i, v in enumerate(self.curve) if v >= TARGET), None)


def replay_optuna(space, table, algorithm: str, seed: int) -> Replay:
    """TPE or random search as the sweep runs it (its CandidateTree; a repeat proposal is free)."""
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(5, len(table) // 3)))
               if algorithm == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    sample = CandidateTree(space).define_by_run()
    replay = Replay(table, seed)
    asks = 0
    # Until within 3% of the best (what the table reports), or every plan seen.
    while len(replay.observed) < len(table) and asks < 2000 and replay.reached_at() is None:
        asks += 1
        trial = study.ask()
        key = sample(trial)["point"]
        if key not in replay.observed:
            replay.measure(key)
        study.tell(trial, replay.value(key))
    return replay


def replay_calibrated(table, profiles, seed: int) -> tuple[Replay, str, list[dict[str, float]]]:
    """The calibrated sweep: fastest predicted first, refit after each trial, the stated stopping
    rule. Returns the replay, why it stopped, and each trial's out-of-sample prediction."""
    from paratune.costs.timemodel import StepTimeModel

    model = StepTimeModel(profiles)
    plans = {k: load_plan_dict(v["plan"]) for k, v in table.items()}
    rule = SweepStopRule()
    replay = Replay(table, seed)
    predictions: list[dict[str, float]] = []
    while True:
        predicted = {k: model.predict(p).tokens_per_s_per_gpu for k, p in plans.items()}
        full = sum(1 for v in replay.observed.values() if v["ok"] and not v["stopped"])
        decision = rule.decide(predicted, set(replay.observed), set(), replay.incumbent(), model.error_band(), full,
                               lambda k: label(table, k))
        if decision.stop:
            return replay, decision.reason, predictions
        seen = replay.measure(decision.next_key)
        if seen["step_time_median_s"]:
            out = model.observe(plans[decision.next_key], seen["step_time_median_s"])
            predictions.append({"key": decision.next_key, **out})


# --------------------------------------------------------------------------- ranking
def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two rankings (ties counted as neither concordant nor discordant)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def refit_accuracy(table, valid: list[str], profiles) -> tuple[list[float], float, list[float]]:
    """Out-of-sample step-time errors of the refitted model on the grid: leave-one-out (and the
    Kendall tau of those predictions), and sequential in predicted-fastest order."""
    from paratune.costs.timemodel import StepTimeModel

    plans = {k: load_plan_dict(table[k]["plan"]) for k in valid}
    measured = {k: statistics.median(table[k]["step_times_s"]) for k in valid}
    full = StepTimeModel(profiles)
    for k in valid:
        full.observe(plans[k], measured[k])
    loo = full.loo_errors()
    tau = kendall_tau([1 / (measured[k] * (1 + e)) for k, e in zip(valid, loo)], [1 / measured[k] for k in valid])
    model, left, sequential = StepTimeModel(profiles), set(valid), []
    while left:
        key = max(left, key=lambda k: model.predict(plans[k]).tokens_per_s_per_gpu)
        sequential.append(abs(model.observe(plans[key], measured[key])["step_time_prediction_error"]))
        left.remove(key)
    return [abs(e) for e in loo], tau, sequential


def label(table, key: str) -> str:
    plan = table[key]["plan"]
    return f"{strategy_label(plan)} {env_label(plan.get('env'))}".strip()


# --------------------------------------------------------------------------- report
def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--reuse", help="a folder with an earlier grid measurement (ledger.jsonl) and profile")
    args = parser.parse_args()
    space = load_space(HERE / "search_efficiency_space.yaml")
    work = Path(args.reuse) if args.reuse else Path("paratune_runs") / f"search_efficiency-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.perf_counter()
    table = measure_grid(space, work)
    grid_s = sum(v["wall_s"] for v in table.values())  # the trials' own wall time (a rerun reuses them)
    plans = [load_plan_dict(v["plan"]) for v in table.values()]
    profiles, _ = build_profiles(plans, work)
    profile_s = sum(p.profile_s for p in profiles)
    from paratune.costs.timemodel import StepTimeModel

    best = max(v["tokens_per_s_per_gpu"] for v in table.values())
    valid = [k for k, v in table.items() if v["ok"]]

    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in SEEDS:
        for algorithm in ("tpe", "random"):
            r = replay_optuna(space, table, algorithm, seed)
            runs.setdefault(algorithm, []).append(_summary(r, len(table)))
        r, reason, preds = replay_calibrated(table, profiles, seed)
        runs.setdefault("calibrated", []).append({**_summary(r, len(table)), "stop_reason": reason,
                                                  "picked": r.curve[-1] if r.curve else 0.0, "predictions": preds})

    # The ranking before any trial (the profile alone), and out-of-sample step-time errors.
    model = StepTimeModel(profiles)
    predicted = {k: model.predict(load_plan_dict(table[k]["plan"])).tokens_per_s_per_gpu for k in valid}
    measured = {k: table[k]["tokens_per_s_per_gpu"] for k in valid}
    tau = kendall_tau([predicted[k] for k in valid], [measured[k] for k in valid])
    top3 = sorted(valid, key=lambda k: -predicted[k])[:3]
    measured_best = max(valid, key=lambda k: measured[k])
    # predicted / measured step time - 1 (step time is tokens per step / (tokens/s x workers))
    profile_errors = [abs(measured[k] / predicted[k] - 1) for k in valid]
    refit_errors = [abs(p["step_time_prediction_error"]) for p in runs["calibrated"][0]["predictions"]]
    loo, loo_tau, sequential = refit_accuracy(table, valid, profiles)

    machine = describe()
    launches = sorted(v["launch_s"] for v in table.values() if v["ok"])
    lines = ["# Search efficiency", "",
             f"- date: {machine['date']}", f"- machine: {machine['machine']}; torch {machine['torch']}",
             f"- space: bench/search_efficiency_space.yaml, {len(table)} plans ({len(valid)} ran) measured "
             f"exhaustively (grid, worker groups reused) on 2 CPU workers: {grid_s / 60:.1f} min of trial wall time; "
             f"profile {profile_s:.0f} s on the workers ({len(profiles)} envs)",
             f"- grid best: {label(table, measured_best)} {best:,.0f} tokens/s/GPU; within 3%: "
             f"{sum(v['tokens_per_s_per_gpu'] >= TARGET * best for v in table.values())} plan(s)",
             f"- trial launch (start to first step) in the grid: median {statistics.median(launches):.1f} s, "
             f"max {launches[-1]:.1f} s (first trial of each worker group included)",
             f"- replay: {len(SEEDS)} seeds per searcher; a replayed measurement is a seeded bootstrap resample "
             "of the plan's measured steps; early stopping applied to every searcher; quality = the table value "
             "of the plan the search would pick", "",
             "| searcher | trials to within 3% of best: median (min-max) | share of the grid | wall s to within 3% "
             "(median) | trials stopped early (median) | trials in all (median) |",
             "|---|---|---:|---:|---:|---:|"]
    for algorithm, rs in runs.items():
        needed = [r["reached_at"] or len(table) + 1 for r in rs]
        walls = [r["wall_at_target"] for r in rs if r["wall_at_target"] is not None]
        lines.append(f"| {algorithm} | {statistics.median(needed):.1f} ({min(needed)}-{max(needed)}) | "
                     f"{statistics.median(needed) / len(valid):.0%} | "
                     f"{statistics.median(walls) if walls else float('nan'):.0f} | "
                     f"{statistics.median(r['stopped'] for r in rs):.0f} | {statistics.median(r['trials'] for r in rs):.0f} |")
    cal = runs["calibrated"]
    lines += ["", "Calibrated search, by its stated rule (paratune.sweep.stopping.SweepStopRule): "
              f"stopped after a median of {statistics.median(r['trials'] for r in cal):.0f} trials "
              f"({statistics.median(r['trials'] for r in cal) / len(valid):.0%} of the grid); the plan it picks is "
              f"within 3% of the grid best in {sum(r['picked'] >= TARGET for r in cal)}/{len(cal)} seeds "
              f"(worst {min(r['picked'] for r in cal):.1%} of best). Seed 0 stopped because: {cal[0]['stop_reason']}", "",
              "## The step-time model", "",
              f"- ranking from the profile alone (before any trial), {len(valid)} plans: Kendall tau "
              f"**{tau:.2f}**; measured best ({label(table, measured_best)}) in the predicted top 3: "
              f"**{'yes' if measured_best in top3 else 'no'}** (predicted top 3: "
              f"{'; '.join(label(table, k) for k in top3)})",
              f"- step time from the profile alone: median |error| {statistics.median(profile_errors):.1%}, "
              f"worst {max(profile_errors):.1%}",
              f"- step time predicted before each trial, refitted on the trials before it (calibrated order, seed 0, "
              f"{len(refit_errors)} trials): median |error| **{statistics.median(refit_errors):.1%}**, worst "
              f"**{max(refit_errors):.1%}**" if refit_errors else "- no refit errors (no trial ran)",
              f"- the same, over the whole grid (every plan in predicted-fastest order, each predicted before it "
              f"was observed): median |error| {statistics.median(sequential):.1%}, worst {max(sequential):.1%}",
              f"- leave-one-out over the grid (refit on the other {len(valid) - 1} plans, predict the one left out): "
              f"median |error| **{statistics.median(loo):.1%}**, worst **{max(loo):.1%}**; Kendall tau of those "
              f"predictions **{loo_tau:.2f}**", "",
              "Measured table (best first), with the profile-only prediction:", "",
              "| plan | tokens/s/GPU | predicted | error (step time) |", "|---|---:|---:|---:|"]
    for key in sorted(table, key=lambda k: -table[k]["tokens_per_s_per_gpu"]):
        if key in predicted:
            lines.append(f"| {label(table, key)} | {measured[key]:,.0f} | {predicted[key]:,.0f} | "
                         f"{measured[key] / predicted[key] - 1:+.1%} |")
        else:
            lines.append(f"| {label(table, key)} | failed | | |")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "search_efficiency.md").write_text("\n".join(lines) + "\n")
    (out / "search_efficiency.json").write_text(json.dumps(
        {"machine": machine, "table": table, "runs": runs, "kendall_tau": tau, "predicted": predicted,
         "profile_s": profile_s, "grid_s": grid_s}, indent=1, default=str))
    _plot(runs, out / "search_efficiency.png")
    print("\n".join(lines))


def _summary(replay: Replay, size: int) -> dict[str, Any]:
    at = replay.reached_at()
    return {"reached_at": at, "wall_at_target": replay.wall[at - 1] if at else None, "curve": replay.curve,
            "wall": replay.wall, "trials": len(replay.observed),
            "stopped": sum(1 for v in replay.observed.values() if v["stopped"])}


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (algorithm, rs), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green")):
        n = max(len(r["curve"]) for r in rs)
        med = [statistics.median(r["curve"][min(i, len(r["curve"]) - 1)] for r in rs) for i in range(n)]
        ax.plot(range(1, n + 1), med, label=f"{algorithm} (median of {len(rs)} seeds)", color=color)
    ax.axhline(TARGET, ls="--", color="gray", label="97% of grid best")
    ax.set_xlabel("trials")
    ax.set_ylabel("picked plan / grid best (measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
