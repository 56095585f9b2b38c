"""Pretrained weights in: a plan's `model` folder with safetensors starts every layout from them.

The checkpoints are made here with `save_pretrained` of tiny models (sharded by a small
max_shard_size, so the index path is read), their weights perturbed with a seeded randn so they
differ from paratune's own init: a build that fell back to random init cannot pass.
"""

from pathlib import Path

import pytest
import torch
from conftest import BASE_PLAN
from gloo_harness import one_torch_thread, reference_for, run_plans_on_gloo  # noqa: F401 (fixture)

from paratune.model.checkpoints import (
    CheckpointError,
    CheckpointSource,
    build_model_with_weights,
    has_weights,
    weights_folder,
)
from paratune.model.build import build_config, build_model, parameter_layout
from paratune.config.plan import load_plan_dict
from paratune.sweep.parity import max_loss_difference

FP32 = 4


def save_checkpoint(folder: Path, model: str = "tiny-llama", overrides: dict | None = None,
                    seed: int = 7, max_shard_size: str = "200KB") -> Path:
    """A perturbed tiny model saved as a Hugging Face folder (safetensors, sharded)."""
    from transformers import AutoModelForCausalLM

    model_obj = AutoModelForCausalLM.from_config(build_config(model, overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model_obj.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model_obj.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("tiny-llama-pretrained"))


def _assert_same_as_from_pretrained(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    got = build_model_with_weights(build_config(str(folder)), seed=0, weights=str(folder)).state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_build_model_of_a_sharded_folder_is_from_pretrained(llama_folder):
    assert (llama_folder / "model.safetensors.index.json").is_file()  # the sharded path is the one read
    _assert_same_as_from_pretrained(llama_folder)
    random = build_model(build_config("tiny-llama"), seed=0).state_dict()
    assert not torch.equal(random["model.embed_tokens.weight"],
                           build_model_with_weights(build_config(str(llama_folder)), seed=0, weights=str(llama_folder))
                           .state_dict()["model.embed_tokens.weight"])


def test_single_file_with_tied_embeddings(tmp_path):
    folder = save_checkpoint(tmp_path, overrides={"tie_word_embeddings": True}, max_shard_size="100MB")
    assert (folder / "model.safetensors").is_file()
    _assert_same_as_from_pretrained(folder)


def test_weights_only_from_a_folder_with_safetensors(llama_folder, tmp_path):
    assert has_weights(llama_folder) and weights_folder(str(llama_folder)) == llama_folder
    assert weights_folder("tiny-llama") is None  # a preset
    assert weights_folder(str(llama_folder / "config.json")) is None  # a config.json: architecture only
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    assert not has_weights(tmp_path)


def test_a_model_folder_without_weights_is_an_error_not_random_init(llama_folder, tmp_path):
    """A folder given as the model is a pretrained model: with config.json and no safetensors, a run
    would train from random init while its user believes they fine-tune. Refused at validation with
    the folder, what was looked for, and the two ways to random init; a preset and a config.json
    path still start from random init, and the trial result says where the weights came from."""
    from paratune.config.inputs import check_inputs
    from paratune.config.model_config import model_init
    from paratune.config.plan import PlanError, load_plan_dict

    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    plan = {"num_workers": 1, "global_batch": 2, "micro_batch": 2, "seq_len": 16}
    with pytest.raises(PlanError) as err:
        check_inputs(load_plan_dict({**plan, "model": str(tmp_path)}))
    text = str(err.value)
    assert f"model: folder {tmp_path} holds config.json but no weights" in text
    assert "model.safetensors.index.json" in text and "found pytorch_model.bin" in text
    assert str(tmp_path / "config.json") in text
    check_inputs(load_plan_dict({**plan, "model": str(tmp_path / "config.json")}))  # the architecture alone
    assert model_init(str(tmp_path / "config.json")) == f"random init (architecture from {tmp_path / 'config.json'})"
    assert model_init("tiny-llama") == "random init (preset tiny-llama)"
    assert model_init(str(llama_folder)) == f"pretrained weights from {llama_folder}"


def test_a_shape_the_checkpoint_does_not_have_is_refused_by_name(llama_folder):
    config = build_config(str(llama_folder), {"intermediate_size": 96})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(176, 64\), "
                                              r"the model's .* expects \(96, 64\)"):
        build_model_with_weights(config, seed=0, weights=str(llama_folder))


def test_layers_the_checkpoint_does_not_have_are_refused(llama_folder):
    layers = build_config(str(llama_folder)).num_hidden_layers
    config = build_config(str(llama_folder), {"num_hidden_layers": layers + 1})
    with pytest.raises(CheckpointError, match=f"no tensor for model\\.layers\\.{layers}\\."):
        build_model_with_weights(config, seed=0, weights=str(llama_folder))


def test_converted_moe_checkpoint_is_refused_not_filled_at_random(tmp_path):
    """transformers 5 saves Mixtral's experts one per expert and fuses them on load: the keys are
    not the module's names, so the build stops, naming the missing ones."""
    folder = save_checkpoint(tmp_path, model="tiny-mixtral", max_shard_size="100MB")
    with pytest.raises(CheckpointError, match=r"no tensor for model\.layers\.0\.mlp\."):
        build_model_with_weights(build_config(str(folder)), seed=0, weights=str(folder))


def test_peft_base_layer_names_map_to_the_checkpoint(llama_folder):
    from paratune.model.materialize import build_meta

    config = build_config(str(llama_folder))
    source = CheckpointSource(llama_folder, config)
    q_proj = build_meta(config).get_submodule("model.layers.0.self_attn.q_proj")
    got = source("model.layers.0.self_attn.q_proj.base_layer", q_proj)
    assert set(got) == {"weight"} and got["weight"].shape == q_proj.weight.shape
    assert source("model.layers.0.self_attn.q_proj.lora_A.default", q_proj) is None  # an adapter: its own init


PRETRAINED_LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},  # each stage fills only its own layers from the folder
    "zero-3": {"strategy": "zero", "zero": {"stage": 3}},  # DeepSpeed's own construction (zero.Init)
}


@pytest.mark.integration
def test_layouts_train_from_the_pretrained_weights(llama_folder):
    """ddp, fsdp, tp 2, pp 2 and ZeRO-3 from the folder: the reference's losses (which loads the same folder),
    a first loss other than random init's, and FSDP building only its share."""
    names = list(PRETRAINED_LAYOUTS)
    plans = [load_plan_dict({**BASE_PLAN, "model": str(llama_folder), **case}) for case in PRETRAINED_LAYOUTS.values()]
    names.append("random-ddp")
    plans.append(load_plan_dict({**BASE_PLAN, "strategy": "ddp"}))
    runs = {n: (plan, out) for n, plan, out in zip(names, plans, run_plans_on_gloo(plans))}
    random_first = runs["random-ddp"][1]["losses"][0]
    for name in PRETRAINED_LAYOUTS:
        plan, out = runs[name]
        reference = reference_for(plan)
        assert max_loss_difference(out["losses"], reference) < 1e-5, (name, out["losses"], reference)
        assert abs(out["losses"][0] - random_first) > 1e-3, (name, out["losses"][0], random_first)
    plan, out = runs["fsdp"]
    layout = parameter_layout(build_config(plan.model, plan.model_overrides))
    block, host_module = layout["layer"] * FP32, max(layout["embedding"], layout["head"]) * FP32
    for rank, (peak, params) in enumerate(zip(out["construction_peak_bytes"], out["local_parameter_counts"])):
        assert peak <= params * FP32 + block + host_module, (rank, peak, params * FP32, block, host_module)


def test_preflight_refuses_a_checkpoint_the_model_cannot_take(llama_folder, tmp_path):
    """Metadata only (names and shapes), before any worker starts: a converted MoE checkpoint and
    overrides that change shapes are invalid plans; the folder as saved is fine."""
    from paratune.config.plan import PlanError
    from paratune.checks.preflight import check_plan_against_model

    check_plan_against_model(load_plan_dict({**BASE_PLAN, "model": str(llama_folder)}))
    with pytest.raises(PlanError, match=r"shapes differ: 'model\.layers\.0\.mlp\.gate_proj\.weight' \(176, 64\)"):
        check_plan_against_model(load_plan_dict({**BASE_PLAN, "model": str(llama_folder),
                                                 "model_overrides": {"intermediate_size": 96}}))
    folder = save_checkpoint(tmp_path, model="tiny-mixtral", max_shard_size="100MB")
    with pytest.raises(PlanError, match=r"have no tensor \(model\.layers\.0\.mlp\.gate\.weight"):
        check_plan_against_model(load_plan_dict({**BASE_PLAN, "model": str(folder), "micro_batch": 1}))


def test_parity_proxy_of_a_pretrained_model_is_random_init(llama_folder):
    """The proxy's shapes are not the checkpoint's: it builds from the folder's config.json only."""
    from paratune.sweep.parity import parity_proxy

    proxy = parity_proxy(load_plan_dict({**BASE_PLAN, "model": str(llama_folder)}))
    assert proxy.model == str(llama_folder / "config.json") and weights_folder(proxy.model) is None
