"""Human-facing output: trial results side by side."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from paratune.trial import TrialResult


def strategy_label(plan: dict) -> str:
    """A short name for what the plan does: 'ddp', 'fsdp:full', 'zero-3+offload', ..."""
    strategy = plan.get("strategy", "?")
    if strategy == "fsdp":
        label = f"fsdp:{plan['fsdp']['sharding']}" + ("+offload" if plan["fsdp"].get("cpu_offload") else "")
    elif strategy == "zero":
        z = plan["zero"]
        label = f"zero-{z['stage']}" + ("+offload" if z.get("offload_optimizer") or z.get("offload_param") else "")
    else:
        label = strategy
    extras = [f"mb{plan['micro_batch']}x{plan['grad_accum']}"]
    if plan.get("activation_checkpointing", "none") != "none":
        extras.append("ckpt")
    if plan.get("precision") == "bf16":
        extras.append("bf16")
    return f"{label} {' '.join(extras)}"


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def results_table(rows: list[tuple[str, TrialResult, float | None]], title: str = "paratune trials") -> Table:
    """rows: (name, result, max loss difference vs the single-process reference or None)."""
    table = Table(title=title)
    for col, justify in [("plan", "left"), ("strategy", "left"), ("status", "left"),
                         ("tokens/s/GPU", "right"), ("step ms (p10-p90)", "right"), ("spread", "right"),
                         ("MFU", "right"), ("peak MiB/rank", "right"), ("comm", "right"),
                         ("last loss", "right"), ("parity Δ", "right")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, r, diff in rows:
        peak = max(r.peak_memory_bytes) if r.peak_memory_bytes else None
        status = "ok" if r.ok else f"[red]{r.reason}[/red]"
        table.add_row(
            name, strategy_label(r.plan), status,
            _fmt(r.tokens_per_s_per_gpu, ",.0f"),
            "-" if r.step_time_median_s is None else
            f"{r.step_time_median_s * 1e3:.1f} ({r.step_time_p10_s * 1e3:.1f}-{r.step_time_p90_s * 1e3:.1f})",
            _fmt(r.step_time_spread, ".0%"), _fmt(r.mfu, ".1%"), _fmt(peak, ",.1f", 1 / 2**20),
            _fmt(r.comm_share, ".0%"), _fmt(r.losses[-1] if r.losses else None, ".4f"), _fmt(diff, ".1e"),
        )
    return table


def print_results(rows: list[tuple[str, TrialResult, float | None]], console: Console | None = None) -> None:
    console = console or Console()
    console.print(results_table(rows))
    for name, r, _ in rows:
        if not r.ok:
            console.print(f"[red]{name}[/red]: {r.reason}: {r.message}")
    methods = {r.memory_method for _, r, _ in rows if r.memory_method}
    if methods:
        console.print("peak memory measured by: " + "; ".join(sorted(methods)))
