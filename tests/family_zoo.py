"""Every causal-LM family transformers ships, as a tiny config: what the family tests and
bench/families_parity.py build, train and compare.

Each family is built from its own default config class, shrunk (hidden 64, 2 layers, 4 heads, vocab
512, 4 experts top-2 ...; per-layer lists cut to their first and last layers), on the meta device: no memory, the
real module tree. Where the shrunk config is refused, the family's defaults with full layers, then
as shipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratune.model.materialize import build_meta

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "rotary_dim": 8,
        "vocab_size": 512, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "hidden_size_global": 64,
        "encoder_hash_byte_group_vocab": 512, "vocab_size_per_layer_input": 512, "ngram_vocab_size_base": 512,
        "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64, "d_head": 16,
        "zero_expert_num": 2}
# Multi-head latent attention (DeepSeek-V2/V3 and kin): its head sizes and ranks shrunk together, the rotary
# part equal to head_dim (the rotary embedding reads head_dim), and as many kv heads as heads (MLA has no GQA).
TINY_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "qk_head_dim": 32, "num_key_value_heads": 4, "index_head_dim": 16, "index_n_heads": 4}
# Qwen4-Exp's token indexer (QSA), which its full-attention layers build: all of its fields or none.
TINY_QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
            "indexer_compress_ratio": 4}


AS_SHIPPED_LIMIT = 200_000_000  # parameters: a family left as shipped above this is reported, not trained


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tiny_fields(config, cut_layers: bool) -> dict:
    """TINY's sizes for the fields this config has, its per-layer lists cut to their first and last
    layers (a hybrid keeps one layer of each end's kind: a linear-attention stack its full-attention
    layer), token ids inside the smaller vocabulary, and the same for its sub-configs (a multimodal
    model's text part)."""
    out: dict = {}
    own = vars(config)
    for key, value in TINY.items():
        try:
            current = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - heterogeneous configs refuse global per-layer reads: the base value
            current = own.get(key)
        if (_int(current) and (key != "head_dim" or key in own)) or (key == "num_experts_per_tok" and key in own):
            out[key] = min(value, current) if key == "num_experts_per_tok" and _int(current) else value
    if "kv_lora_rank" in own:
        out.update({key: value for key, value in TINY_MLA.items() if _int(own.get(key))})
    if "indexer_budget" in own:
        out.update(TINY_QSA)
    if _int(own.get("expand")) and _int(own.get("num_heads")) and "state_size" in own:  # Mamba-2: heads x head_dim = expand x hidden
        out.update(num_heads=TINY["hidden_size"] * own["expand"] // TINY["head_dim"], head_dim=TINY["head_dim"])
    if getattr(config, "is_heterogeneous", False):
        out["per_layer_config"] = _cut_overrides(config, own, out, cut_layers)
    layers = own.get("num_hidden_layers")
    if cut_layers and _int(layers) and layers > 2:
        out["num_hidden_layers"] = 2
        out.update({k: [v[0], v[-1]] for k, v in own.items()
                    if isinstance(v, (list, tuple)) and len(v) == layers and not k.startswith("_")})
    if own.get("default_language", "") is None and own.get("languages"):  # X-MOD: the user names the adapter to train
        out["default_language"] = own["languages"][0]
    vocab = out.get("vocab_size", own.get("vocab_size"))
    out.update({k: vocab - 1 for k, v in own.items() if k.endswith("token_id") and _int(v) and _int(vocab) and v >= vocab})
    for key in getattr(config, "sub_configs", None) or {}:
        sub = own.get(key)
        if hasattr(sub, "to_dict"):
            out[key] = {**sub.to_dict(), **tiny_fields(sub, cut_layers)}
    return out


def _cut_overrides(config, own: dict, tiny: dict, cut_layers: bool) -> dict:
    """A heterogeneous config's per-layer overrides (Gemma-4's global layers' head_dim, dots.3's
    wider layers) kept for the first and last layers, each shrunk in its ratio to the base value."""
    overrides = config._heterogeneity_spec.per_layer_overrides
    layers = own["num_hidden_layers"]
    kept = {0: overrides.get(0), 1: overrides.get(layers - 1)} if cut_layers else dict(overrides)
    out = {}
    for index, fields in kept.items():
        if fields:
            out[index] = {k: max(1, tiny[k] * v // own[k]) if k in tiny and _int(v) and _int(own.get(k)) else v
                          for k, v in fields.items()}
    return out


def tiny_meta_model(model_type: str):
    """The family's model on the meta device, as small as its config class allows."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except Exception as err:  # noqa: BLE001 - the config class itself refuses its defaults
        raise RuntimeError(f"{type(err).__name__}: {err}") from None
    error = ""
    for fields in (tiny_fields(default, True), tiny_fields(default, False), {}):
        try:
            return build_meta(AutoConfig.for_model(model_type, **fields))
        except Exception as err:  # noqa: BLE001 - the last one (as shipped) is the family's own
            error = f"{type(err).__name__}: {err}"
    raise RuntimeError(error)


def tiny_config(model_type: str) -> dict:
    """The smallest config dict of the family that builds on the meta device (model_type included)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    error = ""
    for fields in (tiny_fields(default, True), tiny_fields(default, False), {}):
        try:
            config = AutoConfig.for_model(model_type, **fields)
            size = sum(p.numel() for p in build_meta(config).parameters())
            if not fields and size > AS_SHIPPED_LIMIT:  # would not fit this machine's 2 workers
                raise RuntimeError(f"{error} (shrunk); as shipped {size / 1e6:.0f}M parameters")
            return {**{k: v for k, v in config.to_dict().items() if not k.startswith("_")}, "model_type": model_type}
        except Exception as err:  # noqa: BLE001 - the last one (as shipped) is the family's own
            error = f"{type(err).__name__}: {err}"
    raise RuntimeError(error)


def write_config(model_type: str, folder: Path) -> Path:
    """The family's tiny config.json in `folder` (a model paratune reads as an architecture)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(tiny_config(model_type), default=str))
    return path
