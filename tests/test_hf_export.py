"""Pretrained weights out: every layout's trained model written as a Hugging Face folder.

Each layout trains 2 steps on 2 gloo processes and writes the folder (paratune.train.hf_export); here
`AutoModelForCausalLM.from_pretrained` loads it and every tensor is compared with the single-process
reference trained the same 2 steps. A tensor left out (from_pretrained would fill it at random), an
untrained one (Adam at lr 1e-2 moves each weight ~1e-2 a step) or another stage's or shard's values
cannot pass. The end-to-end path (`paratune train` through Ray Train, resumed after a fault) is
checked in test_cluster_jobs.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import BASE_PLAN

from paratune.model.adapters import build_adapted_model
from paratune.model.checkpoints import build_model_with_weights
from paratune.train.hf_export import HFExportError, export_refusal
from paratune.model.build import build_config
from paratune.config.plan import load_plan_dict

STEPS = 2
# Adam's first steps are ~lr * g / (|g| + eps): an element whose gradient is rounding-sized (a rarely
# used embedding row, an MLP unit at rest) moves by a share of lr that its summation order decides, so
# a correct layout is held as a whole, not element by element: every element within TOLERANCE (seen
# up to 1.5e-4 on tp2's up_proj under ATEN_CPU_CAPABILITY=default + MKL_CBWR=COMPATIBLE, 2.7e-5 under
# the machine's own, AMD EPYC 2026-12-07; 2e-4 failed on no machine yet but was held to 1.4x), and all
# but BULK_OUTLIERS of a tensor's elements within BULK_TOLERANCE (at most 9 of 11,264 seen beyond it).
# A weight left untrained (~1e-2 off: Adam at lr 1e-2), another shard's or stage's values, or values
# rounded to bf16 on the way out (~4e-5 off nearly everywhere) fail the bulk check.
TOLERANCE = 2e-3
BULK_TOLERANCE = 1e-5
BULK_OUTLIERS = 0.005  # a share of the tensor's elements (at least one)
MOVED = 4e-3  # a trained weight's largest move from its initial value (lr 1e-2, 2 steps: seen >= 1.4e-2)
LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "fsdp-tied": {"strategy": "fsdp", "fsdp": {"sharding": "full"}, "model_overrides": {"tie_word_embeddings": True}},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "fsdp-lora": {"strategy": "fsdp", "peft": {"method": "lora", "r": 4, "alpha": 8}},  # merged into the weights
    "zero-3-lora": {"strategy": "zero", "zero": {"stage": 3}, "peft": {"method": "lora", "r": 4, "alpha": 8}},  # the frozen base gathered
    "tp2-lora": {"tp": 2, "peft": {"method": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}},
    "zero-2": {"strategy": "zero", "zero": {"stage": 2}},  # the fp32 masters of its optimizer's partitions
    "zero-3": {"strategy": "zero", "zero": {"stage": 3}},
}


def _folder(plan) -> Path:
    """The same on every rank (hashlib, not hash(): its seed differs per process)."""
    digest = hashlib.sha1(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"paratune-hf-{os.environ['MASTER_PORT']}-{digest}"


def train_and_export(plan, rank: int, world: int, local_world: int, device) -> dict:
    """A gloo worker (gloo_harness `measure`): STEPS steps as a training run takes them, then the
    Hugging Face folder, written by every rank together."""
    from paratune.config.data import TokenBatches
    from paratune.train.hf_export import export_hf_folder, trained_modules
    from paratune.parallel import build_runner
    from paratune.parallel.dims import ParallelDims

    config = build_config(plan.model, plan.model_overrides)
    dims = ParallelDims.from_plan(plan, device.type)
    data = TokenBatches(plan.data, config.vocab_size, plan.seq_len, plan.global_batch, plan.seed)
    runner = build_runner(config, plan, device, local_world)
    for step in range(STEPS):
        runner.train_step(data.micro_batches(step, dims.dp_rank(rank), dims.dp, plan.micro_batch))
    folder = export_hf_folder(trained_modules(runner, plan), config, plan, rank, _folder(plan), max_shard_bytes=64 * 1024)
    return {"folder": str(folder)}


@pytest.mark.integration
def test_every_layout_writes_a_folder_from_pretrained_loads_with_the_trained_values():
    from gloo_harness import run_plans_on_gloo

    plans = [load_plan_dict({**BASE_PLAN, **case}) for case in LAYOUTS.values()]
    outs = run_plans_on_gloo(plans, measure="test_hf_export:train_and_export")
    try:
        _check_folders(plans, outs)
    finally:  # the ranks wrote them under the system's temp dir (one path for every rank): gone after the test
        for out in outs:
            shutil.rmtree(out["folder"], ignore_errors=True)


def _check_folders(plans: list, outs: list[dict]) -> None:
    from transformers import AutoModelForCausalLM

    from paratune.sweep.parity import reference_training

    for name, plan, out in zip(LAYOUTS, plans, outs):
        folder = Path(out["folder"])
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        assert len(files) > 1, (name, files)  # the 64 KiB shards: the index path is the one read
        # transformers' own shard names, numbered across every writer (pp2: each stage's first rank)
        assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)], files
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
        assert (folder / "generation_config.json").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        _, reference = reference_training(plan, steps=STEPS)
        expected = _merged_state(reference)
        assert set(loaded) == set(expected), (name, set(loaded) ^ set(expected))
        config = build_config(plan.model, plan.model_overrides)
        initial = (_merged_state(build_adapted_model(config, plan)) if plan.peft is not None
                   else build_model_with_weights(config, plan.seed, plan.model).state_dict())
        for key, value in expected.items():
            assert loaded[key].dtype == torch.float32, (name, key, loaded[key].dtype)
            assert _matches(loaded[key], value), (name, key, float((loaded[key] - value).abs().max()))
            if key.endswith("mlp.up_proj.weight"):  # what the check tells apart: values rounded to bf16 on the way out
                assert not _matches(value.to(torch.bfloat16).float(), value), (name, key)
            moved = float((loaded[key] - initial[key]).abs().max())
            targets = (plan.peft.target_modules or ("q_proj", "v_proj")) if plan.peft is not None else ()  # peft's Llama default
            if plan.peft is None or any(f".{t}." in key for t in targets):  # LoRA: its targets only
                assert moved > MOVED and not _matches(initial[key], value), (name, key, "not trained")
            else:
                assert moved == 0.0, (name, key, "a frozen weight moved")
        if name == "fsdp-tied":  # written once, tied again on load
            assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()


def _matches(loaded: torch.Tensor, trained: torch.Tensor) -> bool:
    """A tensor holds the trained values: every element within TOLERANCE, all but BULK_OUTLIERS within
    BULK_TOLERANCE (why a whole tensor is judged: TOLERANCE's comment)."""
    off = (loaded - trained).abs()
    return float(off.max()) <= TOLERANCE and int((off > BULK_TOLERANCE).sum()) <= max(1, int(BULK_OUTLIERS * off.numel()))


def _merged_state(model) -> dict:
    """The model's state as the plain model's, LoRA layers merged by peft's own `merge()`."""
    for module in model.modules():
        if hasattr(module, "base_layer") and hasattr(module, "merge"):
            module.merge()
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if ".lora_" not in k}


def test_layouts_the_folder_is_not_written_for_say_why():
    moe = load_plan_dict({**BASE_PLAN, "model": "tiny-mixtral", "micro_batch": 1, "strategy": "ddp", "ep": 2})
    assert "ep: 2" in export_refusal(moe)
    assert export_refusal(load_plan_dict({**BASE_PLAN, "strategy": "zero", "zero": {"stage": 1}, "tp": 2})).startswith("tp: 2")
    assert export_refusal(load_plan_dict({**BASE_PLAN, "strategy": "fsdp"})) is None
    assert issubclass(HFExportError, ValueError)


def test_the_folder_gets_the_tokenizer_that_belongs_with_the_model(tmp_path):
    """The data's tokenizer, else the one in the model folder the run started from, else none
    (byte-level data of a preset): saved beside the weights as save_pretrained writes it."""
    from transformers import AutoTokenizer

    from newcomer import make_pretrained, make_tokenizer
    from paratune.train.hf_export import save_tokenizer, tokenizer_source

    model = make_pretrained(tmp_path / "model")
    other = make_tokenizer(tmp_path / "other", vocab_size=280)
    data = {"kind": "text", "path": str(tmp_path / "x.txt")}
    assert tokenizer_source(load_plan_dict({**BASE_PLAN, "model": str(model)})) == model
    named = load_plan_dict({**BASE_PLAN, "model": str(model), "data": {**data, "tokenizer": str(other)}})
    assert tokenizer_source(named) == other
    assert tokenizer_source(load_plan_dict(BASE_PLAN)) is None
    out = tmp_path / "out"
    out.mkdir()
    assert save_tokenizer(named, out) == other
    assert len(AutoTokenizer.from_pretrained(out)) == 280
