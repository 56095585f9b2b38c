"""Every causal-LM family transformers ships, as a tiny config: what the family tests and
bench/families_parity.py build, train and compare.

Each family is built from its own default config class, shrunk (hidden 64, 2 layers, 4 heads, vocab
512, 4 experts top-2 ...; per-layer lists cut with the layers), on the meta device: no memory, the
real module tree. Where the shrunk config is refused, the family's defaults with full layers, then
as shipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratune.materialize import build_meta

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "rotary_dim": 8,
        "vocab_size": 512, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2}
def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tiny_fields(config, cut_layers: bool) -> dict:
    """TINY's sizes for the fields this config has, its per-layer lists cut to 2 layers, token ids
    inside the smaller vocabulary, and the same for its sub-configs (a multimodal model's text part)."""
    out: dict = {}
    own = vars(config)
    for key, value in TINY.items():
        try:
            current = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - heterogeneous configs refuse global per-layer reads
            continue
        if (_int(current) and (key != "head_dim" or key in own)) or (key == "num_experts_per_tok" and key in own):
            out[key] = value
    layers = own.get("num_hidden_layers")
    if cut_layers and _int(layers) and layers > 2:
        out["num_hidden_layers"] = 2
        out.update({k: list(v[:2]) for k, v in own.items()
                    if isinstance(v, (list, tuple)) and len(v) == layers and not k.startswith("_")})
    vocab = out.get("vocab_size", own.get("vocab_size"))
    out.update({k: vocab - 1 for k, v in own.items() if k.endswith("token_id") and _int(v) and _int(vocab) and v >= vocab})
    for key in getattr(config, "sub_configs", None) or {}:
        sub = own.get(key)
        if hasattr(sub, "to_dict"):
            out[key] = {**sub.to_dict(), **tiny_fields(sub, cut_layers)}
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
            build_meta(config)
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
