"""The sizes paratune's rules read from a config, resolved as transformers resolves them: aliases
(Bloom's n_head, GPT-2's n_embd, MPT's d_model), class defaults, multi-query flags, a multimodal
model's text part; and the degree rules that read them."""

import json

import pytest
from conftest import BASE_PLAN
from family_zoo import tiny_config

from paratune.config.sizes import config_sizes
from paratune.config.plan import PlanError, load_plan_dict


@pytest.mark.parametrize("config,expected", [
    ({"model_type": "bloom", "n_head": 4, "hidden_size": 64, "n_layer": 3, "vocab_size": 512},
     {"heads": 4, "kv_heads": 4, "hidden": 64, "layers": 3, "head_dim": 16}),
    ({"model_type": "gpt_bigcode", "n_head": 4, "n_embd": 64, "n_layer": 2, "multi_query": True},
     {"heads": 4, "kv_heads": 1, "hidden": 64, "layers": 2}),
    ({"model_type": "gpt_bigcode", "n_head": 4, "n_embd": 64, "multi_query": False}, {"heads": 4, "kv_heads": 4}),
    ({"model_type": "mpt", "n_heads": 8, "d_model": 128, "n_layers": 2}, {"heads": 8, "hidden": 128, "layers": 2}),
    ({"model_type": "falcon", "num_attention_heads": 8, "hidden_size": 64, "multi_query": True}, {"kv_heads": 1}),
    ({"model_type": "falcon", "num_attention_heads": 8, "hidden_size": 64, "new_decoder_architecture": True,
      "num_kv_heads": 2}, {"kv_heads": 2}),
    # a field config.json leaves out takes the class's default: Mistral's 8 KV heads, not the head count
    ({"model_type": "mistral", "num_attention_heads": 32, "hidden_size": 4096}, {"heads": 32, "kv_heads": 8}),
    # JetMoE names its head dim kv_channels
    ({"model_type": "jetmoe", "kv_channels": 24, "num_attention_heads": 4, "hidden_size": 64}, {"head_dim": 24}),
])
def test_sizes_are_read_as_transformers_reads_them(config, expected):
    sizes = config_sizes(config)
    assert {k: getattr(sizes, k) for k in expected} == expected


def test_a_multimodal_config_is_read_from_its_text_part():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2_vl", text_config={"num_attention_heads": 6, "num_key_value_heads": 2,
                                                            "hidden_size": 96})
    sizes = config_sizes(config)
    assert (sizes.heads, sizes.kv_heads, sizes.hidden) == (6, 2, 96)


def test_a_config_transformers_refuses_is_read_as_written():
    sizes = config_sizes({"model_type": "no-such-family", "num_attention_heads": 6, "hidden_size": 96})
    assert (sizes.heads, sizes.kv_heads, sizes.hidden, sizes.head_dim) == (6, 6, 96, 16)


def _bloom(tmp_path, heads: int) -> str:
    config = {**tiny_config("bloom"), "n_head": heads}
    config.pop("num_attention_heads", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_tp_degrees_read_the_aliased_and_the_default_head_counts(tmp_path):
    """Bloom's config.json says n_head: tp 2 is accepted (once refused as '1 head'); its plan is
    derived (transformers ships none), which gathers the attention, so its heads need not divide tp.
    Mistral's config.json without num_key_value_heads has the class's 8: tp 16 is refused naming
    them (the raw dict read 32, one per head, and let it through)."""
    assert load_plan_dict({**BASE_PLAN, "model": _bloom(tmp_path, 4), "tp": 2}).tp == 2
    mistral = tmp_path / "mistral.json"
    mistral.write_text(json.dumps({"model_type": "mistral", "hidden_size": 256, "num_attention_heads": 32,
                                   "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 512}))
    with pytest.raises(PlanError, match=r"tp: 16 must divide attention heads \(32\) and KV heads \(8\)"):
        load_plan_dict({**BASE_PLAN, "model": str(mistral), "num_workers": 16, "global_batch": 16, "micro_batch": 1,
                        "tp": 16})


def test_a_heterogeneous_config_is_read_per_layer():
    """Gemma-4's sliding and global layers carry their own head_dim (transformers >= 5.2 refuses the
    global read of a per-layer attribute): the sizes take the largest, the one memory is sized by."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma4_text", **{k: v for k, v in tiny_config("gemma4_text").items()
                                                    if k != "model_type"})
    assert config.is_heterogeneous
    per_layer = {layer.head_dim for layer in config.per_layer_config}
    assert len(per_layer) == 2, per_layer  # the zoo keeps one layer of each kind
    assert config_sizes(config).head_dim == max(per_layer)
    assert config_sizes(tiny_config("gemma4_text")).head_dim == max(per_layer)
