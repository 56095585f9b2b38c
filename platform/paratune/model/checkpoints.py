"""Pretrained weights in: a local Hugging Face folder's safetensors as a ModelInit value source.

A plan's `model` may be a folder with config.json; when that folder also holds safetensors
weights, every layout starts from them instead of random init. The values go through the same
path as random init (paratune.model.materialize): the host makes one module's full values at a time
(here: reads them from the checkpoint) and each rank copies its own slice, so no process ever
loads the whole file and every layout holds exactly the reference's values.

Only checkpoints whose keys are the model's own parameter names are read. transformers 5
converts some families' keys when it loads them (MoE experts saved one per expert, fused into
one tensor in the module): those are refused with the missing names, never filled at random.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratune.config.model_config import PRESET_DIR, ModelError
from paratune.model.build import build_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# peft wraps an adapted layer: the original layer's parameters live under `.base_layer`, and the
# adapter's own modules (never in a base checkpoint) under these names.
PEFT_BASE = "base_layer"
PEFT_ADAPTER_PREFIXES = ("lora_",)


class CheckpointError(ModelError):
    """A checkpoint that cannot give the model its weights (missing keys, wrong shapes)."""


def has_weights(folder: str | Path) -> bool:
    """A folder with config.json and safetensors weights (what a pretrained plan starts from)."""
    path = Path(folder)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def weights_folder(model: str) -> Path | None:
    """The folder a plan's `model` loads weights from, or None (a preset, or a config.json path:
    architecture only, random init)."""
    if (PRESET_DIR / f"{model}.json").is_file():
        return None
    return Path(model) if has_weights(model) else None


class CheckpointSource:
    """`ValueSource` over a local folder's safetensors: one module's tensors per call, read lazily.

    Files are opened with `safe_open` (memory-mapped) once and kept; `get_tensor` reads only the
    asked keys, so the host holds one module's values at a time, as with random init."""

    def __init__(self, folder: str | Path, config: Any = None):
        self.folder = Path(folder)
        self.tied = bool(getattr(config, "tie_word_embeddings", False)) if config is not None else False
        self.prefix = getattr(config, "base_model_prefix", None) or "model"
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.folder / SINGLE_FILE), framework="pt") as f:
                weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise CheckpointError(f"checkpoint: {self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}
        self._embed_name, self._head_name = _embedding_names(config) if self.tied else (None, None)

    def __repr__(self) -> str:
        return f"CheckpointSource({str(self.folder)!r}, {len(self.weight_map)} tensors)"

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return self._handles[file]

    def _key(self, name: str) -> str | None:
        """The checkpoint key of a parameter name, or None: as is, without the base-model prefix
        (a checkpoint of the bare decoder), or with it."""
        candidates = [name]
        if name.startswith(self.prefix + "."):
            candidates.append(name[len(self.prefix) + 1:])
        else:
            candidates.append(f"{self.prefix}.{name}")
        return next((c for c in candidates if c in self.weight_map), None)

    def __call__(self, owner: str, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """{attr: full host tensor} of `owner`'s own parameters (and the buffers the checkpoint
        has), cast to the template's dtype; None for a peft adapter module (its own init).
        Raises CheckpointError for a missing parameter or a shape that is not the module's."""
        parts = owner.split(".") if owner else []
        if any(p.startswith(PEFT_ADAPTER_PREFIXES) for p in parts):
            return None
        name = ".".join(p for p in parts if p != PEFT_BASE)
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for kind, slots in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, template in slots.items():
                if template is None:
                    continue
                full = f"{name}.{attr}" if name else attr
                key = self._key(full)
                if key is None and self.tied and self._head_name is not None and name == self._head_name \
                        and self._embed_name is not None:
                    key = self._key(f"{self._embed_name}.{attr}")  # tied head saved only as the embedding
                if key is None:
                    if kind == "param":
                        missing.append(full)
                    continue  # buffers (rotary inv_freq) are not saved: the family's init makes them
                tensor = self._handle(self.weight_map[key]).get_tensor(key)
                if tuple(tensor.shape) != tuple(template.shape):
                    raise CheckpointError(f"checkpoint {self.folder}: '{key}' has shape {tuple(tensor.shape)}, "
                                          f"the model's {full} expects {tuple(template.shape)}")
                out[attr] = tensor.to(template.dtype)
        if missing:
            raise CheckpointError(
                f"checkpoint {self.folder}: no tensor for {', '.join(missing)} (of module '{owner}'); "
                f"its keys are not the model's parameter names (e.g. a family whose checkpoint "
                f"transformers converts on load, such as per-expert MoE weights), or the "
                f"model_overrides change the architecture; paratune does not fill them at random")
        return out


def checkpoint_refusal(model: str, config: Any) -> str | None:
    """Why the plan's `model` folder cannot give the model its weights (missing parameter names,
    wrong shapes), or None; reads the checkpoint's metadata only (names and shapes, no tensor):
    a converted family or mismatched overrides are refused before any worker starts."""
    folder = weights_folder(model)
    if folder is None:
        return None
    from paratune.model.materialize import build_meta

    try:
        source = CheckpointSource(folder, config)
    except CheckpointError as err:
        return str(err)
    meta = build_meta(config)
    missing, wrong = [], []
    for name, param in meta.named_parameters():  # tied parameters once, under their first name
        key = source._key(name)
        if key is None:
            missing.append(name)
            continue
        shape = tuple(source._handle(source.weight_map[key]).get_slice(key).get_shape())
        if shape != tuple(param.shape):
            wrong.append(f"'{key}' {shape} (the model's {name}: {tuple(param.shape)})")
    if not missing and not wrong:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameters have no tensor ({', '.join(missing[:6])}"
                     f"{', ...' if len(missing) > 6 else ''}): its keys are not the model's parameter names "
                     "(a family whose checkpoint transformers converts on load, such as per-expert MoE "
                     "weights, or model_overrides that add layers)")
    if wrong:
        parts.append(f"shapes differ: {', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''} "
                     "(model_overrides that change the architecture)")
    return f"model: checkpoint {folder}: " + "; ".join(parts) + "; paratune loads only keys named as the model's parameters"


def _embedding_names(config: Any) -> tuple[str | None, str | None]:
    """Module names of the input embedding and the LM head (built on meta: no memory)."""
    from paratune.model.materialize import build_meta

    model = build_meta(config)
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (names.get(id(embed)) if embed is not None else None, names.get(id(head)) if head is not None else None)


def checkpoint_sources(model: str, config: Any) -> list[CheckpointSource]:
    """The value sources a plan's `model` brings: its folder's weights, if it has any."""
    folder = weights_folder(model)
    return [] if folder is None else [CheckpointSource(folder, config)]


def build_model_with_weights(config: Any, seed: int, weights: str, dtype: torch.dtype = torch.float32,
                             device: str | torch.device = "cpu") -> nn.Module:
    """`paratune.model.build.build_model` with a plan's `model` as the source of values: a folder with
    safetensors gives its pretrained weights, a preset or config.json random init (same seed, same
    values). Here, not in models.py, which checkpoints.py reads its names from (no import cycle)."""
    return build_model(config, seed, dtype, device, sources=checkpoint_sources(weights, config))
