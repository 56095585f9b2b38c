"""GPU acceptance run: what only a GPU can show, checked in one go on ONE GPU (under 8 minutes).

For each strategy family (DDP, FSDP2 full, ZeRO-2, ZeRO-3, ZeRO-3 with optimizer offload and
DeepSpeed's CPU Adam) and two lever families on FSDP2 full (every block compiled; torchao's
float8 tensorwise linears), a bf16 trial on the Llama-3.2-1B shape through the very worker code a Ray
trial runs (`paratune.trial.worker.train_and_measure` on a one-rank process group: the device image has
no Ray), with: tokens/s/GPU and MFU, peak memory against the cost model's prediction,
construction memory, the compute dtype of every linear layer's matmul (must be bf16; a float8
plan's converted linears float8_e4m3fn and the rest bf16: paratune.trial.precision), the
collective event names a real CUDA profile shows (a one-rank all-reduce runs no NCCL kernel: no
communication share is measurable on one GPU, and the report says so), then a deliberately
oversized plan that must come back `oom`, and the single-GPU bench.

Each part runs on its own: a family (or the probe, the oversized plan, the single-GPU bench) that
fails is recorded with its classified reason and the run goes on. A family the machine's software
cannot run is `skipped` with the reason and listed as not checked (not failed): the float8 family
where torchao is not importable (the image has none: `bench/gpu_wheels.sh` ships its wheel), the
compiled family in the CPU smoke run (a cold Inductor compile of the blocks costs more on CPU than
the whole smoke; the compile tests cover it there). The versions it ran under are
printed first and written into the report. Exit status 0 only if every check passed.

Writes bench/results/gpu_acceptance.{md,json} (or $OUT/ when set). Without a GPU it smoke-runs the
same code on a tiny model (CPU, gloo) and writes to a temporary folder (tests/test_gpu_acceptance.py
runs it where Ray, MLflow and Optuna cannot be imported, with the image's transformers).

On the device machine (no Ray, MLflow, Optuna, DeepSpeed or pydantic there: nothing on the worker
path imports the first three, and the others travel as wheels, 8 MB with torchao's: `bash bench/gpu_wheels.sh`
here, then a run that carries `.whl`):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
      PYTHONPATH=/tmp/site:platform python3 bench/gpu_acceptance.py
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

ON_GPU = torch.cuda.is_available()
SMOKE = not ON_GPU
MODEL, SEQ, GLOBAL_BATCH, MICRO = ("llama3.2-1b", 2048, 8, 2) if ON_GPU else ("tiny-llama", 64, 4, 2)
WARMUP, MEASURED = (2, 4) if ON_GPU else (1, 2)  # the CPU smoke run proves the script, not the figures
DEVICE_ENTRY = "h200-141gb"  # the cost model's table entry for the lent GPU (see README)

FAMILIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "fsdp-full": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "zero-2": {"strategy": "zero", "zero": {"stage": 2}},
    "zero-3": {"strategy": "zero", "zero": {"stage": 3}},
    # DeepSpeed's own optimizer from its config block: DeepSpeedCPUAdam under optimizer offload.
    "zero-3-offload-cpu-adam": {"strategy": "zero", "optimizer": "deepspeed",
                                "zero": {"stage": 3, "offload_optimizer": True}},
    # Issue 28's levers, on the layout torchtitan measures them with (FSDP2 full, bf16). Compiled with
    # selective checkpointing: the checkpoint inside each compiled block's graph (paratune.parallel.
    # recompute; on the image's transformers 5.17 its own hook left it outside).
    "fsdp-full-compiled-selective": {"strategy": "fsdp", "fsdp": {"sharding": "full"}, "compile": True,
                                     "activation_checkpointing": "selective"},
    "fsdp-full-float8-tensorwise": {"strategy": "fsdp", "fsdp": {"sharding": "full"}, "float8": "tensorwise"},
}
# Must fail with `oom`: on the GPU, Llama-3-70B replicated by DDP (~282 GB of fp32 weights on one
# 141 GB card); on CPU, an embedding no allocator can hold.
OVERSIZED: dict[str, Any] = ({"model": "llama3-70b", "strategy": "ddp"} if ON_GPU else
                             {"strategy": "ddp", "model_overrides": {"vocab_size": 2**40, "hidden_size": 64}})


def _device() -> torch.device:
    return torch.device("cuda", 0) if ON_GPU else torch.device("cpu")


def _start_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PARATUNE_ACCEPT_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if ON_GPU:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if ON_GPU else "gloo", rank=0, world_size=1)


def _plan(family: dict[str, Any]):
    from paratune.config.plan import load_plan_dict

    return load_plan_dict({"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO,
                           "num_workers": 1, "precision": "bf16", "warmup_steps": WARMUP, "measure_steps": MEASURED,
                           "device": "cuda" if ON_GPU else "cpu", "profile_comm": False, **family})


def family_unavailable(family: dict[str, Any]) -> str | None:
    """Why this machine's software cannot run a family (None: it can): the run says so and goes on."""
    if family.get("float8", "none") != "none":
        try:
            import torchao.float8  # noqa: F401
        except ImportError as err:
            return f"torchao not importable ({err}): the float8 family needs it (bench/gpu_wheels.sh ships it)"
    if SMOKE and family.get("compile"):
        return ("not compiled in the CPU smoke run: a cold Inductor compile of the blocks costs more than the "
                "whole smoke (the compile tests cover it on CPU)")
    return None


def beyond_this_run() -> list[str]:
    """What the acceptance run cannot exercise on one GPU of the image, said plainly in its report."""
    from paratune.parallel.ep import ep_unavailable

    missing = ep_unavailable()
    return [f"expert parallelism: {missing}" if missing else "expert parallelism: needs 2 or more ranks",
            "tp, sequence parallelism, async TP, pp, cp and every collective's kernels: need 2 or more GPUs "
            "(one is lent)"]


def _release() -> None:
    """What a reused worker group does between plans (paratune.cluster.session): collect, then give back
    the device's and the pinned host caches (the offload families fill the latter)."""
    from paratune.trial.worker import release_cached_memory

    gc.collect()
    release_cached_memory(_device())


def run_family(name: str, family: dict[str, Any]) -> dict[str, Any]:
    """One strategy family as a trial: the worker's own measurement, then prediction and checks."""
    from paratune.costs import measure
    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate
    from paratune.trial.failures import classify
    from paratune.model.build import build_config
    from paratune.trial.precision import precision_problem
    from paratune.cluster.trial import summarize
    from paratune.trial.worker import train_and_measure

    why_not = family_unavailable(family)  # before the plan: its validation refuses float8 without torchao
    if why_not is not None:
        print(f"family {name}: skipped: {why_not}", flush=True)
        return {"family": name, "status": "skipped", "reason": "skipped", "message": why_not}
    plan = _plan(family)
    t0 = time.perf_counter()
    try:
        out = train_and_measure(plan, 0, 1, 1, _device())
    except Exception as err:  # noqa: BLE001 - a failing family is a finding, not the end of the run
        reason, message = classify(err)
        return {"family": name, "status": "failed", "reason": reason, "message": message,
                "traceback": traceback.format_exc()[-2000:]}
    finally:
        _release()
    result = summarize(plan, out, measure.model_flops_per_token(build_config(plan.model), plan.seq_len),
                       time.perf_counter() - t0)
    predicted = estimate(plan, get_device(DEVICE_ENTRY))
    peak = result.peak_memory_bytes[0] if result.peak_memory_bytes else None
    problem = precision_problem(plan.precision, plan.float8, result.linear_matmul_dtypes)
    return {
        "family": name, "status": "ok", "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu, "mfu": result.mfu,
        "step_time_median_s": result.step_time_median_s, "step_time_spread": result.step_time_spread,
        "peak_memory_bytes": peak, "memory_method": result.memory_method,
        "predicted_memory_bytes": predicted.memory.total, "predicted_construction_bytes": predicted.construction,
        "memory_error": (predicted.memory.total - peak) / peak if peak else None,
        "construction_peak_bytes": result.construction_peak_bytes[0] if result.construction_peak_bytes else None,
        "linear_matmul_dtypes": result.linear_matmul_dtypes, "optimizer_class": result.optimizer_class,
        "compute_dtype_ok": problem is None, "precision_problem": problem,
        "losses": result.losses, "device": result.device,
    }


def comm_share_probe() -> dict[str, Any]:
    """The parser on a real profile: an all-reduce loop under torch.profiler, with the distinct
    event names that look like collectives (so the parser's input is seen).

    On one rank there is nothing to measure: NCCL runs no kernel for a one-rank all-reduce (and
    gloo returns at once), so a share would be a number about nothing. It is reported as not
    measurable; the names are still recorded."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from paratune.costs import measure

    world = dist.get_world_size()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    x = torch.ones(64 * 2**20 if ON_GPU else 2**16, device=_device())
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(x)
        if ON_GPU:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    names = sorted({e.name for e in prof.events() if any(k in e.name.lower() for k in ("nccl", "gloo", "allreduce"))})
    if world == 1:
        share, note = None, (f"not measurable on one rank ({'NCCL runs no kernel' if ON_GPU else 'gloo moves nothing'} "
                             "for a one-rank all-reduce)")
    else:
        share, note = measure.comm_share_from_profile(prof, seconds, _device().type), f"{world} ranks"
    del x
    _release()
    return {"status": "ok", "world_size": world, "share_of_all_reduce_loop": share, "note": note,
            "collective_event_names": names[:40]}


def oversized() -> dict[str, Any]:
    """A plan that cannot fit must come back as `oom`, classified from what the worker raised."""
    from paratune.trial.failures import classify
    from paratune.trial.worker import train_and_measure

    plan = _plan({**OVERSIZED})
    try:
        train_and_measure(plan, 0, 1, 1, _device())
        return {"status": "ok", "reason": None, "message": "the oversized plan did not fail"}
    except Exception as err:  # noqa: BLE001
        reason, message = classify(err)
        return {"status": "failed", "reason": reason, "message": message[:300]}
    finally:
        _release()


def _size(x: float | None) -> str:
    """Bytes as GiB, or MiB below 0.1 GiB (the smoke run's tiny model is a few MiB)."""
    if x is None:
        return ""
    return f"{x / 2**30:.2f} GiB" if x >= 0.1 * 2**30 else f"{x / 2**20:.1f} MiB"


def checks_failed(rows: list[dict], probe: dict, too_big: dict, single: list[dict] | None) -> list[str]:
    """What did not pass, one line each (empty: the acceptance run passed)."""
    failed = [f"family {r['family']}: {r.get('reason')}: {r.get('message')}" for r in rows
              if r["status"] not in ("ok", "skipped")]
    failed += [f"family {r['family']}: {r.get('precision_problem')}"
               for r in rows if r["status"] == "ok" and not r["compute_dtype_ok"]]
    if probe.get("status") != "ok":
        failed.append(f"communication probe: {probe.get('message')}")
    if too_big.get("reason") != "oom":
        failed.append(f"oversized plan: {too_big.get('reason')} (must be oom): {too_big.get('message')}")
    if single is not None:
        failed += [f"single-GPU bench: {s.get('message') or s.get('status')}" for s in single
                   if s.get("status") not in ("ok",) and not str(s.get("status", "")).startswith("oom")]
    return failed


def write_report(out_dir: Path, rows: list[dict], probe: dict, too_big: dict, single: list[dict] | None,
                 machine: dict) -> Path:
    from machine import versions_line

    warmup, measured = WARMUP, MEASURED
    lines = [f"# GPU acceptance ({MODEL}, seq {SEQ}, global batch {GLOBAL_BATCH}, micro-batch {MICRO}, bf16, 1 GPU)", "",
             f"- date: {machine.get('date')}; device: {machine.get('gpu') or 'cpu (smoke run)'}; {machine.get('machine')}",
             f"- versions: {versions_line(machine)}, torchao {machine.get('torchao')}",
             f"- {warmup} warm-up + {measured} measured whole optimizer steps per family; MFU vs dense bf16 peak "
             f"(n/a without a GPU peak); prediction: `{DEVICE_ENTRY}` in the device table", "",
             "| family | optimizer | tokens/s/GPU | MFU | step ms (spread) | peak | predicted (error) | "
             "construction (predicted) | linear matmuls | precision ok |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"| {r['family']} | | not checked: {r['message']} | | | | | | | |")
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | | {r['reason']}: {str(r['message'])[:120]} | | | | | | | no |")
            continue
        err = f" ({r['memory_error']:+.0%})" if r["memory_error"] is not None else ""
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {r['family']} | {r['optimizer_class']} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | "
            f"{r['step_time_median_s'] * 1e3:.0f} ({r['step_time_spread']:.0%}) | {_size(r['peak_memory_bytes'])} | "
            f"{_size(r['predicted_memory_bytes'])}{err} | {_size(r['construction_peak_bytes'])} "
            f"({_size(r['predicted_construction_bytes'])}) | {r['linear_matmul_dtypes']} | "
            f"{'yes' if r['compute_dtype_ok'] else 'NO'} |")
    lines.append("")
    lines += [f"- peak memory: {r['family']}: {r['memory_method']}" for r in rows[:1] if r["status"] == "ok"]
    share = probe.get("share_of_all_reduce_loop")
    lines += ["", "## Communication-share parser on a real profile",
              f"- share of a 5 x all-reduce loop in flight: "
              f"{f'{share:.1%}' if share is not None else probe.get('note') or probe.get('message')}",
              f"- collective event names seen: {', '.join(probe.get('collective_event_names', [])) or '(none)'}",
              "", "## Oversized plan", f"- `{json.dumps(OVERSIZED)}`: {too_big.get('status')}, reason "
              f"**{too_big.get('reason')}** ({'as required' if too_big.get('reason') == 'oom' else 'WRONG: must be oom'})",
              f"- message: {too_big.get('message')}"]
    if single is not None:
        lines += ["", "## Single-GPU bench (bench/gpu_single.py)", "",
                  "| micro-batch | checkpointing | tokens/s | MFU | peak alloc GiB |", "|---|---|---:|---:|---:|"]
        for s in single:
            if s.get("status") != "ok":
                lines.append(f"| {s.get('micro_batch')} | {s.get('checkpointing')} | {s.get('status')} | | |")
            else:
                lines.append(f"| {s['micro_batch']} | {s['checkpointing']} | {s['tokens_per_s']:,.0f} | "
                             f"{(s['mfu'] or 0):.1%} | {s['peak_allocated_gib']:.1f} |")
    failed = checks_failed(rows, probe, too_big, single)
    skipped = [f"family {r['family']}: {r['message']}" for r in rows if r["status"] == "skipped"] + beyond_this_run()
    lines += ["", "## Verdict", "- every check passed" if not failed else "- FAILED:"]
    lines += [f"  - {f}" for f in failed]
    lines += ["- not checked:"] * bool(skipped) + [f"  - {s}" for s in skipped]
    path = out_dir / "gpu_acceptance.md"
    path.write_text("\n".join(lines) + "\n")
    (out_dir / "gpu_acceptance.json").write_text(json.dumps(
        {"machine": machine, "families": rows, "comm_share_probe": probe, "oversized": too_big, "single_gpu": single,
         "failed": failed, "not_checked": skipped}, indent=1, default=str))
    return path


def guarded(part: str, fn, *args) -> Any:
    """Run one part of the acceptance run; a crash becomes that part's failed result, not the run's end."""
    from paratune.trial.failures import classify

    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - every part is a finding, the next part still runs
        reason, message = classify(err)
        print(f"{part} failed: {reason}: {message}", flush=True)
        return {"status": "failed", "reason": reason, "message": message, "traceback": traceback.format_exc()[-2000:]}
    finally:
        _release()


def main(run_single_gpu_bench: bool = True) -> int:
    from machine import describe, package_version, versions_line

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    machine = describe()
    machine["torchao"] = package_version("torchao")  # the float8 family's (not on the GPU image)
    print(f"versions: {versions_line(machine)}, torchao {machine['torchao']}", flush=True)
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    if SMOKE:  # never overwrite real GPU figures with a smoke run
        out_dir = Path(os.environ.get("PARATUNE_ACCEPT_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "paratune_gpu_smoke")
    out_dir.mkdir(parents=True, exist_ok=True)
    _start_process_group()
    started = time.perf_counter()
    rows = []
    for name, family in FAMILIES.items():
        row = guarded(f"family {name}", run_family, name, family)
        row.setdefault("family", name)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "traceback")}, default=str), flush=True)
    probe = guarded("communication probe", comm_share_probe)
    print(json.dumps(probe, default=str), flush=True)
    too_big = guarded("oversized plan", oversized)
    print(json.dumps(too_big, default=str), flush=True)
    single = None
    if run_single_gpu_bench:
        def single_gpu() -> list[dict]:
            import gpu_single

            return gpu_single.run_all()

        single = guarded("single-GPU bench", single_gpu)
        single = single if isinstance(single, list) else [single]
    path = write_report(out_dir, rows, probe, too_big, single, machine)
    print(path.read_text())
    print(f"acceptance run took {time.perf_counter() - started:.0f} s; report: {path}")
    return 1 if checks_failed(rows, probe, too_big, single) else 0


if __name__ == "__main__":
    sys.exit(main(run_single_gpu_bench="--no-single" not in sys.argv))
