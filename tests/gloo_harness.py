"""Run a plan's worker function on N real gloo processes without Ray (fast option coverage).

The Ray path itself is tested per strategy family in test_trial_ray.py; this harness runs the
very same `train_and_measure` over a real torch.distributed process group, so the many
option-by-option parity tests fit in CI's time.

Plans of one world size run one after another in ONE set of processes (one spawn, one import,
one process group for all). A plan that fails fails alone: `run_plans_isolated` records its
error, and the plans after it run in a fresh set of processes (a failed collective can leave the
old group unusable). The single-process reference losses a test compares with are computed once
per distinct training (`reference_for`), however many layouts share it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import traceback

import pytest
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


def record_group_creation(created: list[dict]) -> None:
    """Every process group this process creates from now on (new_group, split_group, DeviceMesh's
    groups, DeepSpeed's: all go through c10d's `_new_process_group_helper`) is appended to
    `created` as {"ranks", "timeout_s", "desc"}: the timeout each group really got."""
    import torch.distributed.distributed_c10d as c10d

    create = c10d._new_process_group_helper

    def recording(group_size, group_rank, global_ranks_in_group, backend, store, group_name, backend_options=None,
                  timeout=None, *args, **kwargs):
        created.append({"ranks": list(global_ranks_in_group), "desc": kwargs.get("group_desc"),
                        "timeout_s": None if timeout is None else timeout.total_seconds()})
        return create(group_size, group_rank, global_ranks_in_group, backend, store, group_name, backend_options,
                      timeout, *args, **kwargs)

    c10d._new_process_group_helper = recording


def assert_groups_use_plan_timeout(plan, out: dict, expect_groups: bool = True) -> None:
    """Every process group a plan's run created (rank 0's view: `groups_created`) times out after
    the plan's comm_timeout_s, not the library default (30 min gloo, 10 min NCCL)."""
    created = out["groups_created"]
    assert created or not expect_groups, "the plan created no process group: nothing was checked"
    wrong = [g for g in created if g["timeout_s"] != plan.comm_timeout_s]
    assert not wrong, f"groups without the plan's comm_timeout_s {plan.comm_timeout_s}: {wrong}"


def _worker(rank: int, world: int, port: int, plan_dicts: list[dict], queue, setup: str | None = None,
            measure: str | None = None, fault_file: str | None = None) -> None:
    """Runs the plans one after another in one process group (one spawn and import for all).
    `setup` ('module:function') is called first, in every worker; `measure` replaces
    train_and_measure (same arguments). Rank 0 reports each plan's output as it finishes
    (("ok", i, out), with `groups_created`: the process groups the plan made, see
    `record_group_creation`); any rank reports the first failure (("error", i, traceback); i is -1
    before the first plan) and stops; rank 0 ends with ("done", None, None). A rank killed by a
    signal (a segfault in a library) cannot report: faulthandler writes its Python stacks to
    `fault_file`, and the harness shows them."""
    import faulthandler

    if fault_file is not None:
        faulthandler.enable(open(fault_file, "w"), all_threads=True)  # noqa: SIM115 - kept open until the process ends
    import torch
    import torch.distributed as dist

    from paratune.config.plan import load_plan_dict
    from paratune.trial.worker import train_and_measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    index = -1
    try:
        if setup is not None:
            _function(setup)()
        run = train_and_measure if measure is None else _function(measure)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        created: list[dict] = []
        record_group_creation(created)
        for index, plan in enumerate(plan_dicts):
            created.clear()
            out = run(load_plan_dict(plan), rank, world, world, torch.device("cpu"))
            if rank == 0:
                queue.put(("ok", index, {**out, "groups_created": list(created)}))
        if rank == 0:
            queue.put(("done", None, None))
    except Exception:
        queue.put(("error", index, f"rank {rank}: {traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What every worker imports, imported once by the fork server: its children start with them loaded
# (8 processes importing torch and transformers on 2 cores took ~85 s; forked, ~13 s). DeepSpeed
# too (~1.5 s of CPU per rank of every set of processes that runs a ZeRO plan; it starts no thread).
PRELOAD = ["torch", "torch.distributed", "paratune.cluster.trial", "paratune.trial.worker", "paratune.parallel", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt_neox.modeling_gpt_neox",
           "transformers.models.opt.modeling_opt", "deepspeed"]


def _context():
    """forkserver with the imports preloaded: a clean process (no threads, no Ray, no process group
    of the test process) forked from a server that imported the heavy modules once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_group(plans, setup, measure) -> tuple[list[dict], int | None, str | None]:
    """One set of processes runs the plans in order until one fails. Returns the outputs of the
    plans that finished (in order), and the index and error text of the one that failed (None, None
    when all finished; -1 when the workers failed before the first plan)."""
    import tempfile

    ctx = _context()
    queue = ctx.SimpleQueue()
    world = plans[0].num_workers
    port = _free_port()
    faults = tempfile.TemporaryDirectory(prefix="gloo-faults-")
    fault_files = [os.path.join(faults.name, f"rank{r}.txt") for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, port, [p.to_dict() for p in plans], queue, setup, measure,
                                               fault_files[r]))
             for r in range(world)]
    for p in procs:
        p.start()
    outs: list[dict] = []
    failed, errors, done = None, [], False

    def take(item) -> None:
        nonlocal failed, done
        status, index, payload = item
        if status == "ok" and index == len(outs) and (failed is None or index < failed):
            outs.append(payload)
        elif status == "done":
            done = True
        elif status == "error":
            errors.append(payload)
            failed = index if failed is None else min(failed, index)

    while not done and failed is None:
        if not queue.empty():
            take(queue.get())
            continue
        if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
            if not queue.empty():
                continue
            failed = len(outs)
            errors.append("a worker process died before reporting")
            break
        time.sleep(0.2)
    for p in procs:
        p.join(timeout=120 if failed is None else 5)
        if p.is_alive():
            p.kill()
            p.join()
    while not queue.empty():  # rank 0's last output, the other ranks' view of a failure
        take(queue.get())
    if failed is not None:
        failed = -1 if failed < 0 else min(failed, len(outs))
        outs = outs[:max(failed, 0)]
        errors.append(f"plan {failed} of {len(plans)} failed; worker exit codes: {[p.exitcode for p in procs]}")
        for rank, path in enumerate(fault_files):  # a rank that died by a signal: where it was
            with contextlib.suppress(OSError), open(path) as f:
                text = f.read().split("\nExtension modules:")[0].strip()  # the stacks, not the module list
                if text:
                    errors.append(f"rank {rank} died by a signal (faulthandler):\n{text}")
    faults.cleanup()
    return outs, failed, "\n".join(errors) if failed is not None else None


def run_plans_isolated(plans, setup: str | None = None, measure: str | None = None) -> list:
    """Rank 0's measurements of several plans of one world size, in order, or for a plan that
    failed, a RuntimeError with the worker tracebacks in its place (the other plans still run:
    the ones after it in fresh processes). A failure before the first plan (the setup, the process
    group) is every plan's."""
    plans = list(plans)
    world = plans[0].num_workers
    if any(p.num_workers != world for p in plans):
        raise ValueError("run_plans_on_gloo: every plan must have the same num_workers")
    results: list = []
    while len(results) < len(plans):
        rest = plans[len(results):]
        outs, failed, error = _run_group(rest, setup, measure)
        results += outs
        if failed is None:
            break
        if failed < 0:  # before the first plan: no plan can run in these processes
            err = RuntimeError(f"the workers failed before the first plan:\n{error}")
            results += [err] * (len(plans) - len(results))
        else:
            results.append(RuntimeError(f"plan {len(results)} of {len(plans)} failed:\n{error}"))
    return results


def run_on_gloo(plan) -> dict:
    """Rank 0's measurements; raises RuntimeError with the worker traceback on failure."""
    return run_plans_on_gloo([plan])[0]


def run_plans_on_gloo(plans, setup: str | None = None, measure: str | None = None) -> list[dict]:
    """Rank 0's measurements of several plans of one world size, run in order by the same
    processes (what a test of many plans pays once: process start, imports, process group).
    `setup`: 'module:function' each worker calls first (e.g. a test-only shim); `measure`:
    'module:function' each worker runs per plan instead of train_and_measure (same arguments).
    Raises the first failure (RuntimeError with the worker tracebacks)."""
    plans = list(plans)
    world = plans[0].num_workers
    if any(p.num_workers != world for p in plans):
        raise ValueError("run_plans_on_gloo: every plan must have the same num_workers")
    outs, failed, error = _run_group(plans, setup, measure)
    if failed is not None:
        raise RuntimeError(error)
    return outs


def run_named_batch(named_plans: dict, **kwargs) -> dict:
    """Plans of one world size (by case name) run as one batch: name -> (plan, rank 0's output),
    or for a plan that failed, its error (`batch_result` raises it in that case's test only)."""
    names, plans = list(named_plans), list(named_plans.values())
    return {n: (RuntimeError(f"{n}: {out}") if isinstance(out, Exception) else (plan, out))
            for n, plan, out in zip(names, plans, run_plans_isolated(plans, **kwargs))}


def batch_result(run) -> tuple:
    """(plan, output) of one case of `run_named_batch`, or that case's failure raised."""
    if isinstance(run, Exception):
        raise run
    return run


# Fields that only lay the same training out differently (or say what else to measure): the
# single-process reference reads none of them, so plans differing only in these share one.
LAYOUT_FIELDS = ("strategy", "ddp", "fsdp", "zero", "tp", "pp", "pp_schedule", "sequence_parallel", "cp", "ep",
                 "num_workers", "grad_accum", "track_memory", "profile_comm")


def training_key(plan) -> str:
    """What the single-process reference's training depends on: the plan without its layout."""
    return json.dumps({k: v for k, v in plan.to_dict().items() if k not in LAYOUT_FIELDS}, sort_keys=True)


_references: dict[str, list[float]] = {}


def reference_for(plan) -> list[float]:
    """`paratune.sweep.parity.reference_losses(plan)`, computed once per distinct training in this
    test session (the reference is deterministic: same training, same losses)."""
    from paratune.sweep.parity import reference_losses

    key = training_key(plan)
    if key not in _references:
        with single_torch_thread():
            _references[key] = reference_losses(plan)
    return list(_references[key])


@contextlib.contextmanager
def single_torch_thread():
    """Torch ops in this (the test) process on one thread, as the gloo workers run: the tiny
    models gain nothing from a second thread, and on a loaded 2-core machine OpenMP's barriers
    made one reference run ~30x slower (0.2 s on one thread, 5-7 s on two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Imported into a test module, runs each of its tests under `single_torch_thread`."""
    with single_torch_thread():
        yield
