"""How many trials does each searcher need to get within 5% of the best plan?

1. Measure every plan of a small space on CPU (a real grid sweep through `run_sweep`).
2. Replay TPE and random search (the sweep's own CandidateTree and Optuna samplers, never
   proposing a point twice) against that measured table, for several seeds, and count the
   trials each needs to reach 95% of the grid's best.

    .venv/bin/python bench/search_efficiency.py [--reuse DIR]   # writes bench/results/search_efficiency.*
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

from paratune.space import load_space  # noqa: E402
from paratune.sweep import CandidateTree, Ledger, objective_value, run_sweep  # noqa: E402

HERE = Path(__file__).parent
SEEDS = range(10)
TARGET = 0.95


def measure_grid(space, out_dir: Path) -> dict[str, float]:
    ledger_path = out_dir / "ledger.jsonl"
    if not ledger_path.exists():
        run_sweep(space, out_dir, algorithm="grid", tracking_uri=f"sqlite:///{out_dir.parent / 'search_eff_mlflow.db'}")
    return {e.key: objective_value(e.result, None) for e in Ledger(ledger_path).search_entries()}


def trials_to_target(space, table: dict[str, float], algorithm: str, seed: int) -> list[float]:
    """Best-so-far after each new (never repeated) trial, for one searcher and seed."""
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(5, len(table) // 3)))
               if algorithm == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    sample = CandidateTree(space).define_by_run()
    seen: set[str] = set()
    curve: list[float] = []
    asks = 0
    while len(seen) < len(table) and asks < 5000:
        asks += 1
        trial = study.ask()
        key = sample(trial)["point"]
        study.tell(trial, table[key])
        if key not in seen:  # a repeat costs nothing: the sweep answers it from its ledger
            seen.add(key)
            curve.append(max(curve[-1] if curve else 0.0, table[key]))
    return curve


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--reuse", help="a folder with an earlier grid measurement (ledger.jsonl)")
    args = parser.parse_args()
    space = load_space(HERE / "search_efficiency_space.yaml")
    work = Path(args.reuse) if args.reuse else Path("paratune_runs") / "search_efficiency"
    table = measure_grid(space, work)
    best = max(table.values())
    results: dict[str, list[int]] = {}
    curves: dict[str, list[list[float]]] = {}
    for algorithm in ("tpe", "random"):
        for seed in SEEDS:
            curve = trials_to_target(space, table, algorithm, seed)
            curves.setdefault(algorithm, []).append(curve)
            results.setdefault(algorithm, []).append(next(i + 1 for i, v in enumerate(curve) if v >= TARGET * best))
    machine = describe()
    budgets = (3, 5, 8, 12)
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    lines = ["# Search efficiency", "",
             f"- date: {machine['date']}", f"- machine: {machine['machine']}",
             f"- space: bench/search_efficiency_space.yaml, {len(table)} plans measured exhaustively (grid) on CPU",
             f"- grid best: {best:,.0f} tokens/s/GPU; within 5%: {sum(v >= TARGET * best for v in table.values())} plan(s)",
             f"- replay: {len(SEEDS)} seeds per searcher against the measured table; a repeat proposal is free", "",
             "| searcher | trials to within 5% of best: median (min-max) | " +
             " | ".join(f"P(within 5%) after {b}" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    for algorithm, needed in results.items():
        hit = [sum(n <= b for n in needed) / len(needed) for b in budgets]
        lines.append(f"| {algorithm} | {statistics.median(needed):.1f} ({min(needed)}-{max(needed)}) | "
                     + " | ".join(f"{h:.0%}" for h in hit) + " |")
    lines += ["", "Measured table (best first):", "", "| plan | tokens/s/GPU |", "|---|---:|"]
    for key, value in ranked:
        choices = json.loads(key)["choices"]
        label = " ".join(f"{k}={v}" for k, v in sorted(choices.items()) if "bucket" not in k)
        lines.append(f"| {label} | {value:,.0f} |")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "search_efficiency.md").write_text("\n".join(lines) + "\n")
    (out / "search_efficiency.json").write_text(json.dumps(
        {"machine": machine, "table": table, "trials_needed": results, "curves": curves}, indent=1))
    _plot(curves, best, out / "search_efficiency.png")
    print("\n".join(lines))


def _plot(curves: dict[str, list[list[float]]], best: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for (algorithm, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        n = max(len(c) for c in runs)
        med = [statistics.median(c[min(i, len(c) - 1)] / best for c in runs) for i in range(n)]
        ax.plot(range(1, n + 1), med, label=f"{algorithm} (median of {len(runs)} seeds)", color=color)
    ax.axhline(TARGET, ls="--", color="gray", label="95% of grid best")
    ax.set_xlabel("trials")
    ax.set_ylabel("best so far / grid best")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
