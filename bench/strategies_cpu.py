"""Each strategy on CPU (2 gloo workers, real Ray Train trials): tokens/s per worker, spread, memory.

    .venv/bin/python bench/strategies_cpu.py            # writes bench/results/strategies_cpu.{md,json}

Each plan is run as its own trial; numbers are the trial's measured window (warm-up excluded,
whole optimizer steps, slowest rank per step). On a 2-core machine, CPU runs measure the
software path, not what a GPU cluster would rank first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

from paratune.config.plan import load_plan_dict  # noqa: E402
from paratune.out.tables import strategy_label  # noqa: E402
from paratune.cluster.trial import run_trial  # noqa: E402

BASE = {"model": "small-llama", "seq_len": 128, "global_batch": 16, "micro_batch": 4, "num_workers": 2,
        "warmup_steps": 2, "measure_steps": 8}
SMALL_BUCKETS = {"reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000}
VARIANTS = [
    {"strategy": "ddp"},
    {"strategy": "ddp", "activation_checkpointing": "full"},
    {"strategy": "ddp", "micro_batch": 8},
    {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    {"strategy": "fsdp", "fsdp": {"sharding": "grad_op"}},
    {"strategy": "fsdp", "fsdp": {"sharding": "no_shard"}},
    {"strategy": "zero", "zero": {"stage": 1, **SMALL_BUCKETS}},
    {"strategy": "zero", "zero": {"stage": 2, **SMALL_BUCKETS}},
    {"strategy": "zero", "zero": {"stage": 2}},  # DeepSpeed's default 5e8-element buckets
    {"strategy": "zero", "zero": {"stage": 3, **SMALL_BUCKETS}},
    {"strategy": "ddp", "tp": 2},
    {"strategy": "ddp", "tp": 2, "sequence_parallel": True},
    {"strategy": "ddp", "pp": 2, "pp_schedule": "1f1b"},
    {"strategy": "ddp", "pp": 2, "pp_schedule": "gpipe"},
]


def main() -> None:
    console = Console(width=160)
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    machine = describe()
    rows = []
    for i, variant in enumerate(VARIANTS, 1):
        plan = load_plan_dict({**BASE, **variant})
        label = strategy_label(plan.to_dict())
        if variant.get("zero", {}).get("reduce_bucket_size") is None and plan.strategy == "zero":
            label += " (default buckets)"
        with console.status(f"{i}/{len(VARIANTS)} {label}"):
            r = run_trial(plan)
        console.print(f"{label}: {r.status} {r.tokens_per_s_per_gpu or 0:,.0f} tokens/s/worker")
        rows.append({"plan": label, **r.model_dump(exclude={"plan"})})
    lines = [
        "# CPU strategy benchmark", "",
        f"- date: {machine['date']}", f"- machine: {machine['machine']}",
        f"- software: torch {machine['torch']}, ray {machine.get('ray')}, deepspeed {machine.get('deepspeed')}, "
        f"transformers {machine.get('transformers')}",
        f"- model: {BASE['model']}, seq_len {BASE['seq_len']}, global batch {BASE['global_batch']}, "
        f"2 gloo workers, {BASE['warmup_steps']} warm-up + {BASE['measure_steps']} measured steps per trial",
        "- peak memory: per rank, tensor storage tracked by torch's MemTracker over one extra step "
        "(pipeline rows: process max RSS, which includes the Python runtime; not comparable)",
        "- tp/pp rows: 2 workers as one tensor-parallel group or two pipeline stages (dp 1)",
        "- comm: share of one profiled step with a collective in flight", "",
        "| plan | status | tokens/s/worker | step median ms | p10-p90 ms | spread | peak MiB/rank | comm | launch s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['plan']} | {r['reason']}: {r['message'][:60]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['plan']} | ok | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_time_median_s'] * 1e3:.0f} | "
            f"{r['step_time_p10_s'] * 1e3:.0f}-{r['step_time_p90_s'] * 1e3:.0f} | {r['step_time_spread']:.0%} | "
            f"{max(r['peak_memory_bytes']) / 2**20:,.1f} | {r['comm_share'] or 0:.0%} | {r['launch_s']:.1f} |")
    (out_dir / "strategies_cpu.md").write_text("\n".join(lines) + "\n")
    (out_dir / "strategies_cpu.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
