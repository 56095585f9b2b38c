"""Replay published GPU training runs through paratune's cost model (issue 43).

    /work/main/.venv/bin/python bench/published.py                  # every source, trace and --formula
    /work/main/.venv/bin/python bench/published.py --source torchtitan --only tt-h100-70b-fsdp32-tp8
    /work/main/.venv/bin/python bench/published.py --alternate      # llm-foundry's MPT as Llama stand-ins
    /work/main/.venv/bin/python bench/published.py --no-write       # print only
    /work/main/.venv/bin/python bench/published.py --write-bands    # + the bands paratune ships

Run from the worktree root; it imports paratune from ./platform (no PYTHONPATH needed). No GPU:
the predictions are `paratune plan`'s (paratune.costs.estimate.estimate, the function `paratune plan`
calls through estimate_space, with the device's whole memory as capacity and no margin), once
with the traced activations (the default) and once with DESIGN.md's formula (`--formula`).

Every row of bench/published/*.yaml (text copied from public sources, cited per row) becomes a
paratune Plan: the file's `plan_defaults`, then the row's `plan`; `model` is a paratune preset or a
key of the file's `models` (a transformers config dict, written to a config.json under the cache
folder). A row marked `replay: false`, or whose plan paratune refuses (a layout it lacks), is
listed with the reason, never dropped. Per source: median and worst |error| of tokens/s/GPU and of
memory where published, Kendall's tau of tokens/s/GPU within each model's rows, the error bands
(paratune.costs.bands: the 80th percentile of |error| per plan kind; --write-bands writes them to
platform/paratune/presets/prediction_bands.json, what `paratune plan` prints), tight rows (within
their memory band of the capacity: a sweep measures them) and false rejections (a run that ran
on its GPUs, predicted over its capacity by more than its band); and each source judged with the
other sources' bands only (leave one source out). Activation traces are stored
under the cache folder (default: a fresh temporary one, so the timings are those of a cold
`paratune plan`; rows of the same shape reuse one trace, as a space's plans do).
Writes bench/results/published.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))  # this checkout's paratune, whatever the venv has installed
sys.path.insert(0, str(Path(__file__).parent))

CORPUS = Path(__file__).parent / "published"
RESULTS = Path(__file__).parent / "results"
BANDS = ROOT / "platform" / "paratune" / "presets" / "prediction_bands.json"
MODES = ("trace", "formula")


# --------------------------------------------------------------------------- the corpus
@dataclass
class Row:
    """One published run: where it is written, what it measured, and the paratune plan it maps to."""

    source: str
    id: str
    model: str
    cite: dict[str, Any]
    gpus: int | None
    device: str
    devices_file: str | None
    plan: dict[str, Any]
    published: dict[str, Any]
    replay: bool = True
    reason: str = ""  # why it is not replayed (a row marked so, or the plan paratune refuses)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode -> prediction


def _config_path(name: str, config: dict[str, Any], cache: Path) -> str:
    """A `models:` entry as a config.json paratune's `model:` accepts (a path)."""
    path = cache / "published_models" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=1, sort_keys=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def load_corpus(cache: Path, alternate: bool = False, sources: set[str] | None = None) -> list[Row]:
    """Every row of every bench/published/*.yaml, its plan dict assembled (not yet validated)."""
    rows: list[Row] = []
    for path in sorted(CORPUS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        name = data["source"]
        if sources and name not in sources:
            continue
        models = dict(data.get("models") or {})
        if alternate and data.get("alternate_models"):
            models = dict(data["alternate_models"])
        for raw in data["rows"]:
            model = raw.get("model", "")
            plan = {**(data.get("plan_defaults") or {}), **(raw.get("plan") or {})}
            if model in models:
                plan["model"] = _config_path(model, models[model], cache)
                if alternate and data.get("alternate_models"):  # the Llama stand-in has no learned positions
                    plan.pop("model_overrides", None)
            elif model:
                plan["model"] = model
            cite = {"repository": data["repository"], "file": data.get("file"), **(raw.get("cite") or {})}
            if "table" in raw and "table" not in cite:
                cite["table"] = raw["table"]
            if "line" in raw:
                cite["line"] = raw["line"]
            row_id = raw.get("id") or f"{name}-line{raw.get('line')}"
            rows.append(Row(source=name, id=row_id, model=model, cite=cite, gpus=raw.get("gpus"),
                            device=raw.get("device", data.get("device")),
                            devices_file=raw["devices_file"] if "devices_file" in raw else data.get("devices_file"),
                            plan=plan, published=dict(raw.get("published") or {}),
                            replay=raw.get("replay", True), reason=raw.get("reason", "")))
            if not raw.get("replay", True):
                rows[-1].cite["layout"] = raw.get("layout", "")
    ids = [r.id for r in rows]
    if len(ids) != len(set(ids)):
        raise SystemExit(f"duplicate row ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return rows


# --------------------------------------------------------------------------- the replay
def predict(row: Row, mode: str) -> dict[str, Any]:
    """`paratune plan`'s numbers for the row's plan on its device (the estimate of a one-plan space)."""
    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate
    from paratune.config.plan import load_plan_dict
    from paratune.model.shapes import GiB, model_shape

    plan = load_plan_dict(dict(row.plan), source=row.id)
    devices = str(ROOT / row.devices_file) if row.devices_file else None
    device = get_device(row.device, devices)
    t0 = time.perf_counter()
    est = estimate(plan, device, activation_model=mode)
    seconds = time.perf_counter() - t0
    shape = model_shape(plan)
    from paratune.costs.bands import band_categories

    return {
        "tokens_per_s_per_gpu": est.time.tokens_per_s_per_gpu,
        "memory_gib": est.memory.total / GiB,
        "construction_gib": est.construction / GiB,
        "fits": est.fits,
        "refused": est.refusal is not None,
        "categories": band_categories(plan),
        "band_tokens": est.band.tokens if est.band else None,
        "band_memory": est.band.memory if est.band else None,
        "verdict": est.verdict,
        "overflow": est.overflow,
        "mfu_vs_bf16_peak": est.mfu_vs_bf16_peak,
        "memory_parts_gib": {k: v / GiB for k, v in est.memory.parts().items()},
        "memory_peak_moment": est.memory.phase,
        "activation_method": est.memory.method,
        "step_s": est.time.step_s,
        "compute_s": est.time.compute_s,
        "exposed_comm_s": est.time.exposed_comm_s,
        "bubble": est.time.bubble,
        "grad_accum": plan.grad_accum,
        "params": shape.total,
        "capacity_gib": est.capacity_bytes / GiB,
        "seconds": seconds,
    }


def replay(rows: list[Row], modes: tuple[str, ...], console) -> None:  # noqa: ANN001 - rich Console
    """Predict every replayable row in every mode; a plan paratune refuses becomes the row's reason."""
    from paratune.config.plan import load_plan_dict

    for row in rows:
        if not row.replay:
            continue
        try:
            load_plan_dict(dict(row.plan), source=row.id)
        except ValueError as err:  # pydantic's ValidationError and PlanError are ValueErrors
            row.replay, row.reason = False, "paratune refuses the plan: " + " ".join(str(err).split())
            console.print(f"[yellow]{row.id}: not expressible[/yellow] {row.reason[:160]}")
            continue
        for mode in modes:
            row.results[mode] = predict(row, mode)
            r = row.results[mode]
            console.print(f"{row.id} \\[{mode}] {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (published "
                          f"{row.published.get('tokens_per_s_per_gpu')}), {r['memory_gib']:.1f} GiB (published "
                          f"{row.published.get('memory_gib', '-')}), fits {r['fits']}, {r['seconds']:.1f} s")


# --------------------------------------------------------------------------- the judging
def rel_error(predicted: float, published: float | None) -> float | None:
    return None if not published else predicted / float(published) - 1


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b (scipy), nan below two rows or with no variation."""
    from scipy.stats import kendalltau

    if len(a) < 2:
        return float("nan")
    return float(kendalltau(a, b).statistic)


def group_key(row: Row, rows: list[Row]) -> str:
    """The rows a rank correlation compares: one model's, on one device (the model's name, with
    "@device" for rows off the source's most common device: torchtitan's H200 runs)."""
    devices = [r.device for r in rows if r.source == row.source]
    usual = max(set(devices), key=devices.count)
    return row.model if row.device == usual else f"{row.model}@{row.device}"


def corpus_bands(rows: list[Row], mode: str, sources: set[str] | None = None) -> dict[str, dict]:
    """The error bands of `sources`' replayed rows (all sources: None): per band category
    (paratune.costs.bands.band_categories), the 80th percentile of |error| and the rows behind it, for
    tokens/s/GPU and for memory where published."""
    from paratune.costs.bands import bands_from_errors

    tokens, memory = [], []
    for r in rows:
        if mode not in r.results or (sources is not None and r.source not in sources):
            continue
        res = r.results[mode]
        for key, out in (("tokens_per_s_per_gpu", tokens), ("memory_gib", memory)):
            e = rel_error(res["memory_gib" if key == "memory_gib" else key], r.published.get(key))
            if e is not None:
                out.append((res["categories"], e))
    return {"tokens": bands_from_errors(tokens), "memory": bands_from_errors(memory)}


def judge(res: dict[str, Any], bands: dict[str, dict]) -> tuple[str, float, float]:
    """(memory verdict, tokens band, memory band) of a replayed row under `bands`: fits, tight
    (within the memory band of the capacity: a sweep measures it) or over (rejected)."""
    from paratune.costs.bands import CPU_BANDS, memory_verdict, pick_band

    tokens_band, _ = pick_band(bands.get("tokens", {}), res["categories"], CPU_BANDS["tokens"])
    memory_band, _ = pick_band(bands.get("memory", {}), res["categories"], CPU_BANDS["memory"])
    if res.get("refused"):
        return "over", tokens_band, memory_band
    verdicts = {memory_verdict(g, res["capacity_gib"], memory_band) for g in (res["memory_gib"], res["construction_gib"])}
    verdict = "over" if "over" in verdicts else "tight" if "tight" in verdicts else "fits"
    return verdict, tokens_band, memory_band


def summarize(rows: list[Row], mode: str, bands: dict[str, dict] | None = None) -> dict[str, Any]:
    """Median and worst |error| of tokens/s/GPU and memory, tau per model, false rejections (a
    run that ran, judged `over` under `bands`: beyond the memory band of the capacity), tight
    rows, and the share of rows whose error lies within their band."""
    done = [r for r in rows if mode in r.results]
    tps = [(r, rel_error(r.results[mode]["tokens_per_s_per_gpu"], r.published.get("tokens_per_s_per_gpu")))
           for r in done]
    tps = [(r, e) for r, e in tps if e is not None]
    mem = [(r, rel_error(r.results[mode]["memory_gib"], r.published.get("memory_gib"))) for r in done]
    mem = [(r, e) for r, e in mem if e is not None]
    out: dict[str, Any] = {"rows": len(done), "not_replayed": sum(not r.replay for r in rows)}
    if tps:
        worst = max(tps, key=lambda x: abs(x[1]))
        out.update(tokens_median_abs=statistics.median(abs(e) for _, e in tps), tokens_worst=worst[1],
                   tokens_worst_row=worst[0].id, tokens_too_slow=sum(e < 0 for _, e in tps),
                   tokens_median_signed=statistics.median(e for _, e in tps))
    if mem:
        worst = max(mem, key=lambda x: abs(x[1]))
        out.update(memory_rows=len(mem), memory_median_abs=statistics.median(abs(e) for _, e in mem),
                   memory_worst=worst[1], memory_worst_row=worst[0].id,
                   memory_median_signed=statistics.median(e for _, e in mem))
    taus: dict[str, dict[str, float]] = {}
    for model in sorted({group_key(r, rows) for r in done}):
        group = [r for r in done if group_key(r, rows) == model and r.published.get("tokens_per_s_per_gpu")]
        if len(group) >= 2:
            taus[model] = {"n": len(group), "tau": kendall_tau(
                [r.results[mode]["tokens_per_s_per_gpu"] for r in group],
                [float(r.published["tokens_per_s_per_gpu"]) for r in group])}
    out["tau_by_model"] = taus
    counted = [(r.results[mode]["params"], int(r.published["num_params"]))
               for r in done if r.published.get("num_params")]
    if counted:  # the mapped config's parameters against the source's own count (llm-foundry's NumParams)
        out.update(params_checked=len(counted), params_exact=sum(a == b for a, b in counted),
                   params_max_abs_rel=max(abs(a / b - 1) for a, b in counted))
    judged = {r.id: judge(r.results[mode], bands or {}) for r in done}
    out["false_rejections"] = [r.id for r in done if judged[r.id][0] == "over"]
    out["tight"] = [r.id for r in done if judged[r.id][0] == "tight"]
    out["over_capacity_unbanded"] = [r.id for r in done if not r.results[mode]["fits"]]
    if tps:
        out["tokens_within_band"] = sum(abs(e) <= judged[r.id][1] for r, e in tps) / len(tps)
    if mem:
        out["memory_within_band"] = sum(abs(e) <= judged[r.id][2] for r, e in mem) / len(mem)
    out["seconds_total"] = sum(r.results[mode]["seconds"] for r in done)
    out["seconds_max"] = max((r.results[mode]["seconds"] for r in done), default=0.0)
    return out


def leave_one_source_out(rows: list[Row], mode: str) -> dict[str, dict[str, Any]]:
    """Each source judged with what the other sources' rows give: their error bands (tokens band
    coverage, false rejections under their memory band), and what one scale fitted to their
    tokens/s/GPU (1 / (1 + their median signed error): fitting TRAINING_SHARE to a source) would
    make of this source's errors. No time-model constant is fitted to any source; the bands are."""
    sources = sorted({r.source for r in rows if r.results})
    out: dict[str, dict[str, Any]] = {}
    for source in sources:
        others = set(sources) - {source}
        bands = corpus_bands(rows, mode, others)
        mine = [r for r in rows if r.source == source and mode in r.results]
        summary = summarize(mine, mode, bands)
        errs = [rel_error(r.results[mode]["tokens_per_s_per_gpu"], r.published.get("tokens_per_s_per_gpu"))
                for r in rows if r.source in others and mode in r.results]
        errs = [e for e in errs if e is not None]
        scale = 1 / (1 + statistics.median(errs)) if errs else 1.0
        scaled = [abs((1 + e) * scale - 1) for e in (rel_error(r.results[mode]["tokens_per_s_per_gpu"],
                                                              r.published.get("tokens_per_s_per_gpu")) for r in mine)
                  if e is not None]
        out[source] = {"built_with": sorted(others), "tokens_within_band": summary.get("tokens_within_band"),
                       "memory_within_band": summary.get("memory_within_band"),
                       "false_rejections": summary["false_rejections"], "tight": summary["tight"],
                       "bands_all": {k: v.get("all") for k, v in bands.items()},
                       "share_scale": scale, "scaled_tokens_median_abs": statistics.median(scaled) if scaled else None,
                       "scaled_tokens_worst_abs": max(scaled) if scaled else None}
    return out


# --------------------------------------------------------------------------- the outputs
def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.0f}%"


def _abs_pct(x: float | None) -> str:
    return "-" if x is None else f"{abs(x) * 100:.0f}%"


def markdown(rows: list[Row], summaries: dict[str, dict[str, dict[str, Any]]], info: dict[str, str],
             modes: tuple[str, ...], alternate: bool, wall_s: float, cold: bool,
             bands: dict[str, dict] | None = None, loso: dict[str, dict[str, Any]] | None = None) -> str:
    from machine import versions_line

    lines = ["# Published GPU runs replayed through paratune's cost model (issue 43)", "",
             f"Date: {info['date']}. Machine: {info['machine']} (no GPU; predictions need none). "
             f"{versions_line(info)}.", "",
             "Made by `python bench/published.py`" + (" --alternate" if alternate else "") +
             f" ({wall_s:.0f} s in all, {'a cold' if cold else 'a reused'} trace store). "
             "Corpus: bench/published/ (each row cited; mapping notes "
             "beside each source). Predicted = `paratune plan` (paratune.costs.estimate.estimate on the row's device, "
             "capacity = the device's memory, margin 0); `trace` = traced activations (default), `formula` = "
             "`--formula`. Error = predicted / published - 1. Memory: torchtitan publishes max *reserved* "
             "GiB, paratune predicts allocated tensor bytes (no allocator reserve). Bands: the 80th percentile "
             "of |error| over the corpus's rows of a plan's kind (paratune.costs.bands; `paratune plan` prints them). "
             "Tight: the predicted peak within its memory band of the capacity (a sweep measures it). False "
             "rejection: a run that ran on its GPUs, predicted over its capacity by more than its band.", ""]
    lines += ["## Per source", "",
              "| source | mode | rows | tokens/s/GPU median abs err | worst | predicted too slow | within band | "
              "memory rows | memory median abs err | worst | false rejections | tight | over capacity (no band) | "
              "Kendall tau by model (n) | s per row (max) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for source, by_mode in summaries.items():
        for mode in modes:
            s = by_mode.get(mode)
            if not s:
                continue
            if not s["rows"]:
                lines.append(f"| {source} | {mode} | 0 ({s['not_replayed']} listed, not replayed) "
                             "| - | - | - | - | - | - | - | - | - | - | - | - |")
                continue
            taus = ", ".join(f"{m} {v['tau']:+.2f} ({v['n']})" for m, v in s["tau_by_model"].items()) or "-"
            skipped = f" (+{s['not_replayed']} not replayed)" if s["not_replayed"] else ""
            lines.append(
                f"| {source} | {mode} | {s['rows']}{skipped} | {_abs_pct(s.get('tokens_median_abs'))} | "
                f"{_pct(s.get('tokens_worst'))} ({s.get('tokens_worst_row', '-')}) | "
                f"{s.get('tokens_too_slow', 0)} of {s['rows']} | {_abs_pct(s.get('tokens_within_band'))} | "
                f"{s.get('memory_rows', 0)} | {_abs_pct(s.get('memory_median_abs'))} | {_pct(s.get('memory_worst'))} "
                f"({s.get('memory_worst_row', '-')}) | {len(s['false_rejections'])} | {len(s.get('tight', []))} | "
                f"{len(s.get('over_capacity_unbanded', []))} | {taus} | "
                f"{s['seconds_total'] / max(1, s['rows']):.1f} ({s['seconds_max']:.1f}) |")
    for source, by_mode in summaries.items():
        s = next(iter(by_mode.values()), {})
        if s.get("params_checked"):
            lines.append(f"{source}: parameter count of the mapped configs equals the published one in "
                         f"{s['params_exact']} of {s['params_checked']} rows (largest difference "
                         f"{s['params_max_abs_rel'] * 100:.3f}%).")
    lines += [""]
    for source, by_mode in summaries.items():
        for mode in modes:
            s = by_mode.get(mode) or {}
            if s.get("false_rejections"):
                lines.append(f"{source} [{mode}] false rejections: {', '.join(s['false_rejections'])}.")
    lines += [""]
    if bands:
        lines += ["## Bands (presets/prediction_bands.json: what `paratune plan` prints)", "",
                  "| category | tokens/s/GPU band | rows | memory band | rows |", "| --- | ---: | ---: | ---: | ---: |"]
        cats = sorted(set(bands.get("tokens", {})) | set(bands.get("memory", {})), key=lambda c: (c != "all", c))
        for c in cats:
            t, m = bands.get("tokens", {}).get(c, {}), bands.get("memory", {}).get(c, {})
            lines.append(f"| {c} | {_abs_pct(t.get('band'))} | {t.get('rows', 0)} | {_abs_pct(m.get('band'))} | "
                         f"{m.get('rows', 0)} |")
        lines += ["", "A plan's band: the widest of its categories with at least 4 rows (paratune.costs.bands.MIN_ROWS).", ""]
    if loso:
        lines += ["## Leave one source out", "",
                  "No time-model constant is fitted to any corpus row (each names its public source: paratune/"
                  "efficiency.py); the bands are. Here each source is judged with the bands of the other sources' "
                  "rows only, and with the one scale a fit of TRAINING_SHARE to the other sources' tokens/s/GPU "
                  "(their median signed error) would give.", "",
                  "| judged | bands built with | tokens within band | memory within band | false rejections | tight | "
                  "scale fitted on the others | tokens median abs err with it | worst |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for source, v in loso.items():
            lines.append(f"| {source} | {', '.join(v['built_with'])} | {_abs_pct(v.get('tokens_within_band'))} | "
                         f"{_abs_pct(v.get('memory_within_band'))} | {len(v['false_rejections'])} | {len(v['tight'])} | "
                         f"x{v['share_scale']:.3f} | {_abs_pct(v.get('scaled_tokens_median_abs'))} | "
                         f"{_abs_pct(v.get('scaled_tokens_worst_abs'))} |")
        lines.append("")
    for source in summaries:
        lines += [f"## {source}: every row", "",
                  "| row | model | GPUs | plan | published tok/s/GPU | trace | err | formula | err | published GiB | "
                  "trace GiB | err | formula GiB | err | memory verdict (trace/formula) | peak moment (trace) | s (trace) |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| --- | --- | ---: |"]
        for r in [r for r in rows if r.source == source and r.results]:
            t, f = r.results.get("trace", {}), r.results.get("formula", {})
            pub_t, pub_m = r.published.get("tokens_per_s_per_gpu"), r.published.get("memory_gib")

            def cell(res: dict[str, Any], key: str, fmt: str) -> str:
                return format(res[key], fmt) if res else "-"

            lines.append(
                f"| {r.id} | {r.model} | {r.gpus} | {_plan_label(r)} | {pub_t} | "
                f"{cell(t, 'tokens_per_s_per_gpu', ',.0f')} | "
                f"{_pct(rel_error(t['tokens_per_s_per_gpu'], pub_t)) if t else '-'} | "
                f"{cell(f, 'tokens_per_s_per_gpu', ',.0f')} | "
                f"{_pct(rel_error(f['tokens_per_s_per_gpu'], pub_t)) if f else '-'} | {pub_m if pub_m else '-'} | "
                f"{cell(t, 'memory_gib', '.1f')} | {_pct(rel_error(t['memory_gib'], pub_m)) if t and pub_m else '-'} | "
                f"{cell(f, 'memory_gib', '.1f')} | {_pct(rel_error(f['memory_gib'], pub_m)) if f and pub_m else '-'} | "
                f"{judge(t, bands or {})[0] if t else '-'}/{judge(f, bands or {})[0] if f else '-'} | "
                f"{t.get('memory_peak_moment', '-')} | {t.get('seconds', 0):.1f} |")
        lines.append("")
    skipped = [r for r in rows if not r.replay]
    if skipped:
        lines += ["## Rows not replayed (listed, with the reason)", "", "| source | row | reason |",
                  "| --- | --- | --- |"]
        for r in skipped:
            where = r.id if r.source != "megatron-bridge" else \
                f"{r.model} ({r.cite.get('table', '')}, line {r.cite.get('line')})"
            lines.append(f"| {r.source} | {where} | {r.reason.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def _plan_label(r: Row) -> str:
    """A short layout label of the row's plan: strategy, degrees, micro-batch x accumulation, levers."""
    p = r.plan
    parts = [f"{p.get('strategy')}:{(p.get('fsdp') or {}).get('sharding', '')}".rstrip(":")]
    for key in ("tp", "pp", "cp", "ep"):
        if p.get(key, 1) > 1:
            parts.append(f"{key}{p[key]}")
    ga = next((res["grad_accum"] for res in r.results.values()), p.get("grad_accum"))
    parts.append(f"s{p.get('seq_len')} mb{p.get('micro_batch')}x{ga}")
    ac = p.get("activation_checkpointing", "none")
    if ac != "none":
        parts.append({"selective": "sac", "full": "ac", "layers": "ac-layers"}[ac])
    if p.get("pp", 1) > 1:
        parts.append(p.get("pp_schedule", "1f1b"))
    for key, label in (("compile", "compile"), ("async_tp", "asyncTP"), ("float8_all_gather", "f8-ag")):
        if p.get(key):
            parts.append(label)
    if p.get("float8", "none") != "none":
        parts.append(f"f8:{p['float8']}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", help="only these sources (torchtitan, llm-foundry, ...)")
    parser.add_argument("--only", action="append", help="only these row ids")
    parser.add_argument("--mode", choices=MODES, action="append", help="only this activation model")
    parser.add_argument("--alternate", action="store_true",
                        help="use a source's alternate_models (llm-foundry: MPT as Llama-architecture stand-ins)")
    parser.add_argument("--cache", help="paratune home for traces and model configs (default: a fresh temporary "
                                        "folder: cold timings)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write bench/results/published.*")
    parser.add_argument("--out", help="results path without suffix (default: bench/results/published, "
                                      "published_alternate with --alternate)")
    parser.add_argument("--write-bands", action="store_true",
                        help=f"also write the bands paratune ships ({BANDS.relative_to(ROOT)}; whole corpus only)")
    args = parser.parse_args(argv)

    from rich.console import Console

    from machine import describe

    console = Console(width=200)
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="paratune-published-"))
    os.environ["PARATUNE_HOME"] = str(cache)  # the trace store lives here (paratune.config.home.paratune_home)
    modes = tuple(args.mode or MODES)
    rows = load_corpus(cache, args.alternate, set(args.source) if args.source else None)
    if args.only:
        rows = [r for r in rows if r.id in set(args.only)]
    t0 = time.perf_counter()
    replay(rows, modes, console)
    wall = time.perf_counter() - t0
    # the bands `paratune plan` ships (presets/prediction_bands.json): the default (trace) model's
    # errors over every replayed row; both modes are judged with them, as a user of either gets them
    band_mode = "trace" if "trace" in modes else modes[0]
    bands = corpus_bands(rows, band_mode)
    summaries = {source: {mode: summarize([r for r in rows if r.source == source], mode, bands) for mode in modes}
                 for source in dict.fromkeys(r.source for r in rows)}
    loso = leave_one_source_out(rows, band_mode)
    for source, by_mode in summaries.items():
        for mode, s in by_mode.items():
            console.print(f"[bold]{source} \\[{mode}][/bold] {json.dumps(s, default=str)}")
    console.print(f"[bold]leave one source out[/bold] {json.dumps(loso, default=str)}")
    if args.no_write:
        if not args.cache:
            shutil.rmtree(cache, ignore_errors=True)
        return 0
    info = describe()
    out = Path(args.out) if args.out else RESULTS / ("published_alternate" if args.alternate else "published")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, summaries, info, modes, args.alternate, wall, cold=not args.cache, bands=bands, loso=loso)
    out.with_suffix(".md").write_text(text + "\n")
    whole = not args.only and not args.source and not args.alternate
    if whole and args.write_bands:  # the bands paratune ships come from the whole corpus only
        BANDS.write_text(json.dumps({
            "_comment": "Written by bench/published.py from the published corpus (bench/published/): per band category "
                        "(paratune.costs.bands.band_categories), the 80th percentile of |predicted / published - 1| of the "
                        f"{band_mode} model's rows and their count. Read by paratune.costs.bands.prediction_band.",
            "date": info["date"], "mode": band_mode, "gpu": bands}, indent=1) + "\n")
        console.print(f"wrote {BANDS}")
    out.with_suffix(".json").write_text(json.dumps({
        "machine": info, "alternate": args.alternate, "modes": list(modes), "wall_s": wall, "summaries": summaries,
        "bands": bands, "leave_one_source_out": loso,
        "rows": [{"source": r.source, "id": r.id, "model": r.model, "cite": r.cite, "gpus": r.gpus,
                  "device": r.device, "plan": {k: v for k, v in r.plan.items() if k != "model"} | {"model": r.model},
                  "published": r.published, "replayed": r.replay, "reason": r.reason, "predicted": r.results,
                  "errors": {mode: {"tokens_per_s_per_gpu": rel_error(res["tokens_per_s_per_gpu"],
                                                                      r.published.get("tokens_per_s_per_gpu")),
                                    "memory_gib": rel_error(res["memory_gib"], r.published.get("memory_gib"))}
                             for mode, res in r.results.items()}}
                 for r in rows]}, indent=1, default=str) + "\n")
    console.print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if not args.cache:  # the fresh folder held this run's traces only
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
