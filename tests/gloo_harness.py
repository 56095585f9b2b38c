"""Run a plan's worker function on N real gloo processes without Ray (fast option coverage).

The Ray path itself is tested per strategy family in test_trial_ray.py; this harness runs the
very same `train_and_measure` over a real torch.distributed process group, so the many
option-by-option parity tests fit in CI's time.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _function(name: str):
    """The function a 'module:function' name points to."""
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _worker(rank: int, world: int, port: int, plan_dicts: list[dict], queue, setup: str | None = None,
            measure: str | None = None) -> None:
    """Runs the plans one after another in one process group (one spawn and import for all).
    `setup` ('module:function') is called first, in every worker; `measure` replaces
    train_and_measure (same arguments)."""
    import torch
    import torch.distributed as dist

    from paratune.plan import load_plan_dict
    from paratune.trial import train_and_measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        if setup is not None:
            _function(setup)()
        run = train_and_measure if measure is None else _function(measure)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        outs = [run(load_plan_dict(p), rank, world, world, torch.device("cpu")) for p in plan_dicts]
        if rank == 0:
            queue.put(("ok", outs))
    except Exception:
        queue.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What every worker imports, imported once by the fork server: its children start with them loaded
# (8 processes importing torch and transformers on 2 cores took ~85 s; forked, ~13 s).
PRELOAD = ["torch", "torch.distributed", "paratune.trial", "paratune.parallel", "transformers",
           "transformers.models.llama.modeling_llama"]


def _context():
    """forkserver with the imports preloaded: a clean process (no threads, no Ray, no process group
    of the test process) forked from a server that imported the heavy modules once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_on_gloo(plan) -> dict:
    """Rank 0's measurements; raises RuntimeError with the worker traceback on failure."""
    return run_plans_on_gloo([plan])[0]


def run_plans_on_gloo(plans, setup: str | None = None, measure: str | None = None) -> list[dict]:
    """Rank 0's measurements of several plans of one world size, run in order by the same
    processes (what a test of many plans pays once: process start, imports, process group).
    `setup`: 'module:function' each worker calls first (e.g. a test-only shim); `measure`:
    'module:function' each worker runs per plan instead of train_and_measure (same arguments)."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    world = plans[0].num_workers
    if any(p.num_workers != world for p in plans):
        raise ValueError("run_plans_on_gloo: every plan must have the same num_workers")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, [p.to_dict() for p in plans], queue, setup, measure))
             for r in range(world)]
    for p in procs:
        p.start()
    status, payload = "error", "a worker process died before reporting"
    while True:
        if not queue.empty():
            status, payload = queue.get()
            break
        if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
            if not queue.empty():
                continue
            break
        time.sleep(0.2)
    for p in procs:
        p.join(timeout=120 if status == "ok" else 5)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def run_named_batch(named_plans: dict, **kwargs) -> dict:
    """Plans of one world size (by case name) run as one batch: name -> (plan, rank 0's output).
    A failure is kept for every name, so each test re-raises it (`batch_result`) instead of re-running."""
    names, plans = list(named_plans), list(named_plans.values())
    try:
        return dict(zip(names, zip(plans, run_plans_on_gloo(plans, **kwargs))))
    except RuntimeError as err:
        return {n: err for n in names}


def batch_result(run) -> tuple:
    """(plan, output) of one case of `run_named_batch`, or its batch's failure raised."""
    if isinstance(run, Exception):
        raise run
    return run
