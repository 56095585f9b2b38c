"""`paratune trial | validate | models`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from paratune.plan import PlanError, load_plan


def _cmd_trial(args: argparse.Namespace, console: Console) -> int:
    from paratune.reference import max_loss_difference, reference_losses
    from paratune.report import print_results
    from paratune.trial import TrialResult, run_trial

    plans = []
    for path in args.plans:
        try:
            plan = load_plan(path)
            if args.workers:
                plan = plan.with_changes(num_workers=args.workers)
        except PlanError as err:
            console.print(f"[red]invalid plan[/red]\n{err}")
            return 2
        plans.append((Path(path).stem, plan))
    rows: list[tuple[str, TrialResult, float | None]] = []
    for i, (name, plan) in enumerate(plans, 1):
        with console.status(f"trial {i}/{len(plans)}: {name} ({plan.strategy}, {plan.num_workers} workers)"):
            result = run_trial(plan)
        diff = None
        if result.ok and args.parity:
            with console.status(f"single-process reference for {name}"):
                diff = max_loss_difference(result.losses, reference_losses(plan))
        verdict = f"{result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" if result.ok else f"{result.reason}"
        console.print(f"[bold]{name}[/bold]: {result.status} ({verdict})")
        rows.append((name, result, diff))
    print_results(rows, console)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"name": n, "parity_max_abs_diff": d, **r.model_dump()} for n, r, d in rows], indent=2))
        console.print(f"results written to {args.json}")
    return 0 if all(r.ok for _, r, _ in rows) else 1


def _cmd_validate(args: argparse.Namespace, console: Console) -> int:
    try:
        plan = load_plan(args.plan)
    except PlanError as err:
        console.print(f"[red]invalid plan[/red]\n{err}")
        return 2
    console.print(plan.to_yaml())
    return 0


def _cmd_models(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from paratune.models import build_config, parameter_counts, preset_names

    table = Table(title="model presets (random init from config; never downloaded)")
    for col in ("preset", "type", "layers", "hidden", "heads/kv", "params", "compute params"):
        table.add_column(col)
    for name in preset_names():
        cfg = build_config(name)
        counts = parameter_counts(cfg)
        table.add_row(name, cfg.model_type, str(cfg.num_hidden_layers), str(cfg.hidden_size),
                      f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}",
                      f"{counts['total'] / 1e6:,.1f}M", f"{counts['compute'] / 1e6:,.1f}M")
    console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paratune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trial", help="run plan(s) as measured Ray Train trials, results side by side")
    p.add_argument("plans", nargs="+", help="plan YAML file(s)")
    p.add_argument("--workers", type=int, help="override num_workers")
    p.add_argument("--parity", action="store_true", help="also compare losses to a single-process reference")
    p.add_argument("--json", help="write the results to this JSON file")
    p = sub.add_parser("validate", help="check a plan file and print it with derived fields")
    p.add_argument("plan")
    sub.add_parser("models", help="list model presets and their parameter counts")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    handler = {"trial": _cmd_trial, "validate": _cmd_validate, "models": _cmd_models}[args.command]
    return handler(args, console)


if __name__ == "__main__":
    sys.exit(main())
