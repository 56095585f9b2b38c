"""The winner's accelerate / TrainingArguments / torchtitan files, read back by each tool's own parser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import BASE_PLAN

from paratune.out.export import export_winner
from paratune.out.export_tools import NOTES_KEY
from paratune.config.plan import Plan, load_plan_dict

from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402


@dataclasses.dataclass
class Sections:
    """The JobConfig sections the overrides name (torchtitan's tyro parser, without a model registry)."""

    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)


PLANS = {
    "ddp": {},
    "ddp-unused": {"ddp": {"find_unused_parameters": True}},
    "fsdp": {"strategy": "fsdp", "precision": "bf16", "activation_checkpointing": "selective"},
    "hybrid": {"strategy": "fsdp", "num_workers": 4, "fsdp": {"sharding": "hybrid", "shard_group_size": 2}},
    "zero3": {"strategy": "zero", "zero": {"stage": 3, "offload_param": True, "offload_optimizer": True}},
    "tp2pp2": {"strategy": "fsdp", "num_workers": 8, "tp": 2, "pp": 2, "micro_batch": 1},
}


def export(tmp_path: Path, name: str) -> tuple[Plan, Path]:
    plan = load_plan_dict({**BASE_PLAN, **PLANS[name]})
    export_winner(plan, tmp_path, {"label": name})
    return plan, tmp_path


@pytest.mark.parametrize("name", list(PLANS))
def test_accelerate_config_parses(tmp_path: Path, name: str) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    plan, out = export(tmp_path, name)
    cfg = load_config_from_file(str(out / "accelerate.yaml"))
    assert cfg.num_processes == plan.num_workers
    expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "zero": "DEEPSPEED"}[plan.strategy]
    assert str(cfg.distributed_type).endswith(expected)
    if plan.strategy == "fsdp":
        from accelerate.utils import FullyShardedDataParallelPlugin

        fc = cfg.fsdp_config
        assert fc["fsdp_version"] == 2 and fc["fsdp_transformer_layer_cls_to_wrap"]
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=fc["fsdp_reshard_after_forward"],
            activation_checkpointing=fc["fsdp_activation_checkpointing"],
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[fc["fsdp_transformer_layer_cls_to_wrap"]])
        assert plugin.activation_checkpointing == (plan.activation_checkpointing != "none")
    if plan.strategy == "zero":
        assert (out / cfg.deepspeed_config["deepspeed_config_file"]).exists()


def test_accelerate_notes_pp_and_parallelism_sizes(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    plan, out = export(tmp_path, "tp2pp2")
    text = (out / "accelerate.yaml").read_text()
    assert "pipeline parallelism (pp 2" in text
    assert load_config_from_file(str(out / "accelerate.yaml")).parallelism_config["parallelism_config_tp_size"] == 2


@pytest.mark.parametrize("name", list(PLANS))
def test_training_arguments_construct(tmp_path: Path, name: str) -> None:
    import transformers

    plan, out = export(tmp_path, name)
    fields = json.loads((out / "training_args.json").read_text())
    notes = fields.pop(NOTES_KEY)
    assert isinstance(notes, list)
    fields["bf16"] = False  # bf16 needs a GPU (or a CPU with bf16 autocast) to construct; checked below
    assert json.loads((out / "training_args.json").read_text())["bf16"] == (plan.precision == "bf16")
    if "deepspeed" in fields:
        fields["deepspeed"] = str(out / fields["deepspeed"])
        fields.pop("deepspeed")  # DeepSpeed's HF integration needs an accelerator to build its plugin
        assert (out / "deepspeed.json").exists()
    fsdp = fields.pop("fsdp", None), fields.pop("fsdp_config", None)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, **fields)
    assert args.gradient_accumulation_steps == plan.grad_accum
    assert args.per_device_train_batch_size == plan.micro_batch
    assert args.max_grad_norm == plan.grad_clip
    if plan.strategy == "fsdp":
        assert fsdp[0].startswith({"full": "full_shard", "hybrid": "hybrid_shard"}[plan.fsdp.sharding])
    if plan.tp > 1:
        assert any("tp 2 not expressible" in n for n in notes)
    if plan.ddp is not None:  # torch's flag as HF names it; absent, HF decides (on without gradient checkpointing)
        assert fields.get("ddp_find_unused_parameters") == (True if plan.ddp.find_unused_parameters else None)
        assert args.ddp_find_unused_parameters == fields.get("ddp_find_unused_parameters")


@pytest.mark.parametrize("name", ["ddp", "fsdp", "hybrid", "tp2pp2"])
def test_torchtitan_overrides_parse(tmp_path: Path, name: str) -> None:
    import tyro

    plan, out = export(tmp_path, name)
    lines = (out / "torchtitan_overrides.txt").read_text().splitlines()
    args = [line for line in lines if line and not line.startswith("#")]
    cfg = tyro.cli(Sections, args=args)
    p = cfg.parallelism
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == plan.dp_degree
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (plan.tp, plan.pp)
    assert cfg.training.global_batch_size == plan.global_batch and cfg.training.seq_len == plan.seq_len
    if name == "hybrid":
        assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (2, 2)


def test_torchtitan_zero_is_a_note(tmp_path: Path) -> None:
    _, out = export(tmp_path, "zero3")
    text = (out / "torchtitan_overrides.txt").read_text()
    assert "ZeRO not expressible" in text
    assert all(line.startswith("#") for line in text.splitlines())


def test_hybrid_without_a_group_size_shards_inside_a_node_as_the_runtime_does():
    """shard_group_size unset: the runtime shards over one node's dp ranks (hybrid_shard_degree), and
    both exports say the same split."""
    from paratune.out.export_tools import accelerate_config, data_parallel_split, torchtitan_overrides

    plan = load_plan_dict({**BASE_PLAN, "strategy": "fsdp", "num_workers": 8, "global_batch": 16,
                           "gpus_per_node": 4, "fsdp": {"sharding": "hybrid"}})
    assert data_parallel_split(plan) == (2, 4)
    cfg, _ = accelerate_config(plan)
    assert (cfg["parallelism_config"]["parallelism_config_dp_replicate_size"],
            cfg["parallelism_config"]["parallelism_config_dp_shard_size"]) == (2, 4)
    titan, _ = torchtitan_overrides(plan)
    assert "--parallelism.data_parallel_replicate_degree=2" in titan
    assert "--parallelism.data_parallel_shard_degree=4" in titan
