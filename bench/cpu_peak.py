"""The device table's "cpu" entry, measured: one CPU worker's matmul peak (a CPU worker runs one
OpenMP thread) and the share of it a real training step reaches.

    .venv/bin/python bench/cpu_peak.py        # writes bench/results/cpu_peak.{md,json}

Peak: square torch matmuls on 1 thread, n = 1024, 2048, 4096, fp32 and bf16; best of 20 after 3
warm-ups (a peak, so the best, not the median). Step: small-llama (the demo's model), seq 128,
micro-batch 4, forward + backward + AdamW, 1 thread, 3 warm-ups then the median of 10 whole
steps, model FLOPs (6N + attention) per token. presets/devices.json's cpu entry is rounded from
the peak; the cost-model line of a sweep reports a trial's compute against it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from machine import describe  # noqa: E402

from paratune.config.devices import get_device  # noqa: E402
from paratune.costs.measure import model_flops_per_token  # noqa: E402
from paratune.model.build import build_config, build_model  # noqa: E402


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048, 4096), repeats: int = 20) -> dict[int, float]:
    """Best TFLOP/s of an n x n x n matmul per size."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best = min(_timed(lambda: a @ b) for _ in range(repeats if n < 4096 else 5))
        out[n] = 2 * n**3 / best / 1e12
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def training_step_tflops(steps: int = 10) -> tuple[float, float, float]:
    """(median TFLOP/s, p10, p90) of small-llama's whole training step, model FLOPs."""
    config = build_config("small-llama")
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (4, 128))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    times = sorted(_timed(step) for _ in range(steps))
    flops = model_flops_per_token(config, 128) * ids.numel()
    return flops / statistics.median(times) / 1e12, flops / times[-2] / 1e12, flops / times[1] / 1e12


def main() -> None:
    torch.set_num_threads(1)
    fp32, bf16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16)
    step, step_lo, step_hi = training_step_tflops()
    entry = get_device("cpu").tflops
    machine = describe()
    lines = ["# One CPU worker's compute (1 thread): the device table's cpu entry", "",
             f"- {machine['date']}; {machine['machine']}; torch {machine['torch']}",
             "- command: `.venv/bin/python bench/cpu_peak.py` (method: its docstring)", "",
             "| matmul n | fp32 TFLOP/s | bf16 TFLOP/s |", "|---:|---:|---:|"]
    lines += [f"| {n} | {fp32[n]:.3f} | {bf16[n]:.3f} |" for n in fp32]
    lines += ["", f"- table entry: fp32 {entry['fp32']}, bf16 {entry['bf16']} TFLOP/s per worker",
              f"- small-llama training step (fp32): {step:.4f} TFLOP/s median (p10-p90 {step_lo:.4f}-{step_hi:.4f}), "
              f"{step / entry['fp32']:.0%} of the entry's fp32 peak"]
    out = ROOT / "bench" / "results"
    (out / "cpu_peak.md").write_text("\n".join(lines) + "\n")
    (out / "cpu_peak.json").write_text(json.dumps({"machine": machine, "fp32": fp32, "bf16": bf16,
                                                   "step_tflops": [step, step_lo, step_hi], "entry": entry}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
