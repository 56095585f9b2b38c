"""The numbers paratune's rules read from a model's config, read the way transformers reads them.

Families name their sizes differently (Bloom and GPT-BigCode `n_head`, MPT `n_heads`, GPT-2 `n_embd`,
OPT and others `d_model`...) and leave some out of config.json, their class's default then applies
(Mistral's 8 KV heads). transformers resolves both on its config object: the class's
`attribute_map` aliases, its defaults, a multimodal model's text part (`get_text_config()`). Every
rule that needs a size (tp / pp / cp degrees, the parity proxy, `paratune init`'s draft, the
tokenizer check) reads it here, from that object, never from the raw dict with a guessed default.

Building the object imports transformers (and with it torch): rules call this only when a degree
needs the model's shape, so a data-parallel plan validates without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class ConfigSizes:
    """A decoder-only model's sizes, as its transformers config object reports them."""

    hidden: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    head_dim: int
    max_positions: int | None
    experts: int | None  # routed experts; None for a dense model (or one keeping them under another name)
    # transformers ships a TP plan for the family (base_model_tp_plan): tp splits its heads. Without
    # one paratune derives a plan that gathers the attention's projections (parallel/tp_derive.py):
    # the heads need not divide by tp there.
    tp_plan_shipped: bool = True


# Keys where families keep their number of routed experts (Mixtral num_local_experts, Qwen-MoE /
# OLMoE / Granite-MoE num_experts, DeepSeek n_routed_experts).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def config_sizes(config: Any) -> ConfigSizes:
    """The shape of a config.json dict (model_type included) or of a transformers config object:
    its text part's sizes, aliases and defaults resolved by the family's config class. A dict
    transformers cannot turn into its config (its error is the model's, reported where the model is
    built) is read as written."""
    if isinstance(config, dict):
        return _shape(json.dumps(config, sort_keys=True, default=str))
    return _read(config.get_text_config() if hasattr(config, "get_text_config") else config, {})


@lru_cache(maxsize=256)
def _shape(config_json: str) -> ConfigSizes:
    data = json.loads(config_json)
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in data.items() if k != "model_type"}
        text = AutoConfig.for_model(data["model_type"], **fields).get_text_config()
    except Exception:  # noqa: BLE001 - transformers' own refusal is reported when the model is built
        text = None
    return _read(text, data)


def _read(text: Any, data: dict[str, Any]) -> ConfigSizes:
    """The sizes from the config object `text`, or from the dict `data` where there is none."""

    def read(name: str, default: Any) -> Any:
        value = _attribute(text, name) if text is not None else data.get(name)
        return default if value is None else value

    heads = int(read("num_attention_heads", 1))
    hidden = int(read("hidden_size", 0))
    return ConfigSizes(hidden=hidden, heads=heads, kv_heads=_kv_heads(read, heads),
                      layers=int(read("num_hidden_layers", 1)), vocab=int(read("vocab_size", 0)),
                      head_dim=int(read("head_dim", hidden // heads if heads else 0)),
                      max_positions=read("max_position_embeddings", None),
                      experts=next((int(v) for v in (read(k, None) for k in EXPERT_COUNT_KEYS)
                                    if isinstance(v, int) and not isinstance(v, bool) and v >= 2), None),
                      tp_plan_shipped=text is None or bool(getattr(text, "base_model_tp_plan", None)))


def _attribute(config: Any, name: str) -> Any:
    """config.name; on a heterogeneous config (transformers >= 5.2: Gemma-4's sliding and global layers
    with their own head_dim) a per-layer attribute is the largest of its layers' values, the one that
    sizes memory (transformers refuses the global read)."""
    if getattr(config, "is_heterogeneous", False):
        per_layer = getattr(config, "per_layer_config", None)
        try:
            getattr(config, name, None)
        except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError: read it per layer
            values = [getattr(layer, name, None) for layer in per_layer or ()]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            return max(numbers) if numbers else next((v for v in values if v is not None), None)
    return getattr(config, name, None)


def _kv_heads(read, heads: int) -> int:
    """KV heads: transformers' num_key_value_heads where the class has it (GPT-BigCode's multi-query
    says 1 there); Falcon keeps its own flags: num_kv_heads with the new decoder architecture, one
    shared KV head under multi_query, else one per head."""
    kv = read("num_key_value_heads", None)
    if kv is not None:
        return int(kv)
    if read("new_decoder_architecture", False) is True:
        return int(read("num_kv_heads", heads))
    if read("multi_query", False) is True:
        return 1
    return heads
