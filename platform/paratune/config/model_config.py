"""The error a model that cannot be built raises: its own module, torch-free, so the config readers
(paratune.model.build) and the builder (paratune.model.materialize) both raise it without importing each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A model spec that cannot be built (unknown preset, bad path, not a causal decoder, a slot
    nothing initializes)."""


PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


# Files in presets/ that are not model configs (the device table and the prediction bands,
# paratune.costs.bands, live beside the models).
NOT_MODELS = {"devices", "prediction_bands"}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json") if p.stem not in NOT_MODELS)


def load_config_dict(model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config as a dict: a preset name or a path to a local config.json, then overrides."""
    preset = PRESET_DIR / f"{model}.json"
    path = preset if preset.is_file() and model not in NOT_MODELS else Path(model)
    if path.is_dir():
        _check_weights(path)
        path = path / "config.json"
    if not path.is_file():
        import difflib

        close = difflib.get_close_matches(model, preset_names(), n=1, cutoff=0.6)
        raise ModelError(
            f"model: got '{model}', neither a preset, a model folder nor a config.json path (no {path.resolve()}); "
            f"{f'did you mean {close[0]!r}? ' if close else ''}allowed: a model folder (config.json + "
            f"*.safetensors), a config.json path, or a preset: {', '.join(preset_names())}"
        )
    data = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    if "model_type" not in data:
        raise ModelError(f"model: {path} has no 'model_type'; a transformers config.json is required")
    data.update(overrides or {})
    return _fit_layer_types(data, overrides or {})


def _check_weights(folder: Path) -> None:
    """A folder given as the model is a pretrained model: it must hold its weights. Without them a
    run would train from random init while its user believes they fine-tune their model; random
    init stays one path away (the folder's config.json, or a preset)."""
    if not (folder / "config.json").is_file():
        raise ModelError(f"model: folder {folder} has no config.json; allowed: a Hugging Face model folder "
                         f"(config.json + *.safetensors), a config.json path, or a preset ({', '.join(preset_names())})")
    if any(folder.glob("*.safetensors")):
        return
    other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    found = (f"; found {', '.join(other[:3])}: paratune reads safetensors (save it with "
             "model.save_pretrained(folder), which writes them)") if other else ""
    raise ModelError(f"model: folder {folder} holds config.json but no weights (looked for model.safetensors, "
                     f"model.safetensors.index.json and its *.safetensors shards){found}; allowed: a folder with its "
                     f"weights, or {folder / 'config.json'} to train this architecture from random init")


def model_init(model: str) -> str:
    """Where a plan's starting weights come from, in words (what a trial result says)."""
    preset = PRESET_DIR / f"{model}.json"
    if preset.is_file() and model not in NOT_MODELS:
        return f"random init (preset {model})"
    path = Path(model)
    if path.is_dir():
        return f"pretrained weights from {path}"
    return f"random init (architecture from {path})"


def _fit_layer_types(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A per-layer `layer_types` list (Gemma-2, Qwen2/3: transformers requires one entry per layer)
    follows an overridden layer count: the family's pattern, repeated or cut."""
    layers, types = data.get("num_hidden_layers"), data.get("layer_types")
    if types and layers and "layer_types" not in overrides and layers != len(types):
        data["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return data
