"""tp x pp x dp layouts on CPU (real Ray Train trials, 4 and 8 gloo workers on this machine).

    .venv/bin/python bench/model_parallel_cpu.py    # writes bench/results/model_parallel_cpu.{md,json}

The same model and global batch as bench/strategies_cpu.py, laid out in 2-D and 3-D. Workers
reserve a fraction of a CPU so that 8 fit a 2-core machine: the numbers measure that the layouts
run and what each rank holds, not what a GPU cluster would rank first (8 processes share 2 cores).
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

BASE = {"model": "small-llama", "seq_len": 128, "global_batch": 16, "micro_batch": 2,
        "warmup_steps": 2, "measure_steps": 6, "trial_timeout_s": 1200}
VARIANTS = [
    {"strategy": "ddp", "num_workers": 4, "tp": 2, "pp": 2},
    {"strategy": "ddp", "num_workers": 4, "tp": 2, "pp": 2, "sequence_parallel": True},
    {"strategy": "fsdp", "num_workers": 4, "tp": 2, "fsdp": {"sharding": "full"}},
    {"strategy": "fsdp", "num_workers": 4, "pp": 2, "fsdp": {"sharding": "full"}},
    {"strategy": "ddp", "num_workers": 4, "pp": 2},  # DDP semantics under a pipeline: FSDP2's replicate
    {"strategy": "fsdp", "num_workers": 8, "tp": 2, "pp": 2, "fsdp": {"sharding": "full"}},
    {"strategy": "ddp", "num_workers": 8, "tp": 2, "pp": 2},
]


def main() -> None:
    console = Console(width=160)
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    machine = describe()
    rows = []
    for i, variant in enumerate(VARIANTS, 1):
        plan = load_plan_dict({**BASE, "cpus_per_worker": 2 / variant["num_workers"], **variant})
        label = strategy_label(plan.to_dict())
        with console.status(f"{i}/{len(VARIANTS)} {label} ({plan.num_workers} workers)"):
            r = run_trial(plan)
        console.print(f"{label}: {r.status} {r.tokens_per_s_per_gpu or 0:,.0f} tokens/s/worker {r.message or ''}")
        rows.append({"plan": label, "workers": plan.num_workers, **r.model_dump(exclude={"plan"})})
    lines = [
        "# CPU model-parallel benchmark (tp x pp x dp)", "",
        f"- date: {machine['date']}", f"- machine: {machine['machine']}",
        f"- software: torch {machine['torch']}, ray {machine.get('ray')}, deepspeed {machine.get('deepspeed')}, "
        f"transformers {machine.get('transformers')}",
        f"- model: {BASE['model']}, seq_len {BASE['seq_len']}, global batch {BASE['global_batch']}, "
        f"{BASE['warmup_steps']} warm-up + {BASE['measure_steps']} measured steps per trial; "
        "4 or 8 gloo workers sharing 2 cores",
        "- params/rank: parameters this rank holds (the largest rank); peak memory as in strategies_cpu.md",
        "- comm: share of one profiled step with a collective in flight", "",
        "| plan | workers | status | tokens/s/worker | step median ms | p10-p90 ms | params/rank | peak MiB/rank | comm |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['plan']} | {r['workers']} | {r['reason']}: {(r['message'] or '')[:60]} | | | | | | |")
            continue
        lines.append(
            f"| {r['plan']} | {r['workers']} | ok | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{r['step_time_median_s'] * 1e3:.0f} | {r['step_time_p10_s'] * 1e3:.0f}-{r['step_time_p90_s'] * 1e3:.0f} | "
            f"{max(r['local_parameter_counts'] or [0]):,} | {max(r['peak_memory_bytes']) / 2**20:,.1f} | "
            f"{r['comm_share'] or 0:.0%} |")
    (out_dir / "model_parallel_cpu.md").write_text("\n".join(lines) + "\n")
    (out_dir / "model_parallel_cpu.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
