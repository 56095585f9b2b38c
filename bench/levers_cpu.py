"""Each lever of issue 28 on CPU, beside its baseline, in one run (2 gloo workers, real Ray Train trials).

    .venv/bin/python bench/levers_cpu.py            # writes bench/results/levers_cpu.{md,json}

Every row is one trial of paratune's own path (`paratune.cluster.trial.run_trial`): warm-up excluded (the
compile happens there and is reported as compile_s), whole optimizer steps, slowest rank per step,
median and p10-p90 of the measured steps. Each group changes one lever against the group's first
row; `max |loss diff|` is against that row's losses (the same training, step by step). CPU shows
the software path and the memory trade-offs: float8 and compile speed-ups are GPU effects
(CPU's `_scaled_mm` is not a tensor-core kernel), so a CPU slowdown there says nothing about H100s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe, package_version  # noqa: E402

from paratune.config.plan import PlanError, load_plan_dict  # noqa: E402
from paratune.out.tables import strategy_label  # noqa: E402
from paratune.cluster.trial import run_trial  # noqa: E402

BASE = {"model": "small-llama", "seq_len": 256, "global_batch": 8, "micro_batch": 4, "num_workers": 2,
        "warmup_steps": 2, "measure_steps": 6}
# bf16 rows on a smaller model: this CPU (AVX-512 BF16, no AMX) ran small-llama's bf16 steps at
# 14.8 s against 1.2 s in fp32 (2026-12-02), too slow for a side-by-side run of eight trials.
BF16 = {"precision": "bf16", "model": "tiny-llama"}
# (group, the lever's rows; the first row of a group is its baseline)
GROUPS: list[tuple[str, list[dict]]] = [
    ("activation checkpointing (fp32, ddp)", [
        {"strategy": "ddp"},
        {"strategy": "ddp", "activation_checkpointing": "selective"},
        {"strategy": "ddp", "activation_checkpointing": "layers", "checkpoint_every": 2},
        {"strategy": "ddp", "activation_checkpointing": "full"},
    ]),
    ("torch.compile per block (bf16)", [
        {"strategy": "ddp", **BF16},
        {"strategy": "ddp", **BF16, "compile": True},
        {"strategy": "fsdp", **BF16},
        {"strategy": "fsdp", **BF16, "compile": True},
    ]),
    ("float8 through torchao (bf16, fsdp)", [
        {"strategy": "fsdp", **BF16},
        {"strategy": "fsdp", **BF16, "float8": "tensorwise"},
        {"strategy": "fsdp", **BF16, "float8": "tensorwise", "float8_all_gather": True},
        {"strategy": "fsdp", **BF16, "float8": "rowwise"},
    ]),
    ("the loss under tp 2 (fp32)", [
        {"strategy": "ddp", "tp": 2, "loss": "standard"},
        {"strategy": "ddp", "tp": 2, "loss": "vocab_parallel"},
        {"strategy": "ddp", "tp": 2, "sequence_parallel": True, "loss": "standard"},
        {"strategy": "ddp", "tp": 2, "sequence_parallel": True, "loss": "vocab_parallel"},
    ]),
    ("the loss at tp 1 (fp32, fsdp)", [
        {"strategy": "fsdp", "loss": "standard"},
        {"strategy": "fsdp", "loss": "chunked"},
    ]),
    ("async TP (refused on CPU)", [
        {"strategy": "ddp", "tp": 2, "sequence_parallel": True, "compile": True, "async_tp": True},
    ]),
]


def _row(group: str, variant: dict, baseline: dict | None) -> dict:
    try:
        plan = load_plan_dict({**BASE, **variant})
    except PlanError as err:
        return {"group": group, "plan": str(variant), "status": "refused", "message": str(err)}
    result = run_trial(plan)
    row = {"group": group, "plan": strategy_label(plan.to_dict()), **result.model_dump(exclude={"plan"})}
    if baseline is not None and result.status == "ok" and baseline.get("status") == "ok":
        row["loss_diff"] = max(abs(a - b) for a, b in zip(result.losses, baseline["losses"]))
    return row


def _line(r: dict, base: dict) -> str:
    if r["status"] != "ok":
        return f"| {r['plan']} | {r.get('reason', r['status'])}: {r['message'][:150]} | | | | | | |"
    median = r["step_time_median_s"]
    vs = f"{median / base['step_time_median_s']:.2f}x" if base.get("status") == "ok" else ""
    compile_s = "" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"
    loss_diff = "" if r.get("loss_diff") is None else f"{r['loss_diff']:.2g}"
    peak = max(r["peak_memory_bytes"] or [0]) / 2**20
    return (f"| {r['plan']} | ok | {median * 1e3:.0f} | {r['step_time_p10_s'] * 1e3:.0f}-"
            f"{r['step_time_p90_s'] * 1e3:.0f} | {vs} | {peak:,.1f} | {compile_s} | {loss_diff} |")


def main() -> None:
    console = Console(width=160)
    out_dir = Path(__file__).parent / "results"
    machine = describe()
    rows: list[dict] = []
    total = sum(len(v) for _, v in GROUPS)
    done = 0
    for group, variants in GROUPS:
        baseline = None
        for variant in variants:
            done += 1
            with console.status(f"{done}/{total} {group}: {variant}"):
                row = _row(group, variant, baseline)
            baseline = baseline or row
            console.print(f"{group}: {row['plan']}: {row['status']} "
                          f"{(row.get('step_time_median_s') or 0) * 1e3:.0f} ms/step")
            rows.append(row)
    lines = [
        "# The levers on CPU, side by side (issue 28)", "",
        f"- date: {machine['date']}", f"- machine: {machine['machine']}",
        f"- software: torch {machine['torch']}, ray {machine.get('ray')}, transformers {machine.get('transformers')}, "
        f"torchao {package_version('torchao')}",
        f"- model: {BASE['model']} (bf16 groups: tiny-llama, see BF16 in the script), seq_len {BASE['seq_len']}, global batch {BASE['global_batch']}, micro-batch "
        f"{BASE['micro_batch']}, 2 gloo workers, {BASE['warmup_steps']} warm-up + {BASE['measure_steps']} measured "
        "steps per trial, each a real Ray Train trial of `paratune.cluster.trial.run_trial`, all in this one run",
        "- step: median and p10-p90 of the measured steps (slowest rank); `vs` = median / the group's first row",
        "- peak: per rank, tensor storage tracked by torch's MemTracker over one extra step",
        "- compile s: the first warm-up step's time beyond a measured step (never inside the measured steps)",
        "- loss diff: max over all steps of |loss - the group's first row's loss| (the same training)", "",
    ]
    for group, _ in GROUPS:
        members = [r for r in rows if r["group"] == group]
        lines += [f"## {group}", "",
                  "| plan | status | step median ms | p10-p90 ms | vs | peak MiB/rank | compile s | loss diff |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        lines += [_line(r, members[0]) for r in members] + [""]
    (out_dir / "levers_cpu.md").write_text("\n".join(lines) + "\n")
    (out_dir / "levers_cpu.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1, default=str))
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
