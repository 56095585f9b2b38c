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
    reason: str = ""
    # the architecture whose training share this row sets (paratune.costs.efficiency.REFERENCE_RUNS):
    # replayed and shown, judging nothing
    reference: str | None = None  # why it is not replayed (a row marked so, or the plan paratune refuses)
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
                            replay=raw.get("replay", True), reason=raw.get("reason", ""),
                            reference=raw.get("reference")))
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

    if "tflops_per_gpu" in row.published and "tokens_per_s_per_gpu" not in row.published:
        # the source's FLOPs a token: 6 N (N with the embeddings) + 12 L h s (attention not halved)
        per_token = 6 * shape.total + 12 * shape.layers * shape.hidden * plan.seq_len
        row.published["tokens_per_s_per_gpu"] = round(row.published["tflops_per_gpu"] * 1e12 / per_token, 1)

    return {
        "tokens_per_s_per_gpu": est.time.tokens_per_s_per_gpu,
        "memory_gib": est.memory.total / GiB,
        "reserved_gib": est.reserved_bytes / GiB,
        "device_memory_gib": est.device_bytes / GiB,
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


def judged_rows(rows: list[Row], mode: str) -> list[Row]:
    """The rows that judge the model in `mode`: replayed, and not an architecture's reference run
    (a row that set a term judges nothing)."""
    return [r for r in rows if mode in r.results and r.reference is None]


def kind_sources(rows: list[Row], mode: str, kind: str) -> list[str]:
    """The sources whose judging rows are of a band kind (one: the kind's band has met no other's)."""
    return sorted({r.source for r in judged_rows(rows, mode) if kind in r.results[mode]["categories"]
                   and r.published.get("tokens_per_s_per_gpu")})


def corpus_bands(rows: list[Row], mode: str, sources: set[str] | None = None) -> dict[str, dict]:
    """The error bands of `sources`' replayed rows (all sources: None): per band category
    (paratune.costs.bands.band_categories), the 80th percentile of |error| and the rows behind it, for
    tokens/s/GPU and for memory where published."""
    from paratune.costs.bands import bands_from_errors

    tokens, memory = [], []
    for r in judged_rows(rows, mode):
        if sources is not None and r.source not in sources:
            continue
        res = r.results[mode]
        for key, out in (("tokens_per_s_per_gpu", tokens), ("memory_gib", memory)):
            if key == "memory_gib" and memory_other_implementation(r) is not None:
                continue  # another implementation's memory judges no band
            e = rel_error(res["reserved_gib" if key == "memory_gib" else key], r.published.get(key))
            if e is not None:
                out.append((res["categories"], e))
    return {"tokens": bands_from_errors(tokens), "memory": bands_from_errors(memory)}


def judge(res: dict[str, Any], bands: dict[str, dict]) -> tuple[str, float, float]:
    """(memory verdict, tokens band, memory band) of a replayed row: the tokens band from `bands`
    (a corpus table), the memory band the one `paratune plan` printed for it (paratune's own
    measured peaks and the named CUDA terms: paratune.costs.bands; no corpus row sets it); the
    verdict fits, tight (within the memory band of the capacity: a sweep measures it) or over
    (rejected)."""
    from paratune.costs.bands import CPU_BANDS, memory_verdict, pick_band

    tokens_band, _ = pick_band(bands.get("tokens", {}), res["categories"], CPU_BANDS["tokens"])
    memory_band = res["band_memory"] if res.get("band_memory") is not None else CPU_BANDS["memory"]
    if res.get("refused"):
        return "over", tokens_band, memory_band
    verdicts = {memory_verdict(g, res["capacity_gib"], memory_band) for g in (res["device_memory_gib"],
                                                                            res["construction_gib"])}
    verdict = "over" if "over" in verdicts else "tight" if "tight" in verdicts else "fits"
    return verdict, tokens_band, memory_band


def memory_other_implementation(row: Row) -> str | None:
    """Why a row's published memory is not paratune's code measured elsewhere ("another
    implementation"), else None (like for like: it judges the memory model). Such a row still
    counts for false rejections, and judges no memory figure."""
    p = row.plan
    if row.source == "llm-foundry":
        return "Composer's FSDP1 and MPT code, no memory published"
    if p.get("activation_checkpointing") == "selective":
        return ("torchtitan's op-level SAC keeps every second matmul, paratune's `selective` every one "
                "(replayed like for like as `selective_op` where the lever has it)")
    if p.get("pp", 1) > 1:
        return "torchtitan keeps the logits vocab-sharded under pp; paratune gathers them there (a layout it lacks)"
    return None


def summarize(rows: list[Row], mode: str, bands: dict[str, dict] | None = None) -> dict[str, Any]:
    """Median and worst |error| of tokens/s/GPU and memory, tau per model, false rejections (a
    run that ran, judged `over` under `bands`: beyond the memory band of the capacity), tight
    rows, and the share of rows whose error lies within their band."""
    done = judged_rows(rows, mode)
    tps = [(r, rel_error(r.results[mode]["tokens_per_s_per_gpu"], r.published.get("tokens_per_s_per_gpu")))
           for r in done]
    tps = [(r, e) for r, e in tps if e is not None]
    mem = [(r, rel_error(r.results[mode]["reserved_gib"], r.published.get("memory_gib"))) for r in done
           if memory_other_implementation(r) is None]
    mem = [(r, e) for r, e in mem if e is not None]
    out: dict[str, Any] = {"rows": len(done), "not_replayed": sum(not r.replay for r in rows),
                           "memory_other_implementation": sum(bool(r.published.get("memory_gib"))
                                                              and memory_other_implementation(r) is not None
                                                              for r in done)}
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


def device_of(row: Row) -> str:
    """The device a row ran on, as leave-one-device-out groups rows: its GPU model with its memory
    ("a100 80 GiB", "h100-sxm 96 GiB"): a 96 GB 500 W H100 is another device than an 80 GB one."""
    from paratune.config.devices import get_device

    d = get_device(row.device, str(ROOT / row.devices_file) if row.devices_file else None)
    return f"{d.gpu or d.name} {d.memory_gib:g} GiB"


GROUPINGS = {"source": lambda r: r.source, "device": device_of}


def held_out(rows: list[Row], mode: str, by: str, factor: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Leave one group out (`by`: "source" or "device"): each group's rows judged with the bands
    built from the other groups' rows only (x `factor`, per "tokens" / "memory": the widening the
    shipped bands carry), every time-model term as it is (none is fitted to any corpus row: each
    names its source in paratune.costs.efficiency). Per group: median / worst |error| and the
    median signed one of tokens/s/GPU and memory, band coverage (share of rows within the band
    judged), false rejections, tight rows. A group with no other group beside it is judged with no
    corpus band at all (the CPU fallback), which says so."""
    group = GROUPINGS[by]
    done = judged_rows(rows, mode)
    groups = sorted({group(r) for r in done})
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        others = [r for r in done if group(r) != g]
        built = corpus_bands(others, mode)
        bands = {**built, "tokens": scaled_kinds(built["tokens"], factor or 1.0)}
        mine = [r for r in done if group(r) == g]
        s = summarize(mine, mode, bands)
        out[g] = {"built_with": sorted({group(r) for r in others}), "rows": len(mine),
                  **{k: s.get(k) for k in ("tokens_median_abs", "tokens_worst", "tokens_worst_row",
                                           "tokens_median_signed", "tokens_within_band", "memory_rows",
                                           "memory_median_abs", "memory_worst", "memory_within_band")},
                  "false_rejections": s["false_rejections"], "tight": s["tight"],
                  "bands_all": {k: v.get("all") for k, v in bands.items()}}
    return out


def held_out_errors(rows: list[Row], mode: str, what: str = "tokens") -> list[tuple[Row, float, dict]]:
    """(row, its error, the band table of the rows that share neither its source nor its device)
    for every judging row with a published figure: each row as a band would meet it unseen."""
    key = "tokens_per_s_per_gpu" if what == "tokens" else "memory_gib"
    pred = "tokens_per_s_per_gpu" if what == "tokens" else "reserved_gib"
    judged = judged_rows(rows, mode)
    out = []
    for r in judged:
        if not r.published.get(key) or (what == "memory" and memory_other_implementation(r) is not None):
            continue
        others = [o for o in judged if o.source != r.source and device_of(o) != device_of(r)]
        out.append((r, rel_error(r.results[mode][pred], r.published[key]), corpus_bands(others, mode).get(what, {})))
    return out


def held_out_coverage(rows: list[Row], mode: str, factors: dict[str, float] | float, what: str = "tokens",
                      kind: str | None = None, errors: list[tuple[Row, float, dict]] | None = None) -> float:
    """The share of rows (of one band `kind`, else all) within the band they get when neither their
    source nor their device built it (`held_out_errors`, or `errors` already made), each kind's
    band x its factor."""
    from paratune.costs.bands import CPU_BANDS, pick_band

    hits = []
    for r, error, table in errors if errors is not None else held_out_errors(rows, mode, what):
        categories = r.results[mode]["categories"]
        if kind is not None and kind not in categories:
            continue
        scaled = scaled_kinds(table, factors)
        band, _ = pick_band(scaled, categories, CPU_BANDS[what])
        hits.append(abs(error) <= band)
    return sum(hits) / len(hits) if hits else math.nan


def scaled_kinds(table: dict[str, dict], factors: dict[str, float] | float) -> dict[str, dict]:
    """A {kind: {"band", "rows"}} table with each kind's band x its factor (one number: all)."""
    return {c: {**v, "band": v["band"] * (factors if isinstance(factors, (int, float)) else factors.get(c, 1.0))}
            for c, v in table.items()}


# The widenings tried for the bands, from 1 up, until rows they have not seen fall within them as
# often as a band says (PERCENTILE).
FACTORS = tuple(round(1 + 0.05 * i, 2) for i in range(0, 81))


def out_of_sample_factor(rows: list[Row], mode: str, what: str = "tokens") -> dict[str, Any]:
    """The smallest widening in FACTORS under which the rows, each judged by the bands of the rows
    that share neither its source nor its device (`held_out_errors`), fall within their band
    PERCENTILE of the time (the largest tried when none does); and at it, the coverage of each
    band kind's rows: {"factor", "coverage", "coverage_unwidened", "kinds": {kind: {"rows",
    "coverage"}}}. One factor for every kind: a kind seen in one source only is judged unseen by
    the other sources' general band, which says nothing about it but its spread."""
    from paratune.costs.bands import PERCENTILE

    errors = held_out_errors(rows, mode, what)
    factor = FACTORS[-1]
    for f in FACTORS:
        cov = held_out_coverage(rows, mode, f, what, errors=errors)
        if not math.isnan(cov) and cov >= PERCENTILE:
            factor = f
            break
    kinds: dict[str, int] = {}
    for r, _, _ in errors:
        for c in r.results[mode]["categories"]:
            kinds[c] = kinds.get(c, 0) + 1
    return {"factor": factor, "coverage": held_out_coverage(rows, mode, factor, what, errors=errors),
            "coverage_unwidened": held_out_coverage(rows, mode, 1.0, what, errors=errors),
            "kinds": {c: {"rows": n, "coverage": held_out_coverage(rows, mode, factor, what, c, errors)}
                      for c, n in sorted(kinds.items(), key=lambda kv: (kv[0] != "all", -kv[1], kv[0]))}}


# --------------------------------------------------------------------------- the outputs
def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.0f}%"


def _abs_pct(x: float | None) -> str:
    return "-" if x is None else f"{abs(x) * 100:.0f}%"


def markdown(rows: list[Row], summaries: dict[str, dict[str, dict[str, Any]]], info: dict[str, str],
             modes: tuple[str, ...], alternate: bool, wall_s: float, cold: bool,
             bands: dict[str, dict] | None = None, oos: dict[str, Any] | None = None,
             in_sample: dict[str, dict] | None = None) -> str:
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
             "GiB; paratune's reserved = its tensors' peak + cuBLAS's workspace (paratune.costs.cuda_memory; "
             "the CUDA context and NCCL's buffers, outside the allocator, count against the capacity). Bands: "
             "tokens, the 80th percentile of |error| over the corpus's rows of a plan's kind, widened to hold "
             "out of sample; memory, paratune's own measured peaks (paratune.costs.bands; `paratune plan` prints them). "
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
        from paratune.costs.bands import GPU_MEMORY_BAND

        lines += ["## Bands (presets/prediction_bands.json: what `paratune plan` prints)", "",
                  "| category | tokens/s/GPU band (shipped) | in sample | rows | published memory rows like for like: "
                  "80th percentile abs err (judges, sets nothing) | rows |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        cats = sorted(set(bands.get("tokens", {})) | set(bands.get("memory", {})), key=lambda c: (c != "all", c))
        for c in cats:
            t, m = bands.get("tokens", {}).get(c, {}), bands.get("memory", {}).get(c, {})
            t0 = (in_sample or {}).get("tokens", {}).get(c, {})
            lines.append(f"| {c} | {_abs_pct(t.get('band'))} | {_abs_pct(t0.get('band'))} | {t.get('rows', 0)} | "
                         f"{_abs_pct(m.get('band'))} | {m.get('rows', 0)} |")
        lines += ["", "A plan's tokens band: the widest of its categories with at least 4 rows "
                  f"(paratune.costs.bands.MIN_ROWS). Every GPU plan's memory band: {GPU_MEMORY_BAND:.0%} "
                  "(paratune's own measured peaks; the CUDA context, NCCL buffers and cuBLAS workspace are named "
                  "terms of the prediction: paratune.costs.cuda_memory).", ""]
    if oos:
        lines += ["## Out of sample: each device and each source judged by what it did not set", "",
                  "No time-model term is set from a judging row: each names its public source in "
                  "paratune/costs/efficiency.py, and an architecture's training share comes from one `reference` "
                  "run that judges nothing. What the corpus sets is the tokens bands, so here each group's rows are "
                  "judged with the bands of the other groups' rows only (x the shipped widening). Memory bands come "
                  "from paratune's own measured peaks (paratune.costs.bands.GPU_MEMORY_BAND); published memory "
                  "judges only like-for-like rows.", "",
                  f"Shipped tokens bands: the corpus's 80th percentile per kind x **{oos['factor']:.2f}**, the smallest "
                  "widening under which rows, each judged by the bands of the rows that share neither its source nor "
                  f"its device, fall within their band 80% of the time: {_abs_pct(oos['coverage'])} so judged "
                  f"({_abs_pct(oos['coverage_unwidened'])} unwidened). By kind (a kind seen in one source only is "
                  "judged by the others' general band):", "",
                  "| kind | rows judged unseen | within the band they get |", "| --- | ---: | ---: |"]
        for kind, v in oos["kinds"].items():
            lines.append(f"| {kind} | {v['rows']} | {_abs_pct(v['coverage'])} |")
        lines.append("")
        for what in ("by_device", "by_source"):
            for mode, table in oos[what].items():
                lines += [f"### Leave one {what[3:]} out ({mode})", "",
                          f"| judged {what[3:]} | rows | bands built with | tokens/s/GPU median abs err | median signed | "
                          "worst | within band | memory rows (like for like) | memory median abs err | worst | "
                          "memory within band | false rejections | tight |",
                          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
                for g, v in table.items():
                    lines.append(
                        f"| {g} | {v['rows']} | {', '.join(v['built_with']) or '- (CPU fallback)'} | "
                        f"{_abs_pct(v.get('tokens_median_abs'))} | {_pct(v.get('tokens_median_signed'))} | "
                        f"{_pct(v.get('tokens_worst'))} ({v.get('tokens_worst_row') or '-'}) | "
                        f"{_abs_pct(v.get('tokens_within_band'))} | {v.get('memory_rows') or 0} | "
                        f"{_abs_pct(v.get('memory_median_abs'))} | {_pct(v.get('memory_worst'))} | "
                        f"{_abs_pct(v.get('memory_within_band'))} | {len(v['false_rejections'])} | {len(v['tight'])} |")
                lines.append("")
    refs = [r for r in rows if r.reference and r.results]
    if refs:
        lines += ["## Reference runs (they set a term, judge nothing)", "",
                  "| row | sets | published tok/s/GPU | trace | err |", "| --- | --- | ---: | ---: | ---: |"]
        for r in refs:
            t = r.results.get("trace") or next(iter(r.results.values()))
            pub = r.published.get("tokens_per_s_per_gpu")
            lines.append(f"| {r.id} | TRAINING_SHARE[{r.reference}] | {pub} | {t['tokens_per_s_per_gpu']:,.0f} | "
                         f"{_pct(rel_error(t['tokens_per_s_per_gpu'], pub))} |")
        lines.append("")
    for source in summaries:
        lines += [f"## {source}: every row", "",
                  "| row | model | GPUs | plan | published tok/s/GPU | trace | err | formula | err | published GiB | "
                  "trace reserved GiB | err | formula reserved GiB | err | memory verdict (trace/formula) | peak moment (trace) "
                  "| s (trace) |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| --- | --- | ---: |"]
        for r in [r for r in rows if r.source == source and r.results]:
            t, f = r.results.get("trace", {}), r.results.get("formula", {})
            pub_t, pub_m = r.published.get("tokens_per_s_per_gpu"), r.published.get("memory_gib")

            def cell(res: dict[str, Any], key: str, fmt: str) -> str:
                return format(res[key], fmt) if res else "-"

            def mem_err(res: dict[str, Any]) -> str:
                if not res or not pub_m:
                    return "-"
                other = " (another implementation)" if memory_other_implementation(r) else ""
                return _pct(rel_error(res["reserved_gib"], pub_m)) + other

            lines.append(
                f"| {r.id} | {r.model} | {r.gpus} | {_plan_label(r)} | {pub_t} | "
                f"{cell(t, 'tokens_per_s_per_gpu', ',.0f')} | "
                f"{_pct(rel_error(t['tokens_per_s_per_gpu'], pub_t)) if t else '-'} | "
                f"{cell(f, 'tokens_per_s_per_gpu', ',.0f')} | "
                f"{_pct(rel_error(f['tokens_per_s_per_gpu'], pub_t)) if f else '-'} | {pub_m if pub_m else '-'} | "
                f"{cell(t, 'reserved_gib', '.1f')} | {mem_err(t)} | "
                f"{cell(f, 'reserved_gib', '.1f')} | {mem_err(f)} | "
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
        parts.append({"selective": "sac", "selective_op": "sac/op", "full": "ac", "layers": "ac-layers"}.get(ac, ac))
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
    # the tokens bands `paratune plan` ships: the corpus's per kind, widened until rows of another
    # source on another device fall within the band they get as often as it says (held_out_coverage)
    widening = out_of_sample_factor(rows, band_mode)
    factor = widening["factor"]
    in_sample = corpus_bands(rows, band_mode)
    bands = {**in_sample, "tokens": scaled_kinds(in_sample["tokens"], factor)}
    summaries = {source: {mode: summarize([r for r in rows if r.source == source], mode, bands) for mode in modes}
                 for source in dict.fromkeys(r.source for r in rows)}
    by_device = {mode: held_out(rows, mode, "device", factor) for mode in modes}
    by_source = {mode: held_out(rows, mode, "source", factor) for mode in modes}
    oos = {**widening, "by_device": by_device, "by_source": by_source}
    for source, by_mode in summaries.items():
        for mode, s in by_mode.items():
            console.print(f"[bold]{source} \\[{mode}][/bold] {json.dumps(s, default=str)}")
    console.print(f"[bold]out of sample[/bold] {json.dumps(oos, default=str)}")
    if args.no_write:
        if not args.cache:
            shutil.rmtree(cache, ignore_errors=True)
        return 0
    info = describe()
    out = Path(args.out) if args.out else RESULTS / ("published_alternate" if args.alternate else "published")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, summaries, info, modes, args.alternate, wall, cold=not args.cache, bands=bands, oos=oos,
                    in_sample=in_sample)
    out.with_suffix(".md").write_text(text + "\n")
    whole = not args.only and not args.source and not args.alternate
    if whole and args.write_bands:  # the bands paratune ships come from the whole corpus only
        BANDS.write_text(json.dumps({
            "_comment": "Written by bench/published.py from the published corpus (bench/published/): per band category "
                        "(paratune.costs.bands.band_categories), the 80th percentile of |predicted / published - 1| of the "
                        f"{band_mode} model's tokens/s/GPU (in_sample) x out_of_sample_factor (band), and the rows. "
                        "Memory bands are not read from here (paratune.costs.bands.GPU_MEMORY_BAND). "
                        "Read by paratune.costs.bands.prediction_band.",
            "date": info["date"], "mode": band_mode, "out_of_sample_factor": factor,
            "out_of_sample_coverage": oos["coverage"],
            "gpu": {"tokens": {c: {"band": v["band"], "in_sample": in_sample["tokens"][c]["band"], "rows": v["rows"],
                                   "sources": kind_sources(rows, band_mode, c)}
                               for c, v in bands["tokens"].items()}}}, indent=1) + "\n")
        console.print(f"wrote {BANDS}")
    out.with_suffix(".json").write_text(json.dumps({
        "machine": info, "alternate": args.alternate, "modes": list(modes), "wall_s": wall, "summaries": summaries,
        "bands": bands, "bands_in_sample": in_sample, "out_of_sample": oos,
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
