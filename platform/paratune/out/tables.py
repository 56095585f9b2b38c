"""The console tables: trial results, the sweep's leaderboard and the plan estimates, as rich prints.

Also the labels every table, log line and page names a plan by (strategy_label, env_label).
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from paratune.levers import lever_labels
from paratune.trial.results import TrialResult


def env_label(env: dict[str, str] | None, keys: set[str] | None = None) -> str:
    """A plan's env as it reads in tables and logs: 'K=V K=V', sorted; '' for none. `keys`: only
    those (the settings that differ between a sweep's plans; `varying_env`)."""
    return " ".join(f"{k}={v}" for k, v in sorted((env or {}).items()) if keys is None or k in keys)


def varying_env(envs) -> set[str]:
    """The env settings whose values differ between plans (a setting every plan shares is said once,
    not on every label)."""
    envs = [dict(e or {}) for e in envs]
    keys = {k for e in envs for k in e}
    return {k for k in keys if len({e.get(k) for e in envs}) > 1}


def shared_env(envs) -> dict[str, str]:
    """The env settings every plan has, with one value."""
    envs = [dict(e or {}) for e in envs]
    return {k: v for k, v in (envs[0] if envs else {}).items() if all(e.get(k) == v for e in envs)}


# Where the core's parts of a plan's label sit; each lever's part sits at its own label_rank between them
# (paratune.levers: checkpointing 70, float8 90, compile 100, loss 110, async_tp 120).
LABEL_RANKS = {"batch": 10, "tp": 20, "pp": 30, "cp": 40, "dp": 50, "ep": 60, "precision": 80, "loader": 130}


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
        if plan.get("ddp", {}).get("bucket_cap_mb", 25) != 25:
            label += f" bucket{plan['ddp']['bucket_cap_mb']:g}MB"
    if strategy == "zero" and plan["zero"].get("reduce_bucket_size", 500_000_000) != 500_000_000:
        size = plan["zero"]["reduce_bucket_size"]
        label += f" bucket{size / 1e6:g}M" if size >= 1e6 else f" bucket{size / 1e3:g}K"
    # (rank, part): the core's parts at their LABEL_RANKS, every lever's at its own (paratune.levers)
    parts = [(LABEL_RANKS["batch"], f"mb{plan['micro_batch']}x{plan['grad_accum']}")]
    if plan.get("tp", 1) > 1:
        parts.append((LABEL_RANKS["tp"], f"tp{plan['tp']}" + ("+sp" if plan.get("sequence_parallel") else "")))
    if plan.get("pp", 1) > 1:
        parts.append((LABEL_RANKS["pp"], f"pp{plan['pp']}:{plan.get('pp_schedule', '1f1b')}"))
    if plan.get("cp", 1) > 1:
        parts.append((LABEL_RANKS["cp"], f"cp{plan['cp']}"))
    model_parallel = plan.get("tp", 1) * plan.get("pp", 1) * plan.get("cp", 1)
    if model_parallel > 1:  # the rest of the world is data parallel
        parts.append((LABEL_RANKS["dp"], f"dp{plan['num_workers'] // model_parallel}"))
    if plan.get("ep", 1) > 1:  # experts split over ep of the dp ranks
        parts.append((LABEL_RANKS["ep"], f"ep{plan['ep']}"))
    if plan.get("precision") == "bf16":
        parts.append((LABEL_RANKS["precision"], "bf16"))
    data = plan.get("data") or {}
    if data.get("loader_workers"):  # DataLoader worker processes x steps each keeps ready
        parts.append((LABEL_RANKS["loader"], f"loader{data['loader_workers']}x{data.get('prefetch', 2)}"))
    extras = [part for _, part in sorted(parts + lever_labels(plan), key=lambda rank_part: rank_part[0])]
    return f"{label} {' '.join(_float8_partial(plan, part) for part in extras)}"


def _float8_partial(plan: dict, part: str) -> str:
    """The float8 lever's label part with '(partial NN%)' where the plan's float8 converts under
    half of its linear FLOPs (the LM head aside; at tp 2 small-llama's MLP is 344 wide a rank and
    stays bf16): such a plan measures mostly bf16 under a float8 name
    (paratune.parallel.float8.label_share)."""
    if not part.startswith("fp8:"):
        return part
    from paratune.parallel.float8 import PARTIAL_SHARE, label_share  # torch, only for a float8 plan's label

    share = label_share(plan)
    return part + (f"(partial {int(share * 100)}%)" if share is not None and share < PARTIAL_SHARE else "")


def strategy_options(plan: dict) -> str:
    """The strategy's options that differ from their defaults (what the label leaves out)."""
    from paratune.config.plan import DDPOptions, FSDPOptions, ZeroOptions

    strategy = plan.get("strategy", "ddp")
    defaults = {"ddp": DDPOptions, "fsdp": FSDPOptions, "zero": ZeroOptions}[strategy]().model_dump()
    shown = {"sharding", "stage", "cpu_offload", "offload_optimizer", "offload_param", "reduce_bucket_size",
             "bucket_cap_mb"}  # already in the label
    parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
             for k, v in (plan.get(strategy) or {}).items() if k not in shown and defaults.get(k) != v]
    return " ".join(parts)


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _label(plan: dict) -> str:
    """strategy_label, or what can be said of a plan that never validated."""
    try:
        return strategy_label(plan)
    except (KeyError, TypeError, AttributeError):
        return str(plan.get("strategy", "-")) if isinstance(plan, dict) else "-"


def results_table(rows: list[tuple[str, TrialResult, float | None]], title: str = "paratune trials") -> Table:
    """rows: (name, result, max loss difference vs the single-process reference or None)."""
    table = Table(title=title)
    moe = any(r.routing_balance is not None for _, r, _ in rows)  # MoE trials: routing and all-to-all columns
    for col, justify in [("plan", "left"), ("strategy", "left"), ("status", "left"),
                         ("tokens/s/GPU", "right"), ("step ms (p10-p90)", "right"), ("spread", "right"),
                         ("MFU", "right"), ("peak MiB/rank", "right"), ("comm", "right"), ("data wait", "right"),
                         *([("a2a", "right"), ("routing max/mean", "right")] if moe else []),
                         ("last loss", "right"), ("parity Δ", "right")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, r, diff in rows:
        peak = max(r.peak_memory_bytes) if r.peak_memory_bytes else None
        status = "ok" if r.ok else f"[red]{r.reason}[/red]"
        table.add_row(
            name, _label(r.plan), status,
            _fmt(r.tokens_per_s_per_gpu, ",.0f"),
            "-" if r.step_time_median_s is None else
            f"{r.step_time_median_s * 1e3:.1f} ({r.step_time_p10_s * 1e3:.1f}-{r.step_time_p90_s * 1e3:.1f})",
            _fmt(r.step_time_spread, ".0%"), _fmt(r.mfu, ".1%"), _fmt(peak, ",.1f", 1 / 2**20),
            _fmt(r.comm_share, ".0%"), _fmt(r.data_wait_share, ".1%"),
            *([_fmt(r.all_to_all_share, ".0%"), _fmt(r.routing_balance, ".2f")] if moe else []),
            _fmt(r.losses[-1] if r.losses else None, ".4f"), _fmt(diff, ".1e"),
        )
    return table


def print_results(rows: list[tuple[str, TrialResult, float | None]], console: Console | None = None) -> None:
    console = console or Console()
    console.print(results_table(rows))
    for name, r, _ in rows:
        if not r.ok:
            console.print(f"[red]{name}[/red]: {r.reason}: {escape(r.message or '')}")
    methods = {r.memory_method for _, r, _ in rows if r.memory_method}
    if methods:
        console.print("peak memory measured by: " + "; ".join(sorted(methods)))


def print_sweep(outcome, console: Console | None = None) -> None:
    """A finished sweep (paratune.sweep.finish.SweepOutcome): the leaderboard (best first, ties
    marked, failures with reasons), time split, winner files."""
    console = console or Console()
    verdict = outcome.verdict
    table = Table(title="leaderboard (median of all measurements; ties are within the noise)")
    for col in ("#", "plan", "tokens/s/GPU", "± spread", "runs", "MFU", "peak MiB/rank", "verdict"):
        table.add_column(col, justify="right" if col not in ("plan", "verdict") else "left")
    tied = {s.key for s in verdict.tied_with_best} if verdict else set()
    for i, s in enumerate(verdict.ranked if verdict else [], 1):
        r = s.results[0]
        peak = max(r.peak_memory_bytes) / 2**20 if r.peak_memory_bytes else None
        mark = "[bold green]winner[/bold green]" if verdict.winner is s else ("tie with best" if s.key in tied else "")
        table.add_row(str(i), s.label, f"{s.median:,.0f}", f"{s.relative_spread / 2:.0%}", str(len(s.values)),
                      _fmt(r.mfu, ".1%"), _fmt(peak, ",.1f"), mark)
    console.print(table)
    failed = [e for e in outcome.entries if not e.result.ok and not e.result.stopped_early]
    stopped = [e for e in outcome.entries if e.result.stopped_early]
    if stopped:
        console.print(f"{len(stopped)} trial(s) stopped early (their first measured steps could not reach the "
                      "incumbent): " + ", ".join(strategy_label(e.result.plan) for e in stopped))
    if getattr(outcome, "stop_reason", ""):
        console.print(f"search stopped: {escape(outcome.stop_reason)}")
    if failed:
        console.print(f"[red]{len(failed)} failed trial(s):[/red]")
        for e in failed:
            console.print(f"  - {strategy_label(e.result.plan)}: {e.result.reason}: {escape(e.result.message or '')}")
    c = getattr(outcome, "calibration", None)
    if c:
        console.print(cost_model_line(c, [e.result for e in outcome.entries]))
    m = getattr(outcome, "time_model", None)
    if m and m.get("trials"):
        console.print(f"step-time model ({m['source']}), each trial predicted before it ran: median |error| "
                      f"{m['median_abs_error']:.1%}, worst {m['worst_abs_error']:.1%} over {m['trials']} trial(s); "
                      f"error band now {m['error_band']:.0%}")
    t = outcome.time_split
    if t.get("trials_wall_s"):
        console.print(f"time: {t['trials_wall_s']:.0f} s in trials = {t['launch_s']:.0f} s launching "
                      f"({t['launch_s'] / t['trials_wall_s']:.0%}) + "
                      + (f"{t['compile_s']:.0f} s compiling blocks + " if t.get("compile_s") else "")
                      + f"{t['measured_s']:.0f} s measured steps "
                      f"({t['measured_s'] / t['trials_wall_s']:.0%}) + {t['other_s']:.0f} s other "
                      "(warm-up, profiled/memory steps, teardown)"
                      + (f"; {t['profile_s']:.0f} s profiling the cluster" if t.get("profile_s") else ""))
    if verdict and verdict.winner is not None:
        console.print(f"winner: [bold]{verdict.winner.label}[/bold] — {verdict.winner.median:,.0f} tokens/s/GPU, "
                      f"loss parity vs single process: max |Δ| = {outcome.winner_parity:.1e}")
        if outcome.winner_dir:
            from paratune.out.export import on_a_cluster

            console.print(f"exported to {outcome.winner_dir}/ (plan.yaml, train.sh, job.sh, env.sh, ...)")
            script = "job.sh" if on_a_cluster() else "train.sh"  # the command that fits where the sweep ran
            console.print("train with it:  " + escape((outcome.winner_dir / script).read_text().splitlines()[-1]),
                          soft_wrap=True)
    else:
        console.print("[red]no winner: no plan finished and passed the loss-parity check[/red]")


def measured_compute(results: list[TrialResult], device_name: str) -> tuple[float, float, float, str] | None:
    """(fraction of peak, achieved TFLOP/s, peak TFLOP/s, precision) of the fastest finished trial:
    its model FLOPs per token x tokens/s per worker over the device table's dense peak at its
    precision (MFU against the table). None without such a trial or a table peak. Measured, so
    it is at most 100% wherever the table's peak is the device's."""
    from paratune.config.devices import get_device

    done = [r for r in results if r.ok and r.tokens_per_s_per_gpu and r.flops_per_token]
    if not done:
        return None
    best = max(done, key=lambda r: r.tokens_per_s_per_gpu or 0.0)
    precision = str((best.plan or {}).get("precision", "fp32"))
    try:
        peak = get_device(device_name).tflops.get(precision)
    except ValueError:  # not in the shipped table
        return None
    if not peak:
        return None
    achieved = best.flops_per_token * best.tokens_per_s_per_gpu / 1e12
    return achieved / peak, achieved, float(peak), precision


def cost_model_line(calibration: dict, results: list[TrialResult]) -> str:
    """The sweep's cost-model line: prediction errors, and the compute the trials reached against
    the device's peak, measured (model FLOP/s).

    Not the roofline refit's `compute_efficiency` (estimate.fit_time_constants: 1 / the fitted
    coefficient of ideal compute time): in a sweep every plan computes the same FLOPs (the model
    and global batch are fixed), so that column is collinear with the fitted per-step cost and the
    fit splits the step between them at will; the demo printed "9465% of peak" from it. It stays a
    metric in MLflow (calibration_compute_efficiency), not a figure a user should read."""
    device = calibration.get("device", "?")
    mem = calibration.get("memory_prediction_error_median_abs")
    step = calibration.get("step_time_prediction_error_median_abs")
    line = (f"cost model on {device}: median |error| of predicted peak memory {_fmt(mem, '.0%')}, of predicted "
            f"step time {_fmt(step, '.0%')} (time model refitted after each trial)")
    measured = measured_compute(results, device)
    if measured is None:
        return line
    fraction, achieved, peak, precision = measured
    per = "per worker" if device == "cpu" else "per GPU"
    line += (f"; the fastest trial computed at {fraction:.0%} of the {device} entry's {precision} peak "
             f"({achieved:.3g} of {peak:g} TFLOP/s {per}, model FLOPs)")
    if fraction > 1:
        line += f": above it, so the table's {device} figure (presets/devices.json) is below this machine's peak"
    return line


def print_estimates(estimates, device, console: Console, top: int = 20, title: str = "",
                    time_source: str = "roofline with default constants (a sweep refits them on its measured trials)") -> None:
    """`paratune plan`: the plans worth a trial (they fit, or are `tight`: within the memory
    band of the capacity) in launch order (predicted tokens/s/GPU x the chance it fits:
    paratune.costs.risk), each with its expected error band; then why the others
    are not."""
    from collections import Counter

    fitting = [e for e in estimates if e.measurable]
    big = max((e.memory.total for e in estimates), default=0) > 2 * 2**30
    gib, unit = (2**30, "GiB") if big else (2**20, "MiB")
    table = Table(title=title or f"predicted on {device.name} ({device.memory_gib:g} GiB), in launch order")
    for col in ("#", "plan", "options", "weights", "grads", "optim", "activ.", "buffers", f"peak {unit}", "memory",
                "comm GB/step", "step s", "tokens/s/GPU"):
        table.add_column(col, justify="left" if col in ("plan", "options", "memory") else "right")
    for i, e in enumerate(fitting[:top], 1):
        m = e.memory
        verdict = (f"tight +-{e.band.memory:.0%}" if e.tight else "fits") if e.band else ("fits" if e.fits else "over")
        tokens = e.band.tokens_text(e.time.tokens_per_s_per_gpu) if e.band else f"{e.time.tokens_per_s_per_gpu:,.0f}"
        table.add_row(str(i), strategy_label(e.plan.to_dict()), strategy_options(e.plan.to_dict()),
                      *(f"{v / gib:.1f}" for v in m.parts().values()),
                      f"{m.total / gib:.1f}", verdict, f"{e.comm.total / 1e9:.1f}", f"{e.time.step_s:.2f}", tokens)
    console.print(table)
    if len(fitting) > top:
        console.print(f"... and {len(fitting) - top} more worth a trial (--top N to see them, --json for all)")
    if any(e.tight for e in fitting):
        console.print("tight: the predicted peak is within its band of the capacity (either side); a sweep measures "
                      "it, and an out-of-memory trial is data")
    if fitting and fitting[0].band:
        b = fitting[0].band
        console.print(f"bands (paratune.costs.bands.prediction_band, each holding 80% of the runs it was judged on): "
                      f"tokens/s/GPU +-{b.tokens:.0%} from {b.tokens_basis}; memory +-{b.memory:.0%} from {b.memory_basis}")
    rejected = [e for e in estimates if not e.measurable]
    if rejected:
        console.print(f"[red]{len(rejected)} plan(s) predicted not to fit[/red] (capacity "
                      f"{rejected[0].capacity_bytes / 2**30:.1f} GiB per GPU, beyond the memory band):")
        by_strategy: Counter = Counter(strategy_label(e.plan.to_dict()).split()[0] for e in rejected)
        shown = set()
        for e in rejected:
            label = strategy_label(e.plan.to_dict()).split()[0]
            if label in shown:
                continue
            shown.add(label)
            console.print(f"  - {label} ({by_strategy[label]} plan(s)), e.g. {strategy_label(e.plan.to_dict())}: "
                          f"{escape(e.overflow or '')}")
    console.print(f"memory: {estimates[0].memory.method if estimates else '-'}; time: {time_source}")


def print_profiles(profiles, console: Console) -> None:
    """`paratune profile`: each stored profile's blocks, collectives and optimizer step."""
    import json

    table = Table(title="profiles: block fwd+bwd (ms, smallest..largest shape), collectives, optimizer")
    for col in ("env", "device", "blocks", "block ms", "head ms", "all_reduce GB/s", "latency us", "optimizer ns/param",
                "measured s"):
        table.add_column(col, justify="left" if col in ("env", "device") else "right")
    for p in profiles:
        blocks = sorted(p.blocks, key=lambda b: b.block_s)
        ar = [c for c in p.collectives if c.op == "all_reduce"]
        bw = ", ".join(f"{c.bandwidth_gbps:.2f}" for c in ar) or "-"
        lat = ", ".join(f"{c.latency_s * 1e6:.0f}" for c in ar) or "-"
        table.add_row(json.dumps(p.env), p.device_name, str(len(p.blocks)),
                      f"{blocks[0].block_s * 1e3:.1f}..{blocks[-1].block_s * 1e3:.1f}",
                      f"{min(b.head_s for b in blocks) * 1e3:.1f}..{max(b.head_s for b in blocks) * 1e3:.1f}",
                      bw, lat, f"{p.optimizer.b * 1e9:.2f}", f"{p.profile_s:.1f}")
    console.print(table)


def duration(hours: float | None, like: float | None = None) -> str:
    """A time to train as it reads: minutes, hours, or days past two of them (the unit `like`'s
    would get, when given: a band in its centre's unit)."""
    if hours is None:
        return "-"
    pick = hours if like is None else like
    if pick < 1:
        return f"{hours * 60:,.0f} min"
    return f"{hours:,.1f} h" if pick < 48 else f"{hours / 24:,.1f} d"


def cluster_verdict(row) -> str:
    """A compare row's marks (paratune.costs.compare.Row): fastest, tied with it, on the Pareto front."""
    marks = ["fastest"] if row.fastest else (["tie with fastest"] if row.tie_with_fastest else [])
    return ", ".join(marks + (["Pareto"] if row.pareto else []))


def print_clusters(rows, console: Console, title: str, currency: str | None = None) -> None:
    """`paratune plan --compare`: one line per cluster (paratune.costs.compare.Row), fastest first: its
    best plan and the runner-up of another strategy, tokens/s/GPU with the band, the time to train,
    GPU-hours and, with prices, the cost; then why the others fit nowhere."""
    table = Table(title=title)
    money = [f"cost {currency}", f"{currency}/1B tokens"] if currency else []
    for col in ("#", "cluster", "best plan", "tokens/s/GPU", "time to train (band)", "GPU-hours",
                *money, "runner-up, another strategy", "verdict"):
        wraps = col in ("best plan", "verdict", "runner-up, another strategy")  # the figures stay on one line
        table.add_column(col, justify="left" if wraps or col.startswith("cluster") else "right", no_wrap=not wraps)
    for i, r in enumerate(rows, 1):
        o = r.outcome
        where = f"{o.cluster.label} ({o.cluster.layout.replace(' ', '')})"
        if not o.fits:
            table.add_row(str(i), where, "[red]no plan fits[/red] (below)", "-", "-", "-", *(["-"] * len(money)), "-", "")
            continue
        source = {"measured": " (measured)", "scaled": " (scaled)"}.get(o.source, "")
        band = f" ± {o.band:.0%}" if o.band else ""
        runner = "-"
        if o.runner_up:
            runner = f"{escape(o.runner_up)}: {o.runner_up_tokens_per_s_per_gpu:,.0f}" + (" (tie)" if o.runner_up_ties else "")
        low = duration(r.hours_low, r.hours).split()[0]  # "12.2 d (9.8-16.3 d)"
        table.add_row(str(i), where, escape(o.best or "") + source, f"{o.tokens_per_s_per_gpu:,.0f}{band}",
                      f"{duration(r.hours)} ({low}-{duration(r.hours_high, r.hours)})", f"{r.gpu_hours:,.0f}",
                      *([_fmt(r.cost, ",.0f"), _fmt(r.cost_per_billion, ",.2f")] if money else []),
                      runner, cluster_verdict(r))
    console.print(table)
    for r in rows:
        if not r.outcome.fits:
            console.print(f"[red]{r.outcome.cluster.label}[/red]: {escape(r.outcome.reason or 'no plan fits')}",
                          soft_wrap=True)


def print_float8_coverage(plans, console: Console, comment: bool = False) -> None:  # noqa: ANN001 - Plans
    """The linears a float8 plan leaves in bf16 and why (paratune.parallel.float8.coverage_notice,
    the workers' own rule on the meta model), once per model, tp and ep among `plans`. `comment`:
    as YAML comments (validate's output stays a plan file)."""
    seen = set()
    for plan in plans:
        key = (plan.model, json.dumps(plan.model_overrides, sort_keys=True, default=str), plan.tp, plan.ep > 1)
        if plan.float8 == "none" or key in seen:
            continue
        seen.add(key)
        from paratune.parallel.float8 import coverage_notice

        for line in coverage_notice(plan):
            console.print(f"# {line}" if comment else f"[yellow]{escape(line)}[/yellow]", soft_wrap=True,
                          markup=not comment, highlight=False)


def print_construction(estimates, console: Console, top: int) -> None:  # noqa: ANN001 - Estimates
    """`paratune plan`: device memory per rank while the model is built (before the optimizer),
    for the plans shown above, and how many plans cannot even be built."""
    fitting = [e for e in estimates if e.measurable][:top]
    if fitting:
        table = Table(title="construction: device GiB per rank while the model is built (before the optimizer)")
        for col in ("#", "plan", "options", "build GiB", "peak GiB"):
            table.add_column(col, justify="left" if col in ("plan", "options") else "right")
        for i, e in enumerate(fitting, 1):
            table.add_row(str(i), strategy_label(e.plan.to_dict()), strategy_options(e.plan.to_dict()),
                          f"{e.construction / 2**30:.1f}", f"{e.memory.total / 2**30:.1f}")
        console.print(table)
    unbuildable = [e for e in estimates if "construction needs" in (e.overflow or "")]
    if unbuildable:
        console.print(f"{len(unbuildable)} plan(s) cannot even be built (construction > capacity), e.g. "
                      f"{strategy_label(unbuildable[0].plan.to_dict())}: "
                      f"{unbuildable[0].construction / 2**30:.1f} GiB per rank")
