"""Which plans a sweep would launch, and in what order, from predictions only (issue 55 item 5).

Replays the shipped space platform/paratune/spaces/llama3_70b_4x8.yaml on h100-80gb with 4
nodes as `paratune plan --nodes 4` builds it (num_workers = nodes x gpus per node, the space's
memory budget as the capacity) and counts, from the cost model's predictions alone:
- the plans worth a trial (fit, or `tight`: within their memory band of the capacity);
- of those, the plans predicted above 1.0x and 1.25x the capacity that would still be launched;
- in launch order, the fastest-first order the sweep used and paratune.costs.risk's expected-gain
  order: whether a plan predicted over the capacity is launched while a plan predicted to fit is
  within its tokens band of the best (`premature_risky_launches`), the first launches' P(fits).
The memory and tokens bands are read from paratune (paratune.costs.bands), whatever they are today.

    .venv/bin/python bench/risk_order.py     # writes bench/results/risk_order.md and .json
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from paratune.config.devices import get_device
from paratune.costs.estimate import estimate
from paratune.costs.risk import (
    NOT_WORTH_A_LAUNCH,
    estimate_options,
    judged_peak,
    premature_risky_launches,
    rank_launches,
    tensor_limit,
)
from paratune.model.shapes import GiB
from paratune.out.tables import strategy_label
from paratune.sweep.space import read_space_mapping, space_from_dict

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "platform" / "paratune" / "spaces" / "llama3_70b_4x8.yaml"
DEVICE, NODES = "h100-80gb", 4
OUT = ROOT / "bench" / "results" / "risk_order"


def machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def replay() -> dict:
    device = get_device(DEVICE)
    raw = read_space_mapping(str(SPACE))
    fixed = dict(raw.get("fixed") or {})
    gpus = device.gpus_per_node
    fixed.update(num_workers=NODES * gpus, gpus_per_node=gpus)
    space = space_from_dict({**raw, "fixed": fixed}, source=SPACE)
    budget = space.spec.objective.memory_budget_gb
    capacity = min(device.memory_gib, budget) if budget else None
    estimates = [estimate(c.plan, device, capacity_gib=capacity) for c in space.candidates]
    worth = [e for e in estimates if e.measurable]

    def over(e, factor: float) -> bool:  # predicted above factor x what its tensors get
        return judged_peak(e) > factor * tensor_limit(e)

    options = estimate_options(worth)
    risk_order = rank_launches(options)
    fastest = sorted(rank_launches(options), key=lambda v: -v.option.tokens)  # what the sweep did

    def describe(order) -> dict:
        premature = premature_risky_launches(order)
        first_over = next((i for i, v in enumerate(order) if v.predicted_over), None)
        return {"premature_risky_launches": len(premature),
                "over_capacity_plans_launched_early": len({i for i, _ in premature}),
                "first_over_capacity_position": None if first_over is None else first_over + 1,
                "first_launches": [{"plan": strategy_label(v.item.plan.to_dict()),
                                    "tokens_per_s_per_gpu": round(v.option.tokens, 1),
                                    "tokens_band": round(v.option.tokens_band, 3),
                                    "predicted_gib": round(judged_peak(v.item) / GiB, 2),
                                    "limit_gib": round(tensor_limit(v.item) / GiB, 2),
                                    "p_fits": round(v.option.p_fits, 3),
                                    "expected_gain": round(v.expected_gain, 1), "deferred": v.deferred}
                                   for v in order[:8]]}

    bands = sorted({(round(e.band.memory, 3), round(e.band.tokens, 3)) for e in worth})
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "space": str(SPACE.relative_to(ROOT)), "device": DEVICE, "nodes": NODES, "num_workers": NODES * gpus,
            "capacity_gib": capacity, "plans": len(estimates), "worth_a_trial": len(worth),
            "fits": sum(e.verdict == "fits" for e in worth), "tight": sum(e.tight for e in worth),
            "launched_over_1_0x": sum(over(e, 1.0) for e in worth),
            "launched_over_1_25x": sum(over(e, 1.25) for e in worth),
            "below_not_worth_a_launch": sum(o.p_fits < NOT_WORTH_A_LAUNCH for o in options),
            "deferred": sum(v.deferred for v in risk_order),
            "memory_and_tokens_bands": [{"memory": m, "tokens": t} for m, t in bands],
            "fastest_first": describe(fastest), "expected_gain": describe(risk_order)}


def markdown(r: dict) -> str:
    def table(order: dict) -> str:
        rows = ["| # | plan | tokens/s/GPU | predicted GiB | limit GiB | P(fits) | expected gain | deferred |",
                "|---|---|---|---|---|---|---|---|"]
        rows += [f"| {i} | {x['plan']} | {x['tokens_per_s_per_gpu']:,.0f} +-{x['tokens_band']:.0%} | "
                 f"{x['predicted_gib']:.1f} | {x['limit_gib']:.1f} | {x['p_fits']:.2f} | {x['expected_gain']:,.0f} | "
                 f"{'yes' if x['deferred'] else ''} |" for i, x in enumerate(order["first_launches"], 1)]
        return "\n".join(rows)

    bands = ", ".join(f"memory {b['memory']:.0%} / tokens {b['tokens']:.0%}" for b in r["memory_and_tokens_bands"])
    lines = [
        "# Launch order weighed by risk: llama3_70b_4x8 on h100-80gb, 4 nodes (predictions only)",
        "",
        f"Date: {r['date']}. Machine: {r['machine']}. `.venv/bin/python bench/risk_order.py`.",
        f"Space `{r['space']}`, {r['num_workers']} ranks, capacity {r['capacity_gib']} GiB per GPU (the space's "
        f"memory budget); bands read from paratune.costs.bands today: {bands}.",
        "",
        "| figure | value |", "|---|---|",
        f"| valid plans | {r['plans']} |",
        f"| worth a trial (fit or tight) | {r['worth_a_trial']} ({r['fits']} fit, {r['tight']} tight) |",
        f"| worth a trial yet predicted above 1.0x the capacity | {r['launched_over_1_0x']} |",
        f"| worth a trial yet predicted above 1.25x the capacity | {r['launched_over_1_25x']} |",
        f"| P(fits) below {NOT_WORTH_A_LAUNCH:.0%} (not worth a launch first) | {r['below_not_worth_a_launch']} |",
        f"| deferred by that rule in the expected-gain order | {r['deferred']} |",
        "| fastest first: over-capacity plans launched before a fitting plan within its tokens band of the best | "
        f"{r['fastest_first']['over_capacity_plans_launched_early']} "
        f"(first over-capacity launch: #{r['fastest_first']['first_over_capacity_position']}) |",
        "| expected gain: the same | "
        f"{r['expected_gain']['over_capacity_plans_launched_early']} "
        f"(first over-capacity launch: #{r['expected_gain']['first_over_capacity_position']}) |",
        "",
        "Capacity above: what a plan's tensors get (the capacity less the CUDA context and NCCL buffers where "
        "the estimate models them, as its verdict judges). \"Predicted over\": P(fits) < 0.5.",
        "",
        "## First launches, fastest first (the sweep before)", "", table(r["fastest_first"]), "",
        "## First launches, by expected gain (paratune.costs.risk)", "", table(r["expected_gain"]), "",
    ]
    return "\n".join(lines)


def main() -> None:
    result = replay()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
