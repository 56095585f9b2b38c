"""How good are paratune's estimates? Predicted vs measured peak memory per rank and step time,
for every data-parallel strategy, with and without activation checkpointing, at a few sizes.

    .venv/bin/python bench/estimate_accuracy.py            # runs the trials (~10 min), writes the table
    .venv/bin/python bench/estimate_accuracy.py --reuse    # re-predicts from the committed measurements

Measured: real Ray Train trials on 2 CPU workers (gloo); peak memory is PyTorch's MemTracker
over one step (tensor storage), the same definition the estimate predicts. Predicted:
paratune.estimate for the same plan on the "cpu" device. Step time is predicted with the time
model's constants fitted (least squares) on the measured trials of the *other* size, as a sweep
fits them on the trials it has run so far.
Writes bench/results/estimate_accuracy.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

from paratune.plan import load_plan_dict  # noqa: E402
from paratune.report import strategy_label  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BUCKETS = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}
SIZES = {
    "small-llama (7.1M)": {"model": "small-llama", "seq_len": 128, "micro_batch": 4},
    "wide-llama (25M)": {"model": "small-llama", "seq_len": 256, "micro_batch": 2,
                         "model_overrides": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
                                             "num_attention_heads": 8, "num_key_value_heads": 4}},
}
STRATEGIES = [
    {"strategy": "ddp"},
    {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    {"strategy": "fsdp", "fsdp": {"sharding": "grad_op"}},
    {"strategy": "zero", "zero": {"stage": 1, **BUCKETS}},
    {"strategy": "zero", "zero": {"stage": 2, **BUCKETS}},
    {"strategy": "zero", "zero": {"stage": 3, **BUCKETS}},
]
BASE = {"global_batch": 16, "num_workers": 2, "warmup_steps": 2, "measure_steps": 5, "profile_comm": False}


def plans() -> list[tuple[str, dict]]:
    out = []
    for size, shape in SIZES.items():
        for strategy in STRATEGIES:
            for ckpt in ("none", "full"):
                out.append((size, {**BASE, **shape, **strategy, "activation_checkpointing": ckpt}))
    return out


def measure(console: Console) -> list[dict]:
    from paratune.trial import run_trial

    rows = []
    todo = plans()
    for i, (size, plan_dict) in enumerate(todo, 1):
        plan = load_plan_dict(plan_dict)
        label = strategy_label(plan.to_dict())
        with console.status(f"{i}/{len(todo)} {size} {label}"):
            result = run_trial(plan)
        console.print(f"{i}/{len(todo)} {size} {label}: {result.status} "
                      f"peak {max(result.peak_memory_bytes or [0]) / 2**20:.1f} MiB, "
                      f"step {result.step_time_median_s or 0:.3f} s")
        rows.append({"size": size, "plan": plan.to_dict(), "status": result.status, "reason": result.reason,
                     "peak_memory_bytes": result.peak_memory_bytes, "memory_method": result.memory_method,
                     "step_time_median_s": result.step_time_median_s, "step_time_spread": result.step_time_spread})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="re-predict from the committed measurements")
    args = parser.parse_args()
    console = Console(width=160)
    RESULTS.mkdir(exist_ok=True)
    raw_path = RESULTS / "estimate_accuracy.json"
    if args.reuse:
        saved = json.loads(raw_path.read_text())
        machine, rows = saved["machine"], saved["rows"]
    else:
        machine, rows = describe(), measure(console)
    from estimate_report import write_report  # noqa: E402  (the prediction side, below)

    write_report(machine, rows, RESULTS, console)


if __name__ == "__main__":
    main()
