"""Single-GPU part of the bench: bf16, Llama-3.2-1B shape, micro-batch x activation checkpointing.

Runs in one process (no Ray: the GPU image has torch and transformers but not Ray), through
paratune's own model, data, step runner and measurement, so its numbers mean the same as a
trial's. Prints tokens/s and MFU per variant and writes bench/results/gpu_single.{md,json}
(or $OUT/ when set). Budget: well under 8 minutes on one H100/H200.

On the device machine (pydantic is not in its image; carry its wheels, see gpu_wheels.sh):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:platform python3 bench/gpu_single.py
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from machine import describe  # noqa: E402
from paratune.config import devices
from paratune.costs import measure  # noqa: E402
from paratune.config.data import TokenBatches  # noqa: E402
from paratune.model.build import build_config, build_model  # noqa: E402
from paratune.parallel.recompute import apply_checkpointing  # noqa: E402
from paratune.parallel.runner import StepRunner, make_optimizer  # noqa: E402
from paratune.config.plan import load_plan_dict  # noqa: E402

MODEL, SEQ, GLOBAL_BATCH = "llama3.2-1b", 2048, 8
SMOKE = not torch.cuda.is_available()  # on a machine without a GPU: the same code path, tiny model
if SMOKE:
    MODEL, SEQ = "tiny-llama", 64
VARIANTS = [(mb, ckpt) for ckpt in ("none", "full") for mb in (1, 2, 4, 8)]
WARMUP, MEASURE = 2, 5


def run_variant(micro_batch: int, ckpt: str, track: Callable[[object], None] | None = None) -> dict:
    """Measure one variant, then release everything it built, so the next variant's peak is its own.

    `track` is called with the model, the optimizer and the step runner as they are built (a test
    holds weak references to them to see that they are gone when this returns).
    """
    device = torch.device("cpu") if SMOKE else torch.device("cuda", 0)
    try:
        row = _measure_variant(micro_batch, ckpt, device, track)
    except torch.OutOfMemoryError as err:
        row = {"micro_batch": micro_batch, "checkpointing": ckpt, "status": f"oom: {str(err)[:80]}"}
    # Here, past the except block, no traceback holds the variant's frames any more.
    release(device)
    return row


def release(device: torch.device) -> None:
    """Free a finished variant: reference cycles wait for the collector, and the CUDA caching
    allocator keeps freed blocks reserved (and the peak counters) unless told otherwise."""
    from paratune.trial.worker import release_cached_memory

    gc.collect()
    release_cached_memory(device)


def _measure_variant(micro_batch: int, ckpt: str, device: torch.device,
                     track: Callable[[object], None] | None) -> dict:
    plan = load_plan_dict({"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "micro_batch": micro_batch,
                           "num_workers": 1, "precision": "bf16", "activation_checkpointing": ckpt,
                           "warmup_steps": WARMUP, "measure_steps": MEASURE})
    sync = (lambda: None) if SMOKE else (lambda: torch.cuda.synchronize(device))
    config = build_config(plan.model)
    model = build_model(config, seed=0, device=device)  # fp32 master weights, bf16 autocast
    model.train()
    apply_checkpointing(model, plan)
    optimizer = make_optimizer(model.parameters(), plan)
    runner = StepRunner(model, optimizer, plan, device, autocast=True)
    if track is not None:
        for built in (model, optimizer, runner):
            track(built)
    data = TokenBatches(plan.data, config.vocab_size, SEQ, GLOBAL_BATCH, seed=0)
    times, losses = [], []
    for step in range(plan.total_steps):
        micro = [m.to(device) for m in data.micro_batches(step, 0, 1, micro_batch)]
        if step == WARMUP and not SMOKE:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0 = time.perf_counter()
        losses.append(float(runner.train_step(micro)))
        sync()
        times.append(time.perf_counter() - t0)
    measured = times[WARMUP:]
    stats = measure.step_stats(measured)
    tps = measure.tokens_per_second_per_gpu(plan.tokens_per_step, measured, 1)
    flops_tok = measure.model_flops_per_token(config, SEQ)
    peak = None if SMOKE else devices.device_peak_flops(torch.cuda.get_device_name(0), "bf16")
    gib = (lambda f: 0.0) if SMOKE else (lambda f: f(device) / 2**30)
    return {"micro_batch": micro_batch, "grad_accum": plan.grad_accum, "checkpointing": ckpt, "status": "ok",
            "tokens_per_s": tps, "mfu": measure.mfu(tps, flops_tok, peak), "step_median_s": stats.median,
            "step_p10_s": stats.p10, "step_p90_s": stats.p90,
            "peak_allocated_gib": gib(torch.cuda.max_memory_allocated),
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved), "losses": losses}


def run_all() -> list[dict]:
    """Every variant, one after another (each frees what it built before the next starts)."""
    rows = []
    for mb, ckpt in VARIANTS:
        row = run_variant(mb, ckpt)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return rows


def main() -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    if SMOKE:  # never overwrite real GPU figures with a smoke run
        out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "paratune_gpu_smoke"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = run_all()
    machine = describe()
    lines = [f"# Single-GPU bench ({MODEL}, seq {SEQ}, global batch {GLOBAL_BATCH}, bf16 autocast, AdamW)", "",
             f"- date: {machine['date']}", f"- GPU: {machine.get('gpu')}; torch {machine['torch']}",
             f"- {WARMUP} warm-up + {MEASURE} measured whole optimizer steps; MFU vs dense bf16 peak", "",
             "| micro-batch x accum | checkpointing | tokens/s | MFU | step ms (p10-p90) | peak alloc GiB |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['micro_batch']} | {r['checkpointing']} | {r['status']} | | | |")
            continue
        lines.append(f"| {r['micro_batch']} x {r['grad_accum']} | {r['checkpointing']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['mfu'] or 0:.1%} | {r['step_median_s'] * 1e3:.0f} ({r['step_p10_s'] * 1e3:.0f}-"
                     f"{r['step_p90_s'] * 1e3:.0f}) | {r['peak_allocated_gib']:.1f} |")
    (out_dir / "gpu_single.md").write_text("\n".join(lines) + "\n")
    (out_dir / "gpu_single.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
