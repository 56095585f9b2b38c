"""Pretrained weights out: a trained model written as a Hugging Face folder that `from_pretrained` loads.

Every rank walks the Hugging Face module tree (the one the layout was applied to in place, so its
names are the checkpoint's names) one tensor at a time, in the same order:
- a DTensor (FSDP2 shards, tp slices, both) is gathered with `full_tensor()` over its own mesh;
- a DeepSpeed ZeRO parameter gives its fp32 master (`safe_get_full_fp32_param`: the optimizer's
  partitions all-reduced, stage 1, 2 and 3 alike), so a bf16 run still exports what it trained;
- a parameter still on the meta device belongs to another pipeline stage and is skipped.
Only the first rank of each pipeline stage (dp, cp and tp index 0) keeps the gathered values, and it
writes them in files of at most `max_shard_bytes`; rank 0 then writes `config.json` and the
safetensors index over every stage's files (shards renamed to transformers' `model-0000i-of-0000N`
once every writer's count is known), generation_config.json, and the tokenizer (the plan's data's,
or the one in the model folder it started from). So no rank ever holds more than one tensor beyond its
own share plus one file's worth, and tied parameters (the LM head tied to the embedding) are
written once, under their first name, as `save_pretrained` does. A LoRA plan's adapters are
merged into their layers' weights (W + alpha/r * B @ A, as peft's `merge_and_unload`): the
folder is the plain model, trained.

Not written (refused with the reason, the run's own checkpoint still has every value): expert
parallelism (each ep rank holds other experts under the same names) and ZeRO with DeepSpeed's
AutoTP (its tp layers are DeepSpeed's own modules).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from paratune.model.adapters import is_lora_layer
from paratune.model.checkpoints import INDEX_FILE  # the one name paratune reads weights in by, and writes them out by
from paratune.config.plan import Plan

MAX_SHARD_BYTES = 2 * 1024**3  # as save_pretrained's 5 GB default, smaller: a writer holds one file's worth


class HFExportError(ValueError):
    """A layout whose trained values cannot be written as a Hugging Face folder."""


def export_refusal(plan: Plan) -> str | None:
    """Why the plan's trained model cannot be written as a Hugging Face folder, or None."""
    if plan.ep > 1:
        return (f"ep: {plan.ep}: the Hugging Face folder is not written under expert parallelism (every ep rank "
                "holds other experts under the same names); the run's checkpoint has them")
    if plan.strategy == "zero" and plan.tp > 1:
        return (f"tp: {plan.tp} with strategy zero: DeepSpeed's AutoTP layers are its own modules; the Hugging Face "
                "folder is not written (the run's DeepSpeed checkpoint has every value)")
    return None


def _stage_and_writer(plan: Plan, rank: int) -> tuple[int, bool]:
    """(pipeline stage index, whether this rank writes it): the first rank of its stage (dp, cp and
    tp index 0) writes."""
    from paratune.parallel.dims import ParallelDims

    dims = ParallelDims(plan.dp_degree, plan.tp, plan.pp, "cpu", cp=plan.cp)  # coordinates only, no mesh
    pp_idx, dp_idx, tp_idx = dims.coords(rank)
    return pp_idx, dp_idx == 0 and tp_idx == 0 and dims.cp_rank(rank) == 0


def trained_modules(runner: Any, plan: Plan) -> list[tuple[str, nn.Module]]:
    """(checkpoint name prefix, module) of what this rank trained, named as in the Hugging Face model.

    DeepSpeed's engine wraps its own build; every other layout was applied in place to the model
    build_runner made, except that pipeline stages take its embedding, blocks, norm and head out of
    it (paratune.parallel.pp.StageModule): those are named by the model's names of those modules."""
    if hasattr(runner.model, "module") and type(runner.model).__name__ == "DeepSpeedEngine":
        return [("", runner.model.module)]
    if plan.pp == 1:
        return [("", runner.hf_model)]
    names: dict[int, str] = runner.hf_module_names
    parts: list[tuple[str, nn.Module]] = []
    for stage in runner.model:
        for child in stage.children():
            for module in (child if isinstance(child, nn.ModuleList) else [child]):
                if id(module) not in names:
                    raise HFExportError(f"pp: a stage module {type(module).__name__} has no name in the model")
                parts.append((names[id(module)], module))
    return parts


def _full_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole trained value of one parameter or buffer, on the host; None when this rank does
    not hold it (another pipeline stage's). Collective for the ranks that share it."""
    from torch.distributed.tensor import DTensor

    if tensor.is_meta:
        return None
    if hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping"):  # a DeepSpeed ZeRO parameter
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(tensor)
        if full is not None:
            return full.detach().to("cpu", torch.float32).reshape(tensor.ds_shape if hasattr(tensor, "ds_shape")
                                                                  else tensor.shape).clone()
        if hasattr(tensor, "ds_id"):  # a frozen ZeRO-3 parameter (LoRA's base): no master, gathered
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                return tensor.detach().to("cpu", torch.float32).clone()
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().cpu().clone()
    return tensor.detach().cpu().clone()


def _merged_lora(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(W + scaling * B @ A, the base bias) of a LoRA layer, whole, or (None, None) on a rank that
    does not write it: what `merge_and_unload` gives, so the folder is the plain model's."""
    weight = _full_value(module.base_layer.weight)
    bias = _full_value(module.base_layer.bias) if module.base_layer.bias is not None else None
    for adapter, scale in module.scaling.items():
        a = _full_value(module.lora_A[adapter].weight)
        b = _full_value(module.lora_B[adapter].weight)
        if weight is not None and a is not None and b is not None:
            weight = weight + scale * (b @ a)
    return weight, bias


def named_trained_tensors(parts: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(checkpoint name, whole value or None) of every parameter and persistent buffer of the
    parts, one at a time, tied parameters once; a LoRA layer's adapters merged into its weight.
    Every rank must consume it to the end (collectives)."""
    seen: set[int] = set()
    merged: list[str] = []  # LoRA layers written merged: their submodules are not walked
    for root_name, root in parts:
        for module_name, module in root.named_modules(prefix=root_name):
            if any(module_name.startswith(m + ".") for m in merged):
                continue
            prefix = f"{module_name}." if module_name else ""
            if is_lora_layer(module):
                merged.append(module_name)
                weight, bias = _merged_lora(module)
                yield prefix + "weight", weight
                if module.base_layer.bias is not None:
                    yield prefix + "bias", bias
                continue
            for attr, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                yield prefix + attr, _full_value(param)
            for attr, buf in module._buffers.items():
                if buf is None or attr in module._non_persistent_buffers_set or id(buf) in seen:
                    continue
                seen.add(id(buf))
                yield prefix + attr, _full_value(buf)


def export_hf_folder(parts: list[tuple[str, nn.Module]], config: Any, plan: Plan, rank: int, folder: str | Path,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the trained `parts` (`trained_modules`: the Hugging Face model as laid out) as a folder
    `AutoModelForCausalLM.from_pretrained` loads. Collective: every rank of the run calls it.
    Raises HFExportError for a layout `export_refusal` names."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    refusal = export_refusal(plan)
    if refusal is not None:
        raise HFExportError(refusal)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stage, writer = _stage_and_writer(plan, rank)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes, part, total_bytes = 0, 0, 0

    def flush() -> None:
        nonlocal pending, pending_bytes, part
        if not pending:
            return
        name = _staged_name(stage, part)
        save_file(pending, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in pending})
        pending, pending_bytes, part = {}, 0, part + 1

    for name, value in named_trained_tensors(parts):
        if value is None or not writer:
            continue
        pending[name] = value.contiguous()
        size = value.numel() * value.element_size()
        pending_bytes += size
        total_bytes += size
        if pending_bytes >= max_shard_bytes:
            flush()
    flush()
    maps: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    if dist.is_initialized():
        dist.all_gather_object(maps, (weight_map, total_bytes))
    else:
        maps = [(weight_map, total_bytes)]
    names = _final_names(maps)  # every rank computes the same: staged name -> transformers' name
    for staged in sorted(set(weight_map.values())):  # each writer renames its own files
        (folder / staged).rename(folder / names[staged])
    if rank == 0:
        merged = {k: names[v] for wm, _ in maps for k, v in wm.items()}
        size = sum(b for _, b in maps)
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": size},
                                                     "weight_map": dict(sorted(merged.items()))}, indent=2))
        _save_config(config, folder)
        save_tokenizer(plan, folder)
    if dist.is_initialized():
        dist.barrier()
    return folder


def _staged_name(stage: int, part: int) -> str:
    """A shard's name while the writers cannot know how many there are (one writer a stage)."""
    return f"model-pp{stage:02d}-{part:05d}.safetensors"


def _final_names(maps: list[Any]) -> dict[str, str]:
    """Staged shard names -> transformers' own (`model-00001-of-00003.safetensors`, as
    save_pretrained shards), numbered in stage order, from every rank's weight map."""
    staged = sorted({name for weight_map, _ in maps for name in weight_map.values()})
    return {name: f"model-{i:05d}-of-{len(staged):05d}.safetensors" for i, name in enumerate(staged, 1)}


def _save_config(config: Any, folder: Path) -> None:
    """config.json as `save_pretrained` writes it, with the dtype of the values written (fp32) and
    the architecture, so `AutoModelForCausalLM` picks the class paratune trained; and
    generation_config.json, as `save_pretrained` writes it beside a causal LM (what `generate` and
    `pipeline` read)."""
    from transformers import GenerationConfig

    from paratune.model.materialize import causal_lm_class

    config = config.__class__.from_dict(config.to_dict())
    config.architectures = [causal_lm_class(config).__name__]
    config.dtype = "float32"
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)


def tokenizer_source(plan: Plan) -> Path | None:
    """The tokenizer that belongs with the trained model: the one the plan's data names, else the
    one in the model folder it started from; None with neither (byte-level data, a preset)."""
    if plan.data.tokenizer is not None:
        return Path(plan.data.tokenizer)
    folder = Path(plan.model)
    if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "tokenizer.model", "vocab.json")):
        return folder
    return None


def save_tokenizer(plan: Plan, folder: Path) -> Path | None:
    """The tokenizer files beside the weights, as `tokenizer.save_pretrained` writes them, so
    `AutoTokenizer.from_pretrained(folder)` and `pipeline` load the folder as a hub checkpoint."""
    source = tokenizer_source(plan)
    if source is None:
        return None
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(folder)
    return source
