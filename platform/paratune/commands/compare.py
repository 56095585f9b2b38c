"""`paratune plan SPACE --compare DEVICE:GPUS,... --tokens N`: the cost model on every cluster, one table.

Each cluster gets the space re-expressed at its GPU count (`space_at`: num_workers = the count,
gpus_per_node = the device table's, the global batch unchanged, so the training means the same:
micro_batch x grad_accum x dp = global batch, and a count that cannot keep it says so), its plans
estimated on its device (paratune.costs.estimate), its best plan that fits and the runner-up of another
strategy; a cluster where nothing fits says why and the smallest cluster of that device that would.
The arithmetic (time, GPU-hours, cost, Pareto front, ties) is paratune.costs.compare's; the table
paratune.out.tables'; the figure paratune.sweep.figures'. Writes <out>/compare.json and compare.png.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape

from paratune.costs.compare import (
    Cluster,
    Outcome,
    cluster_for,
    load_prices,
    missing_prices,
    parse_clusters,
    prediction_band,
    rank,
    smallest_fitting,
    to_document,
    tokens_label,
    whole_node_counts,
)

COMPARE_JSON = "compare.json"
REFERENCE_DEVICE = "h100-80gb"  # `paratune plan`'s default device: the card a budget is read against, among equals


def space_at(raw: dict[str, Any], cluster: Cluster, source: Path):
    """The space at the cluster's GPU count (paratune.sweep.space.Space); a SpaceError where no plan can
    keep the global batch (or any other rule) there. A fixed grad_accum (a plan file's) is dropped:
    it follows from micro_batch x dp."""
    from paratune.sweep.space import space_from_dict

    fixed = {k: v for k, v in (raw.get("fixed") or {}).items() if k != "grad_accum"}
    fixed.update(num_workers=cluster.gpus, gpus_per_node=cluster.gpus_per_node)
    return space_from_dict({**raw, "fixed": fixed}, source=source)


def memory_share(raw: dict[str, Any], devices: dict) -> tuple[float | None, str]:
    """The share of each device's memory a plan may use, and how it was read. The space's
    objective.memory_budget_gb is per GPU and written for one card: estimate.device where the space
    names one, else the table's smallest device that holds the budget (76 GiB: an 80 GB card); as a
    share of that card's memory, every device keeps the same headroom. No budget: all of it."""
    budget = (raw.get("objective") or {}).get("memory_budget_gb")
    if not budget:
        return None, "each device's whole memory (the space sets no objective.memory_budget_gb)"
    named = devices.get((raw.get("estimate") or {}).get("device"))
    holding = sorted((d for d in devices.values() if d.memory_gib >= budget and d.name != "cpu"),
                     key=lambda d: (d.memory_gib, d.name != REFERENCE_DEVICE, d.name))
    if not named and not holding:
        return None, f"each device's whole memory (the space's memory_budget_gb {budget:g} is above every device's)"
    reference = named or holding[0]
    share = min(1.0, float(budget) / reference.memory_gib)
    return share, (f"{share:.0%} of each device's memory (the space's memory_budget_gb {budget:g}, read against "
                   f"{reference.name}'s {reference.memory_gib:g} GiB: the same headroom on every device)")


def evaluate(raw: dict[str, Any], cluster: Cluster, device, share: float | None, source: Path,
             margin: float = 0.0, activation_model: str = "trace") -> Outcome:
    """The cost model on one cluster: its best plan that fits and the runner-up of another
    strategy, or why none fits (the count cannot keep the global batch; or the smallest plan's
    overflow)."""
    from paratune.costs.estimate import estimate_space
    from paratune.sweep.space import SpaceError
    from paratune.out.tables import strategy_label

    try:
        space = space_at(raw, cluster, source)
    except SpaceError as err:
        batch = (raw.get("fixed") or {}).get("global_batch")
        why = re.sub(r"^\d+ x ", "", str(err).split("the rules they break:")[-1].strip().splitlines()[0].strip(" -"))
        return Outcome(cluster, reason=f"no plan keeps global_batch {batch} at {cluster.gpus} GPUs: {why}")
    capacity = device.memory_gib * share if share else None
    estimates = estimate_space(space, device, capacity_gib=capacity, margin=margin, activation_model=activation_model)
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        rejected = [e for e in estimates if not e.refusal] or estimates  # the smallest plan the device could run
        smallest = rejected[0]
        limit = smallest.capacity_bytes / 2**30
        return Outcome(cluster, plans=len(estimates),
                       reason=f"no plan fits in {limit:.1f} GiB per GPU; the smallest, "
                              f"{strategy_label(smallest.plan.to_dict())}: {smallest.overflow}")
    best = fitting[0]
    other = next((e for e in fitting if e.plan.strategy != best.plan.strategy), None)
    return Outcome(cluster, tokens_per_s_per_gpu=best.time.tokens_per_s_per_gpu, band=prediction_band(best),
                   best=strategy_label(best.plan.to_dict()), best_strategy=best.plan.strategy,
                   peak_gib=best.memory.total / 2**30, plans=len(estimates), fitting=len(fitting),
                   runner_up=strategy_label(other.plan.to_dict()) if other else None,
                   runner_up_tokens_per_s_per_gpu=other.time.tokens_per_s_per_gpu if other else None)


def smallest_cluster(cluster: Cluster, node_size: int, check: Callable[[Cluster], Outcome]) -> int | None:
    """The smallest count of the cluster's device, above its own, at which a plan fits."""
    return smallest_fitting(whole_node_counts(cluster.gpus, node_size),
                            lambda n: check(cluster_for(cluster.device, n, node_size)).fits)


def _refuse(args) -> str | None:
    for flag, value, why in (("--device", args.device, "each cluster names its device"),
                             ("--nodes", args.nodes, "each cluster's count sets its nodes"),
                             ("--gpus-per-node", args.gpus_per_node, "the device table's gpus_per_node is used; "
                              "change it with --devices FILE"),
                             ("--profile", args.profile, "a profile times one cluster's device; the comparison "
                              "predicts every device with the roofline")):
        if value:
            return f"{flag}: got {value!r}; not with --compare ({why})"
    if args.tokens is None:
        return "--tokens: required with --compare (how many tokens to train, e.g. --tokens 1e11)"
    return None


def cmd_compare(args, console: Console) -> int:
    """`paratune plan SPACE --compare ...`: prints the table, writes compare.json and the figure."""
    from paratune.config.devices import load_devices
    from paratune.sweep.space import SpaceError, read_space_mapping
    from paratune.out.tables import print_clusters

    t0 = time.perf_counter()
    try:
        problem = _refuse(args)
        if problem:
            raise ValueError(problem)
        devices = load_devices(args.devices)
        clusters = parse_clusters(args.compare, {n: d.gpus_per_node for n, d in devices.items()})
        prices = load_prices(args.prices, devices) if args.prices else None
        if prices is not None and missing_prices(clusters, prices):
            raise ValueError(missing_prices(clusters, prices))
        rank([], args.tokens)  # checks --tokens
        raw = read_space_mapping(args.space)
        if not isinstance(raw.get("fixed"), dict) or "model" not in raw["fixed"]:
            raise ValueError(f"{args.space}: fixed.model: missing; allowed: a space (or plan) file naming its model")
    except (ValueError, SpaceError) as err:
        console.print(f"[red]cannot compare[/red]\n{escape(str(err))}")
        return 2
    share, share_text = memory_share(raw, devices)
    source = Path(args.space)
    model = "formula" if args.formula else "trace"
    seen: dict[tuple[str, int], Outcome] = {}

    def check(cluster: Cluster, what: str = "") -> Outcome:
        key = (cluster.device, cluster.gpus)
        if key not in seen:
            with console.status(f"{what}{cluster.label} ({cluster.layout}): estimating the space's plans"):
                seen[key] = evaluate(raw, cluster, devices[cluster.device], share, source, args.margin, model)
        return seen[key]

    outcomes = []
    for i, cluster in enumerate(clusters, 1):
        outcome = check(cluster, f"cluster {i}/{len(clusters)}: ")
        if not outcome.fits and outcome.plans:  # plans exist but none fits: look for a larger cluster
            node = devices[cluster.device].gpus_per_node
            outcome.smallest_fit = smallest_cluster(cluster, node, lambda c: check(c, f"smallest {c.device} that fits: "))
            outcome.reason += (f"; the smallest {cluster.device} cluster that fits: {outcome.smallest_fit} GPUs"
                               if outcome.smallest_fit else
                               f"; no {cluster.device} cluster up to {whole_node_counts(0, node)[-1]} GPUs fits")
        outcomes.append(outcome)
        console.print(f"{cluster.label} ({cluster.layout}): "
                      + (f"{outcome.fitting} of {outcome.plans} plans fit" if outcome.fits else "nothing fits"))
    rows = rank(outcomes, args.tokens, prices)
    fixed = raw["fixed"]
    band = next((o.band for o in outcomes if o.fits), prediction_band())
    print_clusters(rows, console, currency=prices.currency if prices else None,
                   title=f"{raw.get('name', source.stem)}: {fixed['model']}, global batch {fixed.get('global_batch')} x "
                         f"seq {fixed.get('seq_len')}, {tokens_label(args.tokens)} tokens to train, predicted, fastest first")
    spend = f"cost ({prices.currency}, {prices.source})" if prices else "GPU-hours (no --prices: as if every GPU-hour cost the same)"
    console.print(f"tokens/s/GPU: the roofline's prediction (no GPU), each with its band (the fastest's ± {band:.0%}: "
                  "the published GPU runs' error for plans of its kind, paratune.costs.bands); a tie: the bands overlap. Pareto: no other cluster is both faster and "
                  f"cheaper by {spend}. Memory per GPU: {share_text}. The global batch is the space's at every count "
                  "(micro_batch x grad_accum x dp).", soft_wrap=True)
    out = Path(args.out) if args.out else _default_out(raw, source)
    out.mkdir(parents=True, exist_ok=True)
    document = to_document(outcomes, args.tokens, prices, space=str(source), model=fixed["model"],
                           global_batch=fixed.get("global_batch"), seq_len=fixed.get("seq_len"),
                           memory_share=share, created_with=f"paratune plan --compare {args.compare}")
    (out / COMPARE_JSON).write_text(json.dumps(document, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1))
    from paratune.sweep.figures import plot_clusters

    figure = plot_clusters(rows, args.tokens, prices.currency if prices else None)
    if figure.png:
        (out / figure.name).write_bytes(figure.png)
        console.print(f"figure: [bold]{out / figure.name}[/bold]", soft_wrap=True)
    else:
        console.print(f"no figure: {figure.note}")
    console.print(f"{len(clusters)} cluster(s) compared in {time.perf_counter() - t0:.1f} s; written {out / COMPARE_JSON} "
                  "(in a sweep's folder, `paratune report` draws it with the sweep's measured winner)", soft_wrap=True)
    return 0 if any(o.fits for o in outcomes) else 1


def _default_out(raw: dict[str, Any], source: Path) -> Path:
    from paratune.config.home import paratune_home

    return paratune_home() / f"compare-{raw.get('name') or source.stem}"
