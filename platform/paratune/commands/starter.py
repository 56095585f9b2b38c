"""`paratune init`: a starter search space for a model and the hardware at hand, each choice commented.

The model is a preset, a Hugging Face folder (weights required) or a config.json; the hardware is
the device table's entry x a GPU count (`--device`, `--gpus`), the running Ray cluster's (RAY_ADDRESS),
or this machine's (its GPUs, else 2 CPU workers). A draft space of the layouts that make sense
there (strategies, tp within a node, micro-batches, checkpointing, the levers the device runs) is
predicted with paratune's cost model, and only the values that lead to at least one plan that fits
are written, each with why; what was dropped says why too. `plan` and `tune` run the file as written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LORA = {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
CPU_WORKERS = 2


class InitError(ValueError):
    """What `paratune init` cannot make a space for (the model, the hardware, nothing fits)."""


@dataclass(frozen=True)
class Hardware:
    """Where the space will run: a device table entry, how many of them, per node, and how it was found."""

    device: str
    workers: int
    gpus_per_node: int | None
    where: str

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"


def find_hardware(device: str | None = None, gpus: int | None = None, devices_file: str | None = None) -> Hardware:
    """--device / --gpus as given; else the running Ray cluster's GPUs (RAY_ADDRESS); else this machine's."""
    from paratune.config.devices import get_device

    if device is not None:
        entry = get_device(device, devices_file)
        if entry.name == "cpu":
            return Hardware("cpu", gpus or CPU_WORKERS, None, "--device cpu")
        count = gpus or entry.gpus_per_node
        return Hardware(entry.name, count, min(count, entry.gpus_per_node), f"--device {entry.name}"
                        + (f" --gpus {gpus}" if gpus else f" (one node: {count} GPUs)"))
    if os.environ.get("RAY_ADDRESS", "local") not in ("", "local"):
        import ray

        from paratune.config.devices import device_for_cluster
        from paratune.cluster.launch import ensure_ray

        ensure_ray()
        resources = ray.cluster_resources()
        count = gpus or int(resources.get("GPU", 0))
        if count:
            entry = device_for_cluster("auto", resources, count)
            return Hardware(entry.name, count, min(count, entry.gpus_per_node), f"the running Ray cluster ({count} GPUs)")
        return Hardware("cpu", gpus or CPU_WORKERS, None, "the running Ray cluster (no GPU)")
    import torch

    if torch.cuda.is_available():
        from paratune.config.devices import gpu_model, load_devices

        model = gpu_model(torch.cuda.get_device_name())
        entry = next((d for d in load_devices(devices_file).values() if model and d.gpu == model.key), None)
        if entry is None:
            raise InitError(f"device: this machine's GPU ({torch.cuda.get_device_name()}) is not in the device table; "
                            "allowed: --device NAME (paratune plan --devices FILE adds one)")
        count = gpus or torch.cuda.device_count()
        return Hardware(entry.name, count, min(count, entry.gpus_per_node), f"this machine ({count} x {entry.name})")
    return Hardware("cpu", gpus or CPU_WORKERS, None, f"this machine (no GPU: {gpus or CPU_WORKERS} CPU workers, gloo)")


def data_spec(path: str | None, text_field: str | None, model: str) -> dict[str, Any] | None:
    """The data section for a local file (kind from its suffix; the text field named, or the first
    string field of the first record), with the model folder's tokenizer where it has one."""
    if path is None:
        return None
    file = Path(path).resolve()
    kind = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(file.suffix, "text")
    spec: dict[str, Any] = {"kind": kind, "path": str(file)}
    if kind == "jsonl" and text_field is None and file.is_file():
        with file.open() as lines:
            first = next((json.loads(line) for line in lines if line.strip()), {})
        text_field = next((k for k, v in first.items() if isinstance(v, str)), None)
    if text_field:
        spec["text_field"] = text_field
    folder = Path(model)
    if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        spec["tokenizer"] = str(folder.resolve())
    return spec


@dataclass
class Draft:
    """The space as it will be written, and a comment per key."""

    fixed: dict[str, Any]
    space: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)
    estimates: list = field(default_factory=list)
    budget: float | None = None  # GiB per GPU the objective allows


def draft(model: str, hw: Hardware, lora: bool, data: dict | None, seq_len: int | None) -> Draft:
    """Every layout worth trying on this hardware, before the cost model has its say."""
    from paratune.config.sizes import config_sizes
    from paratune.config.model_config import load_config_dict

    config = load_config_dict(model)
    sizes = config_sizes(config)
    heads, kv = sizes.heads, sizes.kv_heads
    longest = int(sizes.max_positions or 2048)
    seq = seq_len or min(longest, 4096 if hw.on_gpu else 128)
    fixed: dict[str, Any] = {"model": str(Path(model).resolve()) if Path(model).exists() else model,
                             "seq_len": seq, "global_batch": 8 * hw.workers if hw.on_gpu else 8,
                             "num_workers": hw.workers, "precision": "bf16" if hw.on_gpu else "fp32",
                             "device": "cuda" if hw.on_gpu else "cpu", "warmup_steps": 3 if hw.on_gpu else 1,
                             "measure_steps": 10 if hw.on_gpu else 4}
    if hw.gpus_per_node:
        fixed["gpus_per_node"] = hw.gpus_per_node
    if lora:
        fixed["peft"] = dict(LORA)
    if data:
        fixed["data"] = data
    zero_buckets = {} if hw.on_gpu else {"reduce_bucket_size": [(sizes.hidden or 64) ** 2],
                                          "allgather_bucket_size": [(sizes.hidden or 64) ** 2]}
    space: dict[str, Any] = {
        "strategy": {"ddp": {}, "fsdp": {"sharding": ["full", "grad_op"] if hw.on_gpu else ["full"]},
                     "zero": {"stage": [2, 3], **zero_buckets}},
        "micro_batch": [1, 2, 4, 8] if hw.on_gpu else [1, 2, 4],
        "activation_checkpointing": ["none", "selective", "full"] if hw.on_gpu else ["none", "full"],
    }
    node = hw.gpus_per_node or 1
    tps = [t for t in (1, 2, 4, 8) if t <= node and hw.workers % t == 0 and heads % t == 0 and kv % t == 0]
    if len(tps) > 1:
        space["tp"] = tps
    if hw.on_gpu and not lora:
        space["compile"] = [False, True]
    return Draft(fixed, space)


def prune(d: Draft, hw: Hardware, devices_file: str | None = None) -> Draft:
    """Keep the values the cost model says lead to a plan that fits, and say why each went."""
    from paratune.config.devices import get_device
    from paratune.costs.estimate import estimate_space
    from paratune.sweep.space import space_from_dict
    from paratune.out.tables import strategy_label

    device = get_device(hw.device, devices_file)
    budget = round(device.memory_gib * 0.95, 1) if hw.on_gpu else None
    space = space_from_dict({"name": "init", "fixed": d.fixed, "space": d.space,
                             **({"objective": {"memory_budget_gb": budget}} if budget else {})})
    estimates = estimate_space(space, device, capacity_gib=budget)
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        smallest = min(estimates, key=lambda e: e.memory.total) if estimates else None
        why = f"; the smallest, {strategy_label(smallest.plan.to_dict())}: {smallest.overflow}" if smallest else ""
        raise InitError(f"no plan of {d.fixed['model']} fits {hw.workers} x {hw.device}{why}; allowed: more GPUs "
                        "(--gpus), a larger device (--device), or --lora")
    d.estimates = estimates
    plans = [e.plan for e in fitting]
    kept_strategies: dict[str, Any] = {}
    for name, options in d.space["strategy"].items():
        mine = [p for p in plans if p.strategy == name]
        if not mine:
            worst = next((e for e in estimates if e.plan.strategy == name), None)
            d.notes[f"strategy.{name}"] = (f"dropped: {worst.overflow}" if worst is not None and worst.overflow
                                           else "dropped: no valid plan")
            continue
        kept_options = {}
        for knob, values in options.items():
            keep = [v for v in values if any(getattr(getattr(p, name), knob) == v for p in mine)]
            kept_options[knob] = keep or values[:1]
        kept_strategies[name] = kept_options
    d.space["strategy"] = kept_strategies
    for knob in [k for k in d.space if k != "strategy"]:
        values = d.space[knob]
        keep = [v for v in values if any(getattr(p, knob) == v for p in plans)]
        dropped = [v for v in values if v not in keep]
        d.space[knob] = keep
        if dropped:
            d.notes[knob] = f"{', '.join(map(str, dropped))} dropped: no plan with it fits"
    best = fitting[0]
    d.notes["best"] = (f"predicted fastest: {strategy_label(best.plan.to_dict())}, "
                       f"{best.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {_size(best.memory.total)} a rank")
    d.budget = budget
    return d


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def render(d: Draft, hw: Hardware, name: str) -> str:
    """The space file: fixed part, what is swept, the objective and the search, each choice commented."""
    import yaml

    budget = d.budget

    def dump(value: Any) -> str:
        text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
        return text.removesuffix("...").strip()  # a scalar's document end marker

    fitting = sum(e.fits for e in d.estimates)
    lines = [f"# Made by `paratune init` for {hw.workers} x {hw.device} ({hw.where}).",
             f"# The cost model predicted {len(d.estimates)} plans of the draft; {fitting} fit. {d.notes.get('best', '')}.",
             "# `paratune plan` on this file shows them all; `paratune tune` measures them. Edit freely: every",
             "# value left here leads to at least one plan predicted to fit.",
             f"name: {name}", f"description: a starter space for {Path(str(d.fixed['model'])).name}", "fixed:"]
    why = {"model": "a preset, a model folder (its weights are the starting point) or a config.json",
           "seq_len": "tokens per sequence (the model's window, capped)",
           "global_batch": "sequences per optimizer step: the training's meaning, the same in every plan",
           "num_workers": "one per GPU" if hw.on_gpu else "CPU processes (gloo)",
           "precision": "bf16 on GPUs; fp32 on CPU (bf16 matmuls are slow there)",
           "peft": "LoRA: the base frozen, rank-16 adapters on every linear (the training's meaning)",
           "data": "your data (relative paths are read from this file's folder)"}
    for key, value in d.fixed.items():
        lines.append(f"  {key}: {dump(value)}" + (f"  # {why[key]}" if key in why else ""))
    if budget:
        lines += ["objective:", "  metric: tokens_per_s_per_gpu",
                  f"  memory_budget_gb: {budget}  # per GPU: 95% of {hw.device}'s memory (fragmentation headroom)"]
    lines.append("space:")
    lines.append("  strategy:")
    for strategy, options in d.space["strategy"].items():
        lines.append(f"    {strategy}:" + ("" if options else " {}"))
        for knob, values in options.items():
            lines.append(f"      {knob}: {dump(values)}")
    for strategy in ("ddp", "fsdp", "zero"):
        if f"strategy.{strategy}" in d.notes:
            lines.append(f"    # {strategy} {d.notes[f'strategy.{strategy}']}")
    for knob, values in d.space.items():
        if knob == "strategy":
            continue
        note = d.notes.get(knob)
        lines.append(f"  {knob}: {dump(values)}" + (f"  # {note}" if note else ""))
    lines += ["search:", "  algorithm: calibrated  # profile, measure the predicted fastest, stop when none left can win",
              f"  trials: {16 if hw.on_gpu else 8}", "  seed: 0"]
    return "\n".join(lines) + "\n"


def starter_space(model: str, hw: Hardware, lora: bool = False, data: str | None = None,
                  text_field: str | None = None, seq_len: int | None = None, devices_file: str | None = None) -> str:
    """The starter space's YAML text (InitError when the model or hardware cannot make one)."""
    from paratune.config.model_config import ModelError

    try:
        d = prune(draft(model, hw, lora, data_spec(data, text_field, model), seq_len), hw, devices_file)
    except ModelError as err:
        raise InitError(str(err)) from None
    name = f"{Path(model).name if Path(model).exists() else model}{'-lora' if lora else ''}-{hw.workers}x{hw.device}"
    return render(d, hw, name)
