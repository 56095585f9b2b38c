"""bench/gpu_single.py frees each variant before the next one (smoke run on CPU, tiny model).

On a GPU a finished variant left alive keeps its weights, gradients and optimizer states
allocated, and every later variant's peak memory includes them.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_single.py"


def _bench() -> ModuleType:
    """A fresh copy of the bench module, with a short run (1 warm-up + 2 measured steps)."""
    spec = importlib.util.spec_from_file_location("gpu_single_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.WARMUP, module.MEASURE = 1, 2
    return module


def _run_and_see_what_survives(bench: ModuleType, make_cycle: bool) -> tuple[dict, list[str]]:
    """Run one variant with automatic collection off (only run_variant's own release may free
    what it built) and return its row and the names of what is still alive when it returns."""
    built: list[weakref.ref] = []

    def track(obj: object) -> None:
        built.append(weakref.ref(obj))
        if make_cycle and isinstance(obj, bench.StepRunner):
            obj.itself = obj  # a reference cycle through the runner, as its clip closure once made

    gc.collect()
    gc.disable()
    try:
        row = bench.run_variant(4, "full", track=track)  # 2 micro-batches per step, recomputation on
        alive = [type(ref()).__name__ for ref in built if ref() is not None]
    finally:
        gc.enable()
    assert len(built) == 3  # model, optimizer, runner
    return row, alive


def test_finished_variant_is_freed_when_run_variant_returns():
    bench = _bench()
    assert bench.SMOKE and bench.MODEL == "tiny-llama"  # the CPU smoke path: same code, tiny model
    row, alive = _run_and_see_what_survives(bench, make_cycle=False)
    assert row["status"] == "ok" and len(row["losses"]) == bench.WARMUP + bench.MEASURE
    assert row["tokens_per_s"] > 0
    assert alive == []


def test_finished_variant_is_freed_even_through_a_reference_cycle():
    # Whatever keeps a variant in a cycle (the step runner's closure, a framework's hooks), the
    # bench collects it before the next variant instead of waiting for Python's collector.
    row, alive = _run_and_see_what_survives(_bench(), make_cycle=True)
    assert row["status"] == "ok"
    assert alive == []
