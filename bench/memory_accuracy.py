"""Peak memory per rank, predicted vs measured, in sample and out of sample: the memory part of
bench/estimate_accuracy.py (which calls it and writes the report).

Measured by the trial's own worker code (`paratune.trial.worker.train_and_measure`) on 2 gloo processes
(tests/gloo_harness.py, no Ray: the same function Ray Train runs), peak tensor memory of one
extra step by PyTorch's MemTracker, with DDP's buckets visible to it (bench/memory_tracking.py).

In sample: the presets the cost model was built on (the small-llama plans of the table above).
Out of sample: tiny configs of decoder families transformers ships that paratune's presets and
tests do not use (bench/families/*.json). TUNING were looked at while the memory terms were
worked out (with small-llama); HELD_OUT were not, and are the out-of-sample figure.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console

FAMILIES = Path(__file__).parent / "families"
TUNING = ("granite", "olmo2", "mixtral")
HELD_OUT = ("cohere", "stablelm", "starcoder2", "glm", "exaone4", "smollm3", "helium", "qwen3_moe", "olmoe")
# Three settings on 2 ranks: 2 micro-batches a step (accumulation); 1 with full recompute; 4 of
# one longer sequence with ZeRO buckets smaller than the models (0.5M elements: buckets fill and
# are reduced during the backward).
SETTINGS: dict[str, dict] = {
    "seq128 mb2x2": {"seq_len": 128, "micro_batch": 2, "global_batch": 8},
    "seq128 mb2x1 ckpt": {"seq_len": 128, "micro_batch": 2, "global_batch": 4, "activation_checkpointing": "full"},
    "seq256 mb1x4 bucket0.5M": {"seq_len": 256, "micro_batch": 1, "global_batch": 8,
                                "zero": {"reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000}},
}
MEMORY_BASE = {"num_workers": 2, "warmup_steps": 1, "measure_steps": 1, "profile_comm": False}
TARGET = 0.05  # issue 26 item 8: out-of-sample error under 5%, median and worst


def family_plans(families: tuple[str, ...], strategies: list[dict]) -> list[dict]:
    """(family, setting, plan) for every family x setting x strategy."""
    def plan(family: str, shape: dict, strategy: dict) -> dict:
        shape = dict(shape)
        zero = shape.pop("zero", None)
        out = {**MEMORY_BASE, "model": str(FAMILIES / f"{family}.json"), **shape, **strategy}
        if zero and strategy.get("strategy") == "zero":
            out["zero"] = {**strategy["zero"], **zero}
        return out

    return [{"family": family, "setting": setting, "plan": plan(family, shape, strategy)}
            for family in families for setting, shape in SETTINGS.items() for strategy in strategies]


def measure_memory(cases: list[dict], console: Console) -> list[dict]:
    """Each case's plan on 2 gloo processes (one set of processes for all; a failed plan fails
    alone): peak tensor bytes per rank and how they were measured."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    sys.path.insert(0, str(Path(__file__).parent))
    from gloo_harness import run_plans_isolated

    from paratune.config.plan import load_plan_dict

    plans = [load_plan_dict(c["plan"]) for c in cases]
    started = time.time()
    with console.status(f"measuring {len(plans)} plans on 2 gloo processes"):
        outs = run_plans_isolated(plans, setup="memory_tracking:setup")
    console.print(f"measured {len(plans)} plans in {time.time() - started:.0f} s")
    rows = []
    for case, plan, out in zip(cases, plans, outs):
        row = {**case, "plan": plan.to_dict()}
        if isinstance(out, Exception):
            row["error"] = str(out)[-2000:]
        else:
            row.update(peak_memory_bytes=out["peak_memory_bytes"], memory_method=out["memory_method"])
        rows.append(row)
    return rows


def predict(rows: list[dict]) -> list[dict]:
    """Predicted beside measured (the largest rank), the relative error and the predicted peak's moment."""
    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate_memory
    from paratune.config.plan import load_plan_dict
    from paratune.out.tables import strategy_label

    cpu = get_device("cpu")
    out = []
    for r in rows:
        if "error" in r or not r.get("peak_memory_bytes"):
            continue
        plan = load_plan_dict(r["plan"])
        measured = max(r["peak_memory_bytes"])
        predicted = estimate_memory(plan, device=cpu)
        label = re.sub(r" bucket\S+", "", strategy_label(r["plan"]).split(" mb")[0])  # the setting says it
        out.append({**{k: r[k] for k in ("family", "setting", "size") if k in r}, "strategy": label,
                    "measured_mib": measured / 2**20, "predicted_mib": predicted.total / 2**20,
                    "error": predicted.total / measured - 1, "phase": predicted.phase,
                    "method": predicted.method})
    return out


def by_strategy(table: list[dict]) -> dict[str, dict[str, float]]:
    """Median and worst |error| per strategy, and over all rows."""
    groups: dict[str, list[float]] = {}
    for t in table:
        groups.setdefault(t["strategy"], []).append(t["error"])
    groups["all"] = [t["error"] for t in table]
    return {k: {"median": statistics.median(abs(e) for e in v), "worst": max(v, key=abs), "n": len(v)}
            for k, v in groups.items() if v}


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def summary_lines(summary: dict[str, dict[str, float]], before: dict[str, dict[str, float]] | None = None) -> list[str]:
    head = "| strategy | plans | median abs error | worst error |" + (" before: median | before: worst |" if before else "")
    lines = [head, "|---|---:|---:|---:|" + ("---:|---:|" if before else "")]
    for name, s in summary.items():
        line = f"| {name} | {s['n']} | {s['median']:.1%} | {_pct(s['worst'])} |"
        if before:
            b = before.get(name)
            line += f" {b['median']:.1%} | {_pct(b['worst'])} |" if b else " - | - |"
        lines.append(line)
    return lines


def table_lines(table: list[dict], key: str) -> list[str]:
    lines = [f"| {key} | setting | strategy | measured MiB | predicted MiB | error | before: predicted MiB | "
             "before: error | predicted peak at |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for t in table:
        before = (f"{t['before_mib']:.2f} | {_pct(t['before_error'])}" if "before_mib" in t else "- | -")
        lines.append(f"| {t[key]} | {t['setting']} | {t['strategy']} | {t['measured_mib']:.2f} | "
                     f"{t['predicted_mib']:.2f} | {_pct(t['error'])} | {before} | {t['phase']} |")
    return lines


def in_sample_cases(plan_list: list[tuple[str, dict]]) -> list[dict]:
    """The in-sample table's plans (size, plan), for the memory measurement (one warm-up and one
    timed step before the tracked one: enough for DDP's bucket rebuild, which happens at step 2)."""
    def setting(plan: dict) -> str:
        ga = plan["global_batch"] // (plan["micro_batch"] * plan["num_workers"])
        return f"seq{plan['seq_len']} mb{plan['micro_batch']}x{ga}" + (
            " ckpt" if plan.get("activation_checkpointing") == "full" else "")

    return [{"size": size, "setting": setting(plan), "plan": {**plan, **MEMORY_BASE}} for size, plan in plan_list]


def predict_before(rows: list[dict], commit: str) -> dict[int, float]:
    """Row index -> predicted peak bytes by paratune/costs/estimate.py as it was at `commit` (loaded from
    git beside the current one): the figures before the memory terms of issue 26 item 8."""
    import importlib.util
    import subprocess

    from paratune.config.plan import load_plan_dict

    root = Path(__file__).parent.parent
    source = subprocess.run(["git", "show", f"{commit}:platform/paratune/costs/estimate.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("paratune._estimate_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        exec(compile(source, f"estimate.py@{commit}", "exec"), module.__dict__)  # noqa: S102 - the repository's own file
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    out = {}
    for i, r in enumerate(rows):
        if "error" not in r and r.get("peak_memory_bytes"):
            out[i] = float(module.estimate_memory(load_plan_dict(r["plan"])).total)
    return out


def with_before(table: list[dict], rows: list[dict], before: dict) -> list[dict]:
    """Each table row with the `before` prediction of its measured row (by index among the rows
    that measured)."""
    measured = [i for i, r in enumerate(rows) if "error" not in r and r.get("peak_memory_bytes")]
    out = []
    for t, i in zip(table, measured):
        b = before.get(str(i), before.get(i))
        out.append({**t, **({"before_mib": b / 2**20, "before_error": b / 2**20 / t["measured_mib"] - 1} if b else {})})
    return out


def before_summary(table: list[dict]) -> dict[str, dict[str, float]]:
    rows = [{"strategy": t["strategy"], "error": t["before_error"]} for t in table if "before_error" in t]
    return by_strategy(rows) if rows else {}
