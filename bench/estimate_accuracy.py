"""How good are paratune's estimates? Predicted vs measured peak memory per rank and step time.

    .venv/bin/python bench/estimate_accuracy.py                  # runs the trials (~10 min) and profiles, writes the tables
    .venv/bin/python bench/estimate_accuracy.py --reuse          # re-predicts from the committed measurements and profiles
    .venv/bin/python bench/estimate_accuracy.py --reuse --reprofile   # same trials, profiles measured again
    .venv/bin/python bench/estimate_accuracy.py --reuse --ledger /tmp/grid_dev/sweep/ledger.jsonl
                                                                 # + the step-time model on a measured sweep grid
    .venv/bin/python bench/estimate_accuracy.py --reuse --memory all --before 13ce249
                                                                 # peak memory measured again (~15 min): in sample
                                                                 # and on held-out families; predictions before too

Part 1, every data-parallel strategy with and without activation checkpointing at two model
sizes (real Ray Train trials on 2 CPU workers, gloo): peak memory is PyTorch's MemTracker over one
step (tensor storage), the definition paratune.costs.estimate predicts (unchanged: bench/estimate_report.py);
step time is predicted by paratune.costs.timemodel from a profile measured on the same workers
(paratune.costs.profile), (a) from the profile alone and (b) refitted on the trials of the *other*
model size only (out of sample).

Part 2 (--ledger): the grid of bench/search_efficiency_space.yaml, measured exhaustively by a
sweep (one ledger line per trial). Each plan's step time is predicted (a) from the profile alone
and (b) sequentially, as a sweep would: in a fixed order (predicted fastest first), each trial
predicted before it is observed, then the model refitted. Reported: median and worst |error|,
Kendall's tau between predicted and measured tokens/s/GPU, and whether the measured best is in the
predicted top 3.
Part 3 (--memory): peak memory per rank on gloo processes running the trial's worker code, with
the buffers DDP and DeepSpeed ZeRO-3 allocate before the step visible to the tracker
(bench/memory_accuracy.py, bench/memory_tracking.py): the part-1 plans (in sample) and tiny
configs of decoder families paratune's presets and tests do not use (bench/families/, out of
sample; the held-out ones were not looked at while the memory model was built). --before COMMIT
adds what estimate.py at that commit predicted for the same plans.
Writes bench/results/estimate_accuracy.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

from paratune.config.plan import load_plan_dict  # noqa: E402
from paratune.out.tables import env_label, strategy_label  # noqa: E402

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
TARGETS = {"median": 0.10, "worst": 0.25, "tau": 0.7}


def plans() -> list[tuple[str, dict]]:
    out = []
    for size, shape in SIZES.items():
        for strategy in STRATEGIES:
            for ckpt in ("none", "full"):
                out.append((size, {**BASE, **shape, **strategy, "activation_checkpointing": ckpt}))
    return out


def measure(console: Console) -> list[dict]:
    from paratune.cluster.trial import run_trial

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


# --------------------------------------------------------------------------- profiles
def measure_profiles(plan_list, console: Console) -> list[dict]:
    """One profile per (model, env) of the plans, on 2 real Ray Train workers (gloo)."""
    from paratune.cluster.launch import ensure_ray
    from paratune.costs.profile import profile_requests_for
    from paratune.cluster.profiling import run_profile

    ensure_ray()
    out = []
    for request in profile_requests_for(plan_list):
        with console.status(f"profiling {request.model} {request.model_overrides or ''} env {request.env}"):
            profile = run_profile(request)
        console.print(f"profile {request.model} {request.model_overrides or ''} env {request.env}: "
                      f"{profile.profile_s:.1f} s on the workers")
        out.append(profile.model_dump(mode="json"))
    return out


# --------------------------------------------------------------------------- the time model, judged
def kendall_tau(a: list[float], b: list[float]) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic) if len(a) > 1 else float("nan")


def judge(rows: list[dict], key: str) -> dict[str, float]:
    """Median/worst |error|, Kendall tau of tokens/s, measured best in the predicted top 3."""
    errors = [abs(r[key] / r["measured_step_s"] - 1) for r in rows]
    measured_tps = [r["tokens_per_step"] / r["measured_step_s"] for r in rows]
    predicted_tps = [r["tokens_per_step"] / r[key] for r in rows]
    best = max(range(len(rows)), key=lambda i: measured_tps[i])
    top3 = sorted(range(len(rows)), key=lambda i: -predicted_tps[i])[:3]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "kendall_tau": kendall_tau(predicted_tps, measured_tps), "best_in_top3": float(best in top3),
            "best_predicted_rank": float(sorted(range(len(rows)), key=lambda i: -predicted_tps[i]).index(best) + 1)}


def sequential(profiles, measured: list[tuple[object, float]]) -> dict[int, dict]:
    """Each plan predicted before it is observed, in the order of the profile's own prediction
    (fastest first: the order a sweep guided by the model would try them), then refitted."""
    from paratune.costs.timemodel import StepTimeModel

    alone = StepTimeModel(profiles)
    order = sorted(range(len(measured)), key=lambda i: alone.predict(measured[i][0]).step_s)
    model = StepTimeModel(profiles)
    out = {}
    for position, i in enumerate(order):
        plan, seconds = measured[i]
        band = model.error_band()
        got = model.observe(plan, seconds)
        out[i] = {"sequential_step_s": got["predicted_step_time_s"], "order": position, "band": band}
    out["final"] = model  # type: ignore[index]
    return out


def load_grid(ledger: Path) -> list[dict]:
    """The finished trials of a sweep ledger: plan, measured median step time, spread."""
    from paratune.sweep.ledger import Ledger

    return [{"plan": e.result.plan, "measured_step_s": float(e.result.step_time_median_s),
             "spread": e.result.step_time_spread}
            for e in Ledger(ledger).search_entries() if e.result.ok and e.result.step_time_median_s]


def grid_rows(grid: list[dict], profiles) -> tuple[list[dict], dict]:
    """Part 2: the measured grid against the model (alone, sequential, leave-one-out at the end)."""
    from paratune.costs.timemodel import StepTimeModel

    measured = [(load_plan_dict(g["plan"]), g["measured_step_s"]) for g in grid]
    alone = StepTimeModel(profiles)
    seq = sequential(profiles, measured)
    final = seq.pop("final")
    loo = final.loo_errors(limit=len(measured))
    order = [i for i, _ in sorted(seq.items(), key=lambda kv: kv[1]["order"])]
    loo_by_plan = {i: loo[k] for k, i in enumerate(order)}
    rows = []
    for i, (plan, seconds) in enumerate(measured):
        pred = alone.predict(plan)
        rows.append({"plan": plan.to_dict(), "label": strategy_label(plan.to_dict()),
                     "env": env_label(plan.env),
                     "tokens_per_step": plan.tokens_per_step, "measured_step_s": seconds,
                     "spread": grid[i]["spread"],
                     "alone_step_s": pred.step_s, "alone_parts": pred.parts,
                     "sequential_step_s": seq[i]["sequential_step_s"], "order": seq[i]["order"],
                     "band_before": seq[i]["band"],
                     "loo_step_s": seconds * (1 + loo_by_plan[i])})
    summary = {"alone": judge(rows, "alone_step_s"), "sequential": judge(rows, "sequential_step_s"),
               "leave_one_out": judge(rows, "loo_step_s"), "trials": len(rows),
               "sequential_after_10": judge([r for r in rows if r["order"] >= 10], "sequential_step_s")
               if len(rows) > 12 else {}, "final_band": final.error_band(),
               "coefficients": {k: v for k, v in final.summary().items() if k.startswith("time_model_coef")}}
    return rows, summary


# --------------------------------------------------------------------------- report
def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _memory_key(plan: dict) -> dict:
    """A plan without its step counts: the part-1 trial and its memory re-measurement match on it."""
    return {k: v for k, v in load_plan_dict(plan).to_dict().items() if k not in ("warmup_steps", "measure_steps")}


def memory_section(memory: dict) -> list[str]:
    """Part 3's tables: out of sample (held-out families), tuning families, in sample."""
    import memory_accuracy as ma

    before = memory.get("before", {})
    parts = {}
    for name in ("families", "in_sample"):
        table = ma.predict(memory.get(name, []))
        parts[name] = ma.with_before(table, memory.get(name, []), before.get(name, {}))
    held = [t for t in parts["families"] if t["family"] in ma.HELD_OUT]
    tuning = [t for t in parts["families"] if t["family"] in ma.TUNING]
    failed = [r for name in ("families", "in_sample") for r in memory.get(name, []) if "error" in r]
    commit = before.get("commit", "-")
    overall = ma.by_strategy(held).get("all") if held else None
    lines = ["## Peak memory per rank, out of sample and in sample (part 3)", "",
             f"Machine: {memory['machine']['machine']}; torch {memory['machine'].get('torch')}, DeepSpeed "
             f"{memory['machine'].get('deepspeed')}, transformers {memory['machine'].get('transformers')}; measured "
             f"{memory['machine'].get('date')}. Command: `{memory.get('command', '')}`.", "",
             "Measured: the trial's worker code (`paratune.trial.worker.train_and_measure`) on 2 gloo processes "
             "(tests/gloo_harness.py, no Ray), fp32, one warm-up and one timed step, then PyTorch's MemTracker over "
             "one more step (tensor storage, the larger rank), with the buffers DDP (its gradient buckets) and "
             "DeepSpeed ZeRO-3 (its reduce bucket) allocate before the step handed to the tracker "
             "(bench/memory_tracking.py; the trial's own tracker met them only when the backward first touched "
             "them). Predicted: `paratune.costs.estimate.estimate_memory(plan, device=cpu)`; *before*: the same call on "
             f"estimate.py at {commit}. Error = predicted / measured - 1. Families: tiny configs in bench/families/ "
             "(hidden 128, 4 layers, vocab 4096; 4-8 experts for the MoE ones), each in three settings on 2 ranks: "
             + "; ".join(f"`{name}`" for name in ma.SETTINGS) + " (ZeRO buckets 2M elements, 0.5M in the last: "
             "smaller than the models, so buckets fill and are reduced during the backward). "
             f"Held out ({', '.join(ma.HELD_OUT)}) were measured only after the memory model was done; tuning "
             f"({', '.join(ma.TUNING)}) and the in-sample presets were looked at while building it.", ""]
    lines += [f"Note: {note}" for note in memory.get("notes", [])] + ([""] if memory.get("notes") else [])
    if overall:
        lines += [f"**Out of sample (held-out families): median |error| {overall['median']:.1%}, worst "
                  f"{_pct(overall['worst'])}** over {overall['n']} plans (bar: {ma.TARGET:.0%}, median and worst).", ""]
    for title, table in (("Held-out families (out of sample)", held), ("Tuning families", tuning),
                         ("In sample (the part-1 plans, small-llama presets)", parts["in_sample"])):
        if table:
            lines += [f"### {title}", "", *ma.summary_lines(ma.by_strategy(table), ma.before_summary(table) or None), ""]
    if held:
        lines += ["### Held-out families, per plan", "", *ma.table_lines(held, "family"), ""]
    if tuning:
        lines += ["### Tuning families, per plan", "", *ma.table_lines(tuning, "family"), ""]
    if parts["in_sample"]:
        lines += ["### In sample, per plan", "", *ma.table_lines(parts["in_sample"], "size"), ""]
    if failed:
        lines += ["Plans that failed: " + "; ".join(f"{r.get('family', r.get('size'))} {r.get('setting')} "
                                                   f"{r['plan'].get('strategy')}: {r['error'][-200:]}" for r in failed), ""]
    return lines


def measure_memory_part(saved: dict, which: str, before: str | None, command: str, console: Console,
                        raw_path: Path) -> dict:
    """Part 3: measure what `which` asks for (in-sample, families, all), keep the rest of the saved
    part; the measurements are written to `raw_path` as soon as they exist."""
    import memory_accuracy as ma

    memory = dict(saved.get("memory") or {})

    def keep() -> None:
        raw_path.write_text(json.dumps({**saved, "memory": memory}, indent=1, default=str))

    if which in ("in-sample", "all"):
        cases = ma.in_sample_cases(plans())
        rows = ma.measure_memory(cases, console)
        for r in rows:
            r["plan_key"] = _memory_key(r["plan"])
        memory["in_sample"] = rows
        memory.update(machine=describe(), command=command)
        keep()
    if which in ("families", "all"):
        memory["families"] = ma.measure_memory(ma.family_plans(ma.TUNING + ma.HELD_OUT, STRATEGIES), console)
        memory.update(machine=describe(), command=command)
        keep()
    if before:
        memory["before"] = {"commit": before, **{name: ma.predict_before(memory.get(name, []), before)
                                                 for name in ("in_sample", "families")}}
    return memory


def time_predictions(rows: list[dict], profiles) -> list[dict]:
    """Part 1 step times: from the profile alone, and refitted on the other size's trials only."""
    from paratune.costs.timemodel import StepTimeModel

    ok = [r for r in rows if r["status"] == "ok" and r["step_time_median_s"]]
    alone = StepTimeModel(profiles)
    out = []
    for r in ok:
        plan = load_plan_dict(r["plan"])
        model = StepTimeModel(profiles)
        for o in ok:
            if o["size"] != r["size"]:
                model.observe(load_plan_dict(o["plan"]), o["step_time_median_s"])
        out.append({"alone_step_s": alone.predict(plan).step_s, "refit_step_s": model.predict(plan).step_s})
    return out


def write(machine: dict, rows: list[dict], profiles_json: list[dict], grid_saved: dict | None,
          console: Console, conditions: str | None = None, memory: dict | None = None) -> None:
    from estimate_report import TARGET, _plot  # noqa: E402  (the memory side, unchanged)

    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate_memory
    from paratune.costs.profile import Profile

    profiles = [Profile.model_validate(p) for p in profiles_json]
    grid, grid_source = None, None
    if grid_saved is not None:
        grid = grid_rows(grid_saved["measured"], [Profile.model_validate(p) for p in grid_saved["profiles"]])
        grid_source = grid_saved["source"]
    ok = [r for r in rows if r["status"] == "ok" and r["peak_memory_bytes"] and r["step_time_median_s"]]
    times = time_predictions(ok, profiles)
    # Memory measured again with every buffer visible to the tracker (part 3), where it was.
    remeasured = {json.dumps(m["plan_key"], sort_keys=True): max(m["peak_memory_bytes"])
                  for m in (memory or {}).get("in_sample", []) if m.get("peak_memory_bytes")}
    cpu = get_device("cpu")
    table_rows = []
    for r, t in zip(ok, times):
        plan = load_plan_dict(r["plan"])
        measured = remeasured.get(json.dumps(_memory_key(r["plan"]), sort_keys=True), max(r["peak_memory_bytes"]))
        traced, formula = estimate_memory(plan, device=cpu), estimate_memory(plan, "formula", device=cpu)
        table_rows.append({
            "size": r["size"], "plan": strategy_label(r["plan"]),
            "trial_mib": max(r["peak_memory_bytes"]) / 2**20,
            "measured_mib": measured / 2**20, "predicted_mib": traced.total / 2**20,
            "memory_error": traced.total / measured - 1, "formula_mib": formula.total / 2**20,
            "formula_error": formula.total / measured - 1,
            "parts_mib": {k: v / 2**20 for k, v in traced.parts().items()},
            "measured_step_s": r["step_time_median_s"], "step_spread": r["step_time_spread"],
            "alone_step_s": t["alone_step_s"], "alone_error": t["alone_step_s"] / r["step_time_median_s"] - 1,
            "predicted_step_s": t["refit_step_s"], "time_error": t["refit_step_s"] / r["step_time_median_s"] - 1,
        })
    worst = max(abs(t["memory_error"]) for t in table_rows)
    median_alone = statistics.median(abs(t["alone_error"]) for t in table_rows)
    median_refit = statistics.median(abs(t["time_error"]) for t in table_rows)
    worst_refit = max(abs(t["time_error"]) for t in table_rows)
    p0 = profiles[0]
    lines = ["# Estimate accuracy: predicted vs measured (CPU, 2 gloo workers)", "",
             f"Machine: {machine['machine']}; torch {machine.get('torch')}; trials {machine.get('date')}; "
             f"profiles {p0.created_at}.", "",
             *([f"Conditions: {conditions}", ""] if conditions else []),
             "Step time is predicted by `paratune.costs.timemodel` from a profile measured on the same 2 Ray Train "
             "workers (`paratune profile`: one decoder layer, the embedding and the LM head + loss at each "
             "(micro-batch, seq, tp, checkpointing), collective curves on the real gloo group, the AdamW step "
             "vs parameters), composed per strategy; *refit* = refitted (regularised NNLS) on the trials of "
             "the *other* model size only, so every figure is out of sample.", ""]
    if grid is not None:
        g_rows, s = grid
        a, q, loo = s["alone"], s["sequential"], s["leave_one_out"]
        lines += [f"## Step time on the search-efficiency grid ({s['trials']} measured plans)", "",
                  f"Measured: `{grid_source}` (bench/search_efficiency_space.yaml, every plan one Ray Train trial "
                  "on 2 CPU workers; median of 4 steps after 2 warm-up). Predicted (a) from the profile alone "
                  "(one per env), (b) sequentially: plans taken in the profile's predicted order (fastest "
                  "first), each predicted *before* it is observed, then the model refitted; (c) leave-one-out "
                  "with every other trial (the model at the end of a sweep). Targets: median |error| <= 10%, "
                  "worst <= 25%, Kendall tau >= 0.7, measured best in the predicted top 3.", "",
                  "| prediction | median abs error | worst abs error | Kendall tau (tokens/s) | measured best: predicted rank |",
                  "|---|---:|---:|---:|---:|"]
        for name, j in (("(a) profile alone", a), ("(b) sequential refit", q), ("(c) leave-one-out", loo)):
            lines.append(f"| {name} | {j['median_abs_error']:.1%} | {j['worst_abs_error']:.1%} | "
                         f"{j['kendall_tau']:.2f} | {j['best_predicted_rank']:.0f} |")
        if s.get("sequential_after_10"):
            j = s["sequential_after_10"]
            lines.append(f"| (b) after the first 10 trials | {j['median_abs_error']:.1%} | {j['worst_abs_error']:.1%} "
                         f"| {j['kendall_tau']:.2f} | - |")
        lines += ["", f"Error band at the end (80th percentile of leave-one-out errors): {s['final_band']:.1%}.", "",
                  "| # | plan | env | measured s | spread | alone s | error | sequential s | error | order | LOO error |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, r in enumerate(sorted(g_rows, key=lambda r: r["measured_step_s"]), 1):
            lines.append(f"| {i} | {r['label']} | {r['env']} | {r['measured_step_s']:.3f} | {r['spread'] or 0:.2f} | "
                         f"{r['alone_step_s']:.3f} | {_pct(r['alone_step_s'] / r['measured_step_s'] - 1)} | "
                         f"{r['sequential_step_s']:.3f} | {_pct(r['sequential_step_s'] / r['measured_step_s'] - 1)} | "
                         f"{r['order']} | {_pct(r['loo_step_s'] / r['measured_step_s'] - 1)} |")
        coef = ", ".join(f"{k.split(':', 1)[1]} {v:.2f}" for k, v in s["coefficients"].items())
        lines += ["", f"Coefficients after all trials (multipliers of the profile's terms; overheads in 10 ms "
                  f"per micro-batch, or per step): {coef}.", ""]
    if memory:
        lines += memory_section(memory)
    lines += ["## Memory and step time per strategy, two model sizes", "",
              "Measured: real Ray Train trials, median whole-step time over 5 measured steps; peak tensor memory "
              "per rank (the largest rank) by PyTorch's MemTracker over one extra step: *measured MiB* as part 3 "
              "measured it, with the buffers DDP and DeepSpeed ZeRO-3 allocate before the step visible to the "
              "tracker, *trial MiB* as these trials reported it (the tracker met DDP's buckets only when the "
              "backward first touched them). Predicted: `paratune.costs.estimate` for a CPU device (activations traced "
              "on fake tensors; `formula` = DESIGN.md's activation formula instead).", "",
              f"**Worst peak-memory error (traced): {worst:.1%}** (bar: {TARGET:.0%}); step time: median error "
              f"{median_alone:.0%} from the profile alone, {median_refit:.0%} refitted on the other size "
              f"(worst {worst_refit:.0%}).", "",
              "| size | plan | trial MiB | measured MiB | predicted MiB | error | formula MiB | formula error | "
              "weights / grads / optim / activ. / buffers (predicted MiB) | measured step s | profile alone s | error "
              "| refit s | error |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for t in table_rows:
        p = t["parts_mib"]
        lines.append(f"| {t['size']} | {t['plan']} | {t['trial_mib']:.1f} | {t['measured_mib']:.1f} | "
                     f"{t['predicted_mib']:.1f} | "
                     f"{_pct(t['memory_error'])} | {t['formula_mib']:.1f} | {_pct(t['formula_error'])} | "
                     f"{p['weights']:.1f} / {p['gradients']:.1f} / {p['optimizer']:.1f} / {p['activations']:.1f} / "
                     f"{p['comm_buffers']:.1f} | {t['measured_step_s']:.3f} | {t['alone_step_s']:.3f} | "
                     f"{_pct(t['alone_error'])} | {t['predicted_step_s']:.3f} | {_pct(t['time_error'])} |")
    failed = [r for r in rows if r not in ok]
    if failed:
        lines += ["", "Trials that did not finish: " + "; ".join(
            f"{r['size']} {strategy_label(r['plan'])}: {r['reason']}" for r in failed)]
    (RESULTS / "estimate_accuracy.md").write_text("\n".join(lines) + "\n")
    saved = {"machine": machine, "rows": rows, "predictions": table_rows, "profiles": profiles_json,
             "conditions": conditions}
    if memory:
        saved["memory"] = memory
    if grid is not None:
        saved["grid"] = {**grid_saved, "summary": grid[1], "rows": grid[0]}
    (RESULTS / "estimate_accuracy.json").write_text(json.dumps(saved, indent=1, default=str))
    held_out = None
    if memory and memory.get("families"):
        import memory_accuracy as ma

        held_out = [t for t in ma.predict(memory["families"]) if t["family"] in ma.HELD_OUT]
    _plot(table_rows, RESULTS / "estimate_accuracy.png", held_out)
    console.print(f"memory worst {worst:.1%}; step time median {median_alone:.1%} (profile alone), "
                  f"{median_refit:.1%} (refit on the other size)")
    if grid is not None:
        for name in ("alone", "sequential", "leave_one_out"):
            j = grid[1][name]
            console.print(f"grid {name}: median {j['median_abs_error']:.1%}, worst {j['worst_abs_error']:.1%}, "
                          f"tau {j['kendall_tau']:.2f}, best at predicted rank {j['best_predicted_rank']:.0f}")
    console.print(f"wrote {RESULTS / 'estimate_accuracy.md'} and .png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="re-predict from the committed measurements")
    parser.add_argument("--reprofile", action="store_true", help="measure the profiles again (with --reuse)")
    parser.add_argument("--ledger", help="a sweep ledger of the search-efficiency grid (part 2)")
    parser.add_argument("--grid-profiles", help="profiles for the grid (paratune profile --out); default: measure")
    parser.add_argument("--conditions", help="what the host was doing while this was measured (kept in the report)")
    parser.add_argument("--memory", choices=("none", "in-sample", "families", "all"), default="none",
                        help="part 3: measure peak memory again on gloo processes (default: the committed figures)")
    parser.add_argument("--before", metavar="COMMIT", help="part 3: also predict with estimate.py at COMMIT")
    args = parser.parse_args()
    console = Console(width=160)
    RESULTS.mkdir(exist_ok=True)
    raw_path = RESULTS / "estimate_accuracy.json"
    saved = json.loads(raw_path.read_text()) if raw_path.is_file() else {}
    if args.reuse:
        machine, rows = saved["machine"], saved["rows"]
    else:
        machine, rows = describe(), measure(console)
    profiles_json = saved.get("profiles") if args.reuse and not args.reprofile else None
    if not profiles_json:
        profiles_json = measure_profiles([load_plan_dict(r["plan"]) for r in rows], console)
    grid_saved = None
    if args.ledger:
        from paratune.costs.profile import load_profiles

        measured = load_grid(Path(args.ledger))
        if args.grid_profiles:
            grid_profiles = [p.model_dump(mode="json") for p in load_profiles(args.grid_profiles)]
        else:
            grid_profiles = measure_profiles([load_plan_dict(g["plan"]) for g in measured], console)
        grid_saved = {"source": args.ledger, "measured": measured, "profiles": grid_profiles}
    elif saved.get("grid"):  # the committed grid, re-predicted from its stored measurements and profiles
        grid_saved = {k: saved["grid"][k] for k in ("source", "measured", "profiles")}
    memory = saved.get("memory")
    if args.memory != "none" or args.before:
        command = "bench/estimate_accuracy.py " + " ".join(sys.argv[1:])
        memory = measure_memory_part(saved, args.memory, args.before, command, console, raw_path)
    write(machine, rows, profiles_json, grid_saved, console, args.conditions or saved.get("conditions"), memory)


if __name__ == "__main__":
    main()
