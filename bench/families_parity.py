"""Every causal-LM family transformers ships, trained under ddp and fsdp on 2 gloo processes and held
to the single-process reference, or refused before launch with the reason.

Each family is its own default config shrunk (tests/family_zoo.py: hidden 64, 2 layers, 4 heads,
vocab 512, 4 experts top-2), written as a config.json and given to paratune as a user gives one.
Its random draws (dropout, router jitter) are switched off on both sides, as the parity check does
(paratune.sweep.parity.deterministic_plan). A family is

- `trains`: both layouts' losses within 1e-4 of the reference (fp32; observed ~1e-7) and the
  reference's first loss equal to the ddp trial's (same model, same data, before any update);
- `refused`: paratune's checks before launch name why (the reason is recorded);
- `not a decoder-only LM` / `does not build`: transformers' own config cannot make one;
- `trains (amplifies rounding)`: off the reference by more than 1e-4 but within the model's rounding
  envelope at every step (paratune.sweep.parity.rounding_envelope: a margin over how far reference runs
  move when their initial weights move by fp32 rounding, x (1 + 1e-7 n)), judged as the sweep's parity
  check judges (parity_verdict): the model amplifies rounding at this learning rate, and a layout's
  reduction order is such a rounding (the first loss still equal);
- `fails`: trained, but off the reference, or crashed (a bug to fix: the suite's family tests
  hold one family per code path, this benchmark all of them).

    .venv/bin/python bench/families_parity.py [--only a,b,c] [--out bench/results]
    .venv/bin/python bench/families_parity.py --tp --only falcon,bloom,...   # fsdp + tp 2 as well

Writes families_parity.{json,md} with the date and machine (families_parity_tp.* with --tp,
families_parity_subset.* with --only alone). The suite runs one family per code
path (tests/test_families.py); this is the whole list, minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

TOLERANCE = 1e-4
STRATEGIES = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}}}
TP = {"fsdp-tp2": {"strategy": "fsdp", "fsdp": {"sharding": "full"}, "tp": 2}}  # --tp: dp 1 x tp 2
BASE = {"seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 2, "warmup_steps": 1, "measure_steps": 2,
        "profile_comm": False, "track_memory": False, "lr": 1e-2, "seed": 7}


UNREACHED = "get no gradient from a training step"  # paratune's ddp check (parallel/ddp.py)
FIND_UNUSED = "+find_unused"


def _find_unused(plan):
    return plan.with_changes(ddp={**plan.ddp.model_dump(), "find_unused_parameters": True})


def _reason(error: str) -> str:
    """paratune's own sentence out of a worker's traceback."""
    lines = [line.strip() for line in error.splitlines() if UNREACHED in line and "raise" not in line]
    return (lines[-1] if lines else error[-300:])[:300]


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def prepare(model_type: str, folder: Path, layouts: dict) -> tuple[str, dict]:
    """(outcome, detail) for a family that cannot run, or ("plans", {strategy: plan}) for one that can."""
    from transformers import AutoConfig

    from family_zoo import write_config
    from paratune.config.inputs import check_inputs
    from paratune.config.model_config import ModelError
    from paratune.model.build import build_config
    from paratune.sweep.parity import deterministic_plan
    from paratune.config.plan import PlanError, load_plan_dict
    from paratune.checks.preflight import check_plan_against_model

    try:
        if AutoConfig.for_model(model_type).is_encoder_decoder:
            return "not a decoder-only LM", {"reason": "encoder-decoder"}
    except Exception as err:  # noqa: BLE001 - the config class itself refuses its defaults
        return "does not build", {"reason": f"{type(err).__name__}: {err}"[:300]}
    try:
        path = write_config(model_type, folder / model_type)
    except Exception as err:  # noqa: BLE001
        return "does not build", {"reason": str(err)[:300]}
    plans = {}
    for name, strategy in layouts.items():
        try:
            plan = load_plan_dict({**BASE, "model": str(path), **strategy})
            plan, _ = deterministic_plan(plan)
            check_inputs(plan)
            check_plan_against_model(plan, build_config(plan.model, plan.model_overrides))
        except (ModelError, PlanError, ValueError) as err:
            return "refused", {"reason": str(err)[:400], "strategy": name}
        except Exception as err:  # noqa: BLE001 - a config transformers accepts but paratune cannot build
            return "refused", {"reason": f"{type(err).__name__}: {err}"[:400], "strategy": name}
        plans[name] = plan
    return "plans", plans


def tp_source(plan) -> str:
    """Where a tp plan comes from: transformers' own, or the one paratune derives from the blocks."""
    from paratune.model.materialize import build_meta
    from paratune.model.build import build_config
    from paratune.parallel.tp_derive import family_tp_plan

    try:
        return family_tp_plan(build_meta(build_config(plan.model, plan.model_overrides)))[1]
    except ValueError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--tp", action="store_true", help="fsdp + tp 2 too (the plan transformers ships, or the "
                        "one paratune derives from the blocks)")
    args = parser.parse_args(argv)
    from gloo_harness import run_named_batch
    from machine import describe
    from paratune.sweep.parity import (first_losses_agree, max_loss_difference, parity_verdict, reference_losses,
                                       rounding_envelope)

    chosen = args.only.split(",") if args.only else families()
    t0 = time.perf_counter()
    rows: dict[str, dict] = {}
    runnable: dict[str, object] = {}
    envelopes: dict[str, object] = {}  # one rounding envelope per family that needs one
    with tempfile.TemporaryDirectory(prefix="paratune-families-") as tmp:
        for model_type in chosen:
            outcome, detail = prepare(model_type, Path(tmp), {**STRATEGIES, **(TP if args.tp else {})})
            if outcome == "plans":
                for strategy, plan in detail.items():
                    runnable[f"{model_type}/{strategy}"] = plan
            else:
                rows[model_type] = {"outcome": outcome, **detail}
            print(f"{model_type}: {outcome if outcome != 'plans' else 'checked'}", flush=True)
        runs = run_named_batch(runnable)
        unreached = {name: runnable[name] for name, run in runs.items()
                     if isinstance(run, Exception) and UNREACHED in str(run)}
        if unreached:  # ddp named the parameters a step leaves out: the plan again with DDP's own flag
            runs.update(run_named_batch({f"{n}{FIND_UNUSED}": _find_unused(p) for n, p in unreached.items()}))
        for name, run in runs.items():
            model_type, strategy = name.split("/")
            row = rows.setdefault(model_type, {"outcome": "trains", "layouts": {}})
            if isinstance(run, Exception) and UNREACHED in str(run):  # named before a step; the flag's run decides
                row["layouts"][strategy] = {"needs": "ddp.find_unused_parameters", "reason": _reason(str(run))}
                continue
            if isinstance(run, Exception):
                row["layouts"][strategy] = {"error": str(run)[-600:]}
                continue
            plan, out = run
            if plan.tp > 1:
                row["tp_plan"] = tp_source(plan)
            try:
                reference = reference_losses(plan, steps=len(out["losses"]))
                diff = max_loss_difference(out["losses"], reference)
            except Exception as err:  # noqa: BLE001 - a reference that cannot run is a finding
                row["layouts"][strategy] = {"error": f"reference: {type(err).__name__}: {err}"[:600]}
                continue
            layout = {"max_abs_diff": diff if math.isfinite(diff) else None,
                      "first_loss": out["losses"][0], "reference_first_loss": reference[0]}
            if math.isfinite(diff) and diff > TOLERANCE and first_losses_agree(out["losses"][0], reference[0]):
                if model_type not in envelopes:  # while the config exists
                    envelopes[model_type] = rounding_envelope(plan, len(reference), reference=reference)
                    row["rounding_envelope"] = envelopes[model_type].to_record(TOLERANCE)
                layout["within_envelope"] = parity_verdict(plan, out["losses"], reference, envelopes[model_type]).passed
            row["layouts"][strategy] = layout
    for model_type, row in rows.items():
        layouts = row.get("layouts")
        if layouts is None:
            continue
        bad = [s for s, r in layouts.items() if "needs" not in r and
               ("error" in r or r["max_abs_diff"] is None or r["max_abs_diff"] > TOLERANCE)]
        first = layouts["ddp"] if "first_loss" in layouts.get("ddp", {}) else layouts.get(f"ddp{FIND_UNUSED}", {})
        if "first_loss" in first and not first_losses_agree(first["first_loss"], first["reference_first_loss"]):
            bad.append("first loss")
        if bad and "first loss" not in bad and "rounding_envelope" in row:
            bad = [s for s in bad if not layouts[s].get("within_envelope")]
            if not bad:
                row["outcome"] = "trains (amplifies rounding)"
        if bad:
            row["outcome"] = "fails"
            row["failing"] = bad
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = describe()
    report = {"machine": machine, "seconds": time.perf_counter() - t0, "counts": counts, "families": rows}
    suffix = "_tp" if args.tp else "_subset" if args.only else ""
    (out_dir / f"families_parity{suffix}.json").write_text(json.dumps(report, indent=1, default=str))
    title = "under ddp, fsdp and fsdp + tp 2" if args.tp else "under ddp and fsdp"
    lines = [f"# Causal-LM families transformers ships, {title} (2 gloo processes)", "",
             f"- date: {machine.get('date')}; {machine.get('machine')}; {report['seconds']:.0f} s",
             f"- counts: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} (of {len(rows)})", "",
             "| family | outcome | detail |", "|---|---|---|"]
    for model_type, row in sorted(rows.items()):
        if row["outcome"].startswith("trains"):
            detail = ", ".join(f"{s} {r['max_abs_diff']:.1e}" if "needs" not in r else f"{s}: needs {r['needs']}"
                               for s, r in row["layouts"].items())
            detail += f" (tp plan: {row['tp_plan']})" if "tp_plan" in row else ""
            if "rounding_envelope" in row:
                bound = ", ".join(f"{b:.1e}" for b in row["rounding_envelope"]["bound"])
                detail += f" (within its rounding envelope, bound per step {bound})"
        elif row["outcome"] == "fails":
            detail = "; ".join(f"{s}: {row['layouts'].get(s, {}).get('error') or row['layouts'].get(s, {}).get('max_abs_diff')}"
                               for s in row["failing"])[:300]
        else:
            detail = row.get("reason", "")
        lines.append(f"| {model_type} | {row['outcome']} | {str(detail).replace('|', '/').replace(chr(10), ' ')[:300]} |")
    (out_dir / f"families_parity{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
