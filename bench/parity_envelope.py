"""Does the rounding envelope hold? Its coverage on models that amplify fp32 rounding, on three CPU kernel sets.

A model that amplifies rounding (CPM-Ant, Gemma-3n at lr 1e-2) is judged against an envelope: ENVELOPE_MARGIN
x the largest deviation, step by step, of ENVELOPE_DRAWS reference runs whose initial weights move by fp32
rounding (paratune.sweep.parity.rounding_envelope). This benchmark measures, in one run per kernel set
(ATEN_CPU_CAPABILITY = the machine's own, avx2, default; each in a fresh process, as torch reads it at start):

- **setting** (how the constants were chosen; rows that judge nothing): CPM-Ant on the small plan of
  tests/test_proxy.py, SETTING_DRAWS draws; coverage of every other draw by K draws x margin M, resampled;
- **judging** (rows that set nothing): CPM-Ant and Gemma-3n on the families bench's plan (seq 32, global
  batch 8, seed 7): the envelope as the parity check makes it, held out against HELD_OUT draws it was not
  made from and against the real layouts (ddp and fsdp on 2 gloo processes), each judged by parity_verdict.

    .venv/bin/python bench/parity_envelope.py [--families cpmant,gemma3n_text] [--held-out 12] [--out bench/results]

Writes parity_envelope.{json,md} with the date and machine. Minutes of CPU (Gemma-3n's tiny config is
the slow one: ~3.5 GB, seconds a run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

CAPABILITIES = ("", "avx2", "default")  # "": the machine's own (torch's choice)
SETTING_PLAN = {"seq_len": 16, "global_batch": 4, "micro_batch": 2, "num_workers": 2, "warmup_steps": 1,
                "measure_steps": 2, "lr": 1e-2}  # tests/test_proxy.py's CPM-Ant
from families_parity import BASE as JUDGING_PLAN  # noqa: E402 (the families bench's own plan)
SETTING_DRAWS = 24
LAYOUTS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}}}


def _plan(model_type: str, base: dict, folder: Path, **changes):
    from family_zoo import write_config

    from paratune.config.plan import load_plan_dict
    from paratune.sweep.parity import deterministic_plan

    plan, _ = deterministic_plan(load_plan_dict({**base, "model": str(write_config(model_type, folder / model_type)),
                                                 **changes}))
    return plan


def measure_one_kernel(families: list[str], held_out: int) -> dict:
    """Everything for the kernel set this process runs under (a fresh process per set)."""
    import torch

    from gloo_harness import run_named_batch
    from paratune.sweep.parity import (ROUNDING_SCALE, parity_verdict, reference_losses, reference_training,
                                       rounding_envelope)

    torch.set_num_threads(1)  # as the gloo workers and the tests run
    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "setting": {}, "judging": {}}

    def deviations(losses, reference):
        return [abs(a - b) for a, b in zip(losses, reference)]

    with tempfile.TemporaryDirectory(prefix="paratune-envelope-") as tmp:
        plan = _plan("cpmant", SETTING_PLAN, Path(tmp))
        reference = reference_losses(plan)
        out["setting"]["cpmant"] = [deviations(reference_training(plan, weight_noise=ROUNDING_SCALE, noise_draw=k)[0],
                                               reference) for k in range(SETTING_DRAWS)]
        for family in families:
            print(f"  {out['capability']}: {family}", flush=True)
            plan = _plan(family, JUDGING_PLAN, Path(tmp))
            reference = reference_losses(plan)
            envelope = rounding_envelope(plan, len(reference), reference=reference)
            draws = [reference_training(plan, weight_noise=ROUNDING_SCALE, noise_draw=1000 + k)[0]
                     for k in range(held_out)]
            layouts = {}
            runs = run_named_batch({name: _plan(family, JUDGING_PLAN, Path(tmp), **case) for name, case in LAYOUTS.items()})
            for name, run in runs.items():
                if isinstance(run, Exception):
                    layouts[name] = {"error": str(run)[-400:]}
                    continue
                check = parity_verdict(plan, run[1]["losses"], reference, envelope)
                layouts[name] = {"deviations": deviations(run[1]["losses"], reference), "passed": check.passed}
            out["judging"][family] = {
                "reference": reference, "envelope": envelope.to_record(1e-4),
                "held_out": [deviations(d, reference) for d in draws],
                "held_out_within": [not envelope.steps_beyond(d, reference, 1e-4) for d in draws],
                "held_out_passed": [parity_verdict(plan, d, reference, envelope).passed for d in draws],
                "layouts": layouts}
    return out


def resampled_coverage(rows: list[list[float]], members: int, margin: float, trials: int = 2000,
                       seed: int = 0) -> float:
    """Share of the other rows within margin x the largest of `members` rows chosen at random, at every
    step after the first (the first loss is held exact instead)."""
    rng = random.Random(seed)
    inside = total = 0
    for _ in range(trials):
        chosen = set(rng.sample(range(len(rows)), members))
        spread = [max(rows[i][s] for i in chosen) for s in range(len(rows[0]))]
        for j, row in enumerate(rows):
            if j in chosen:
                continue
            total += 1
            inside += all(row[s] <= margin * spread[s] for s in range(1, len(row)))
    return inside / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="cpmant,gemma3n_text")
    parser.add_argument("--held-out", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--one-kernel", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    families = args.families.split(",")
    if args.one_kernel:
        print(json.dumps(measure_one_kernel(families, args.held_out)))
        return 0
    from machine import describe
    from paratune.sweep.parity import ENVELOPE_DRAWS, ENVELOPE_MARGIN

    t0 = time.perf_counter()
    kernels = []
    for capability in CAPABILITIES:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        print("kernel set", capability or "(the machine's own)", flush=True)
        run = subprocess.run([sys.executable, __file__, "--one-kernel", "--families", args.families,
                              "--held-out", str(args.held_out)], env=env, capture_output=True, text=True, check=True)
        kernels.append(json.loads(run.stdout.strip().splitlines()[-1]))
    setting_rows = [row for k in kernels for row in k["setting"]["cpmant"]]
    table = {f"K{k}": {f"M{m:g}": resampled_coverage(setting_rows, k, m) for m in (1, 2, 3, 4, 6)} for k in (1, 4, 8)}
    machine = describe()
    report = {"machine": machine, "seconds": time.perf_counter() - t0, "draws": ENVELOPE_DRAWS,
              "margin": ENVELOPE_MARGIN, "setting_table": table, "kernels": kernels}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity_envelope.json").write_text(json.dumps(report, indent=1))
    lines = ["# The rounding envelope's coverage (models that amplify fp32 rounding, three CPU kernel sets)", "",
             f"- date: {machine.get('date')}; {machine.get('machine')}; torch {machine.get('torch', '')}; "
             f"{report['seconds']:.0f} s",
             f"- kernel sets: {', '.join(k['capability'] for k in kernels)} (ATEN_CPU_CAPABILITY; the first is the "
             "machine's own)",
             f"- the bound: {ENVELOPE_MARGIN:g} x the largest deviation, step by step, of {ENVELOPE_DRAWS} reference "
             "runs with initial weights x (1 + 1e-7 n), and the reference with another micro-batch split; the first "
             "loss held exact", "",
             "## Setting (how the draws and the margin were chosen; these rows judge nothing)", "",
             f"CPM-Ant on tests/test_proxy.py's plan (seq 16, global batch 4), {SETTING_DRAWS} draws per kernel set, "
             f"{len(setting_rows)} in all. Coverage of every other draw by K draws x margin M (resampled, steps after "
             "the first):", "",
             "| K draws | " + " | ".join(f"M {m:g}" for m in (1, 2, 3, 4, 6)) + " |", "|---|" + "---|" * 5]
    for k, row in table.items():
        lines.append(f"| {k[1:]} | " + " | ".join(f"{100 * v:.1f}%" for v in row.values()) + " |")
    lines += ["", "## Judging (the envelope as the parity check makes it, on rows that set nothing)", "",
              "The families bench's plan (seq 32, global batch 8, seed 7, lr 1e-2). Held-out: perturbed references "
              "from draws the envelope was not made from. Layouts: real ddp and fsdp runs on 2 gloo processes, "
              "judged by paratune.sweep.parity.parity_verdict.", "",
              "| family | kernel set | envelope bound per step | held-out within | largest held-out / bound | "
              "ddp | fsdp |", "|---|---|---|---|---|---|---|"]
    for kernel in kernels:
        for family, row in kernel["judging"].items():
            bound = row["envelope"]["bound"]
            worst = max(max(d[s] / bound[s] for s in range(1, len(bound))) for d in row["held_out"])
            layout_cells = []
            for name in LAYOUTS:
                lay = row["layouts"].get(name, {})
                layout_cells.append(lay["error"][:60] if "error" in lay else
                                    f"{'passes' if lay['passed'] else 'FAILS'} (max {max(lay['deviations']):.1e})")
            lines.append(f"| {family} | {kernel['capability']} | {', '.join(f'{b:.1e}' for b in bound)} | "
                         f"{sum(row['held_out_within'])} of {len(row['held_out_within'])} | {worst:.2f} | "
                         + " | ".join(layout_cells) + " |")
    held = [w for k in kernels for r in k["judging"].values() for w in r["held_out_within"]]
    lines += ["", f"Held-out coverage, all families and kernel sets: {sum(held)} of {len(held)} "
              f"({100 * sum(held) / max(1, len(held)):.1f}%)."]
    (out_dir / "parity_envelope.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
