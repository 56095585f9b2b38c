"""Model shapes and construction from a config: never from the hub, random init, same on every rank."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

PRESET_DIR = Path(__file__).parent / "presets"


class ModelError(ValueError):
    """A model spec that cannot be built (unknown preset, bad path, not a causal decoder)."""


# Files in presets/ that are not model configs (the device table lives beside the models).
NOT_MODELS = {"devices"}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json") if p.stem not in NOT_MODELS)


def load_config_dict(model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config as a dict: a preset name or a path to a local config.json, then overrides."""
    preset = PRESET_DIR / f"{model}.json"
    path = preset if preset.is_file() and model not in NOT_MODELS else Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(
            f"model: got '{model}', neither a preset nor a config.json path; allowed presets: "
            f"{', '.join(preset_names())}"
        )
    data = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    if "model_type" not in data:
        raise ModelError(f"model: {path} has no 'model_type'; a transformers config.json is required")
    data.update(overrides or {})
    return _fit_layer_types(data, overrides or {})


def build_config(model: str, overrides: dict[str, Any] | None = None):
    """A transformers PretrainedConfig for a decoder-only causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    data = load_config_dict(model, overrides)
    model_type = data.pop("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"model: model_type '{model_type}' is not a causal LM that transformers knows")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as err:  # noqa: BLE001 - transformers 5 also raises huggingface_hub's
        # StrictDataclassClassValidationError (not a ValueError) for inconsistent configs
        raise ModelError(f"model config: {type(err).__name__}: {err}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model: '{model}' is an encoder-decoder; paratune tunes decoder-only LMs")
    config.use_cache = False
    config._attn_implementation = _checked_attn_implementation(config)
    return config


def _checked_attn_implementation(config) -> str:
    """The attention kernel, decided once here so every path builds the same model: the one the
    overrides name if the family supports it, else SDPA where supported, else eager."""
    from paratune.materialize import ATTENTION_IMPLEMENTATIONS, attn_implementation, causal_lm_class, \
        supported_attn_implementations

    requested = getattr(config, "_attn_implementation", None)
    allowed = supported_attn_implementations(config)
    if requested is not None and requested not in allowed:
        why = (f"{causal_lm_class(config).__name__} does not support it" if requested in ATTENTION_IMPLEMENTATIONS
               else f"paratune builds with {' or '.join(ATTENTION_IMPLEMENTATIONS)}")
        raise ModelError(f"model_overrides.attn_implementation: got '{requested}'; {why}; allowed: {', '.join(allowed)}")
    return attn_implementation(config)


def build_model(config, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Random-init model from config, whole, on `device`. Its values are those every layout
    reproduces slice by slice (paratune.materialize): the same on every rank and device."""
    from paratune.materialize import ModelInit, build_meta, materialize

    model = build_meta(config, dtype)
    materialize(model, ModelInit(model, config, seed, dtype), torch.device(device))
    return model


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the unit of sharding and checkpointing)."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ModelError(f"cannot find decoder blocks in {type(model).__name__}")
    return list(layers)


def config_key(config) -> str:
    """A config as canonical JSON (model_type and attention kernel included): a cache key, and
    enough to rebuild it."""
    data = config.to_dict()
    keep = {k: v for k, v in data.items() if not k.startswith("_") and k not in ("transformers_version",)}
    if getattr(config, "_attn_implementation", None):  # not in to_dict(); part of what is built
        keep["attn_implementation"] = config._attn_implementation
    return json.dumps(keep, sort_keys=True, default=str)


def config_from_key(key: str, **overrides: Any):
    """The config a config_key() describes (with overrides, e.g. fewer layers: a per-layer
    `layer_types` list follows the new layer count)."""
    from transformers import AutoConfig

    data = _fit_layer_types({**json.loads(key), **overrides}, overrides)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _fit_layer_types(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A per-layer `layer_types` list (Gemma-2, Qwen2/3: transformers requires one entry per layer)
    follows an overridden layer count: the family's pattern, repeated or cut."""
    layers, types = data.get("num_hidden_layers"), data.get("layer_types")
    if types and layers and "layer_types" not in overrides and layers != len(types):
        data["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return data


@lru_cache(maxsize=64)
def _layout(key: str) -> dict[str, int]:
    config = config_from_key(key)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    blocks = decoder_blocks(model)
    return {"total": total, "embedding": embedding, "head": 0 if tied else head, "tied_head": head if tied else 0,
            "layer": sum(p.numel() for p in blocks[0].parameters()), "layers": len(blocks)}


def parameter_layout(config) -> dict[str, int]:
    """Where the parameters are: total, input embedding, untied LM head (0 when tied), one decoder
    block, number of blocks (exact, from the architecture built on the meta device)."""
    return dict(_layout(config_key(config)))


def parameter_counts(config) -> dict[str, int]:
    """Exact counts from the real architecture (built on the meta device: no memory, any size).

    `compute` is N in 6N: every parameter a token's matmuls touch, i.e. all but the input
    embedding lookup; a tied LM head is counted once as storage but still costs a matmul.
    """
    layout = _layout(config_key(config))
    return {"total": layout["total"], "embedding": layout["embedding"],
            "compute": layout["total"] - layout["embedding"] + layout["tied_head"]}
