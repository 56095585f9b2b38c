"""The prediction side of bench/estimate_accuracy.py: predicted vs measured, as a table and a plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from paratune.config.devices import get_device
from paratune.costs.estimate import estimate_memory, estimate_time, fit_time_constants
from paratune.config.plan import load_plan_dict
from paratune.out.tables import strategy_label

TARGET = 0.15  # the bar for peak memory


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def write_report(machine: dict, rows: list[dict], out_dir: Path, console: Console) -> None:
    device = get_device("cpu")
    ok = [r for r in rows if r["status"] == "ok" and r["peak_memory_bytes"] and r["step_time_median_s"]]
    table_rows = []
    for r in ok:
        plan = load_plan_dict(r["plan"])
        measured = max(r["peak_memory_bytes"])
        traced, formula = estimate_memory(plan), estimate_memory(plan, "formula")
        # Time: constants fitted on the other size's trials (out of sample).
        others = [(load_plan_dict(o["plan"]), o["step_time_median_s"]) for o in ok if o["size"] != r["size"]]
        constants = fit_time_constants(others, device)
        predicted_s = estimate_time(plan, device, constants).step_s
        table_rows.append({
            "size": r["size"], "plan": strategy_label(r["plan"]),
            "measured_mib": measured / 2**20, "predicted_mib": traced.total / 2**20,
            "memory_error": traced.total / measured - 1, "formula_mib": formula.total / 2**20,
            "formula_error": formula.total / measured - 1,
            "parts_mib": {k: v / 2**20 for k, v in traced.parts().items()},
            "measured_step_s": r["step_time_median_s"], "step_spread": r["step_time_spread"],
            "predicted_step_s": predicted_s, "time_error": predicted_s / r["step_time_median_s"] - 1,
        })
    worst = max(abs(t["memory_error"]) for t in table_rows)
    median_time = statistics.median(abs(t["time_error"]) for t in table_rows)

    lines = ["# Estimate accuracy: predicted vs measured (CPU, 2 gloo workers)", "",
             f"Machine: {machine['machine']}; torch {machine.get('torch')}; {machine.get('date')}.", "",
             "Measured: real Ray Train trials, peak tensor memory per rank by PyTorch's MemTracker over one "
             "step (the largest rank), median whole-step time over 5 measured steps. Predicted: "
             "`paratune.estimate` (activations traced on fake tensors; `formula` = DESIGN.md's activation "
             "formula instead). Step time: the roofline with its constants fitted on the trials of the "
             "*other* model size (out of sample).", "",
             f"**Worst peak-memory error (traced): {worst:.1%}** (bar: {TARGET:.0%}); median step-time error "
             f"{median_time:.0%}.", "",
             "| size | plan | measured MiB | predicted MiB | error | formula MiB | formula error | "
             "weights / grads / optim / activ. / buffers (predicted MiB) | measured step s | predicted step s | error |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for t in table_rows:
        p = t["parts_mib"]
        lines.append(f"| {t['size']} | {t['plan']} | {t['measured_mib']:.1f} | {t['predicted_mib']:.1f} | "
                     f"{_pct(t['memory_error'])} | {t['formula_mib']:.1f} | {_pct(t['formula_error'])} | "
                     f"{p['weights']:.1f} / {p['gradients']:.1f} / {p['optimizer']:.1f} / {p['activations']:.1f} / "
                     f"{p['comm_buffers']:.1f} | {t['measured_step_s']:.3f} | {t['predicted_step_s']:.3f} | "
                     f"{_pct(t['time_error'])} |")
    failed = [r for r in rows if r not in ok]
    if failed:
        lines += ["", "Trials that did not finish: " + "; ".join(
            f"{r['size']} {strategy_label(r['plan'])}: {r['reason']}" for r in failed)]
    (out_dir / "estimate_accuracy.md").write_text("\n".join(lines) + "\n")
    (out_dir / "estimate_accuracy.json").write_text(json.dumps({"machine": machine, "rows": rows,
                                                                 "predictions": table_rows}, indent=1))
    _plot(table_rows, out_dir / "estimate_accuracy.png")

    table = Table(title=f"predicted vs measured peak memory per rank (worst {worst:.1%})")
    for col in ("size", "plan", "measured MiB", "predicted MiB", "error", "step s", "predicted s"):
        table.add_column(col, justify="left" if col in ("size", "plan") else "right")
    for t in table_rows:
        table.add_row(t["size"], t["plan"], f"{t['measured_mib']:.1f}", f"{t['predicted_mib']:.1f}",
                      _pct(t["memory_error"]), f"{t['measured_step_s']:.3f}", f"{t['predicted_step_s']:.3f}")
    console.print(table)
    console.print(f"wrote {out_dir / 'estimate_accuracy.md'} and .png")


def _plot(rows: list[dict], path: Path, out_of_sample: list[dict] | None = None) -> None:
    """Predicted vs measured: peak memory (in sample, and the held-out families when given) and step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (m, p, unit, title) in zip(axes, [("measured_mib", "predicted_mib", "MiB", "peak memory per rank"),
                                             ("measured_step_s", "predicted_step_s", "s", "step time")]):
        xs, ys = [r[m] for r in rows], [r[p] for r in rows]
        ax.scatter(xs, ys, s=18, label="in sample" if unit == "MiB" else None)
        if unit == "MiB" and out_of_sample:
            ox, oy = [r["measured_mib"] for r in out_of_sample], [r["predicted_mib"] for r in out_of_sample]
            ax.scatter(ox, oy, s=14, marker="x", label="held-out families")
            xs, ys = xs + ox, ys + oy
        lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        if unit == "MiB":
            band = 0.05 if out_of_sample else TARGET
            ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                            alpha=0.15, label=f"±{band:.0%}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # labels on the decades only
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend()
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
