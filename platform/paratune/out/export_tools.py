"""The winner as other tools' configs (accelerate, HF TrainingArguments, torchtitan), so it can be
used outside paratune; what a tool cannot express is written into the file as a note, never dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from paratune.levers import export_notes
from paratune.config.plan import Plan

NOTES_KEY = "_paratune_notes"
TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}


def _common_notes(plan: Plan, tool: str) -> list[str]:
    notes = []
    if plan.env:
        notes.append(f"{tool}: communication env vars ({', '.join(sorted(plan.env))}) are in env.sh; source it first")
    return notes + export_notes(plan, tool)  # what the tool cannot express of the levers (paratune.levers)


def block_class_name(plan: Plan) -> str | None:
    """The decoder block's class name (meta build: no memory); None when it cannot be built."""
    try:
        from paratune.model.materialize import build_meta
        from paratune.model.build import build_config, decoder_blocks

        return type(decoder_blocks(build_meta(build_config(plan.model, plan.model_overrides)))[0]).__name__
    except Exception:  # noqa: BLE001 - a name is a convenience; the file says it is missing
        return None


def data_parallel_split(plan: Plan) -> tuple[int, int]:
    """(replicate, shard) degrees of the dp ranks, as paratune lays them out: ddp and no_shard
    replicate, full / grad_op shard, hybrid shards inside groups of the runtime's own size (the
    plan's shard_group_size, else one node's dp ranks: paratune.parallel.dims.hybrid_shard_degree)."""
    dp = plan.dp_degree
    if plan.strategy == "ddp" or (plan.fsdp is not None and plan.fsdp.sharding == "no_shard"):
        return dp, 1
    if plan.fsdp is not None and plan.fsdp.sharding == "hybrid":
        from paratune.parallel.dims import hybrid_shard_degree

        shard = hybrid_shard_degree(plan, plan.gpus_per_node or plan.num_workers)
        return dp // shard, shard
    return 1, dp


def accelerate_config(plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """An `accelerate launch --config_file` config (accelerate 1.15 ClusterConfig keys)."""
    notes = _common_notes(plan, "accelerate")
    nodes = max(1, plan.num_workers // plan.gpus_per_node) if plan.gpus_per_node else 1
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "num_processes": plan.num_workers,
                           "num_machines": nodes, "machine_rank": 0,
                           "mixed_precision": "bf16" if plan.precision == "bf16" else "no"}
    if plan.gpus_per_node is None:
        notes.append("accelerate: gpus_per_node unknown; num_machines 1 assumed")
    if plan.strategy == "fsdp":
        f = plan.fsdp
        assert f is not None
        cfg["distributed_type"] = "FSDP"
        fsdp: dict[str, Any] = {"fsdp_version": 2, "fsdp_reshard_after_forward": f.reshards_after_forward,
                                "fsdp_offload_params": f.cpu_offload, "fsdp_cpu_ram_efficient_loading": True,
                                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                "fsdp_activation_checkpointing": plan.activation_checkpointing != "none"}
        name = block_class_name(plan)
        if name:
            fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = name
        else:
            notes.append("accelerate: decoder block class unknown; set fsdp_transformer_layer_cls_to_wrap")
        if plan.activation_checkpointing in ("selective", "selective_op", "layers"):
            notes.append(f"accelerate: activation_checkpointing '{plan.activation_checkpointing}' becomes full "
                         "per-block checkpointing (accelerate has no selective/every-N form)")
        if f.sharding == "hybrid":
            notes.append("accelerate: hybrid sharding via parallelism_config dp_replicate_size x dp_shard_size")
        if f.prefetch:
            notes.append(f"accelerate: explicit prefetch of {f.prefetch} blocks not expressible")
        cfg["fsdp_config"] = fsdp
    elif plan.strategy == "zero":
        z = plan.zero
        assert z is not None
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {"deepspeed_config_file": "deepspeed.json", "zero3_init_flag": z.stage == 3}
        cfg.pop("mixed_precision")  # deepspeed.json holds it; accelerate refuses both
        if plan.activation_checkpointing != "none":
            notes.append("accelerate: activation checkpointing is the model's (model.gradient_checkpointing_enable())")
    else:
        cfg["distributed_type"] = "MULTI_GPU"
        notes.append(f"accelerate: DDP bucket_cap_mb {plan.ddp.bucket_cap_mb} goes in DistributedDataParallelKwargs "
                     f"{'(with find_unused_parameters=True) ' if plan.ddp.find_unused_parameters else ''}(code, not config)")
    if plan.strategy == "fsdp" and (plan.tp > 1 or plan.cp > 1 or (plan.fsdp and plan.fsdp.sharding == "hybrid")):
        replicate, shard = data_parallel_split(plan)
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate,
                                     "parallelism_config_dp_shard_size": shard,
                                     "parallelism_config_tp_size": plan.tp, "parallelism_config_cp_size": plan.cp}
    elif plan.tp > 1 or plan.cp > 1:
        notes.append(f"accelerate: tp {plan.tp} / cp {plan.cp} need FSDP2 in accelerate; not expressed for {plan.strategy}")
    if plan.pp > 1:
        notes.append(f"accelerate: pipeline parallelism (pp {plan.pp}, {plan.pp_schedule}) not supported")
    if plan.ep > 1:
        notes.append(f"accelerate: expert parallelism (ep {plan.ep}) not supported")
    if plan.compile:
        cfg["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
        notes.append("accelerate: compile is whole-model here; paratune compiles each block")
    return cfg, notes


def training_arguments(plan: Plan, deepspeed_path: str = "deepspeed.json") -> tuple[dict[str, Any], list[str]]:
    """transformers.TrainingArguments fields (notes returned separately: not a TrainingArguments field)."""
    from paratune.parallel.runner import ADAM_BETAS, ADAM_EPS

    notes = _common_notes(plan, "TrainingArguments")
    args: dict[str, Any] = {"per_device_train_batch_size": plan.micro_batch,
                            "gradient_accumulation_steps": plan.grad_accum, "learning_rate": plan.lr,
                            "weight_decay": plan.weight_decay, "max_grad_norm": plan.grad_clip,
                            "adam_beta1": ADAM_BETAS[0], "adam_beta2": ADAM_BETAS[1], "adam_epsilon": ADAM_EPS,
                            "bf16": plan.precision == "bf16", "optim": "adamw_torch",
                            "gradient_checkpointing": plan.activation_checkpointing != "none",
                            "torch_compile": plan.compile, "seed": plan.seed}
    if plan.activation_checkpointing in ("selective", "selective_op", "layers"):
        notes.append(f"TrainingArguments: '{plan.activation_checkpointing}' checkpointing becomes full")
    if plan.strategy == "fsdp":
        f = plan.fsdp
        assert f is not None
        mode = {"full": "full_shard", "grad_op": "shard_grad_op", "hybrid": "hybrid_shard", "no_shard": "no_shard"}
        args["fsdp"] = mode[f.sharding] + (" offload" if f.cpu_offload else "") + " auto_wrap"
        cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": f.reshards_after_forward}
        name = block_class_name(plan)
        if name:
            cfg["transformer_layer_cls_to_wrap"] = [name]
        args["fsdp_config"] = cfg
    elif plan.strategy == "zero":
        args["deepspeed"] = deepspeed_path
    else:
        args["ddp_bucket_cap_mb"] = int(plan.ddp.bucket_cap_mb)
        if plan.ddp.bucket_cap_mb != int(plan.ddp.bucket_cap_mb):
            notes.append(f"TrainingArguments: ddp_bucket_cap_mb is an int; {plan.ddp.bucket_cap_mb} rounded down")
        if plan.ddp.find_unused_parameters:
            args["ddp_find_unused_parameters"] = True
    for name, degree in (("tp", plan.tp), ("pp", plan.pp), ("cp", plan.cp), ("ep", plan.ep)):
        if degree > 1:
            notes.append(f"TrainingArguments: {name} {degree} not expressible")
    notes.append(f"TrainingArguments: world size {plan.num_workers} comes from the launcher, not these args")
    return args, notes


def _flag(key: str, on: bool) -> str:
    """tyro's boolean form: `--a.b` / `--a.no-b` (it refuses `--a.b=False`)."""
    section, name = key.rsplit(".", 1)
    return f"--{key}" if on else f"--{section}.no-{name}"


def torchtitan_overrides(plan: Plan) -> tuple[list[str] | None, list[str]]:
    """torchtitan 0.3 CLI overrides (it reads a Python config registry plus `--section.key value`,
    no TOML); None for ZeRO, which torchtitan cannot express."""
    notes = _common_notes(plan, "torchtitan")
    if plan.strategy == "zero":
        return None, notes + ["torchtitan: DeepSpeed ZeRO not expressible (torchtitan shards with FSDP2); no file"]
    replicate, shard = data_parallel_split(plan)
    args = [f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}",
            f"--parallelism.tensor_parallel_degree={plan.tp}",
            f"--parallelism.pipeline_parallel_degree={plan.pp}",
            f"--parallelism.pipeline_parallel_schedule={TITAN_SCHEDULES[plan.pp_schedule]}",
            f"--parallelism.context_parallel_degree={plan.cp}",
            f"--parallelism.expert_parallel_degree={plan.ep}",
            f"--training.local_batch_size={plan.micro_batch * plan.grad_accum}",
            f"--training.global_batch_size={plan.global_batch}",
            f"--training.seq_len={plan.seq_len}",
            f"--training.max_norm={plan.grad_clip}",
            f"--training.mixed_precision_param={'bfloat16' if plan.precision == 'bf16' else 'float32'}",
            _flag("compile.enable", plan.compile)]
    if plan.tp > 1:
        args.append(_flag("parallelism.enable_sequence_parallel", plan.sequence_parallel))
    if plan.grad_accum > 1:
        notes.append(f"torchtitan: local_batch_size = micro_batch x grad_accum; micro-batch "
                     f"{plan.micro_batch} via --parallelism.pipeline_parallel_microbatch_size (pp) or accumulation")
    if plan.activation_checkpointing != "none":
        mode = {"selective": "selective", "selective_op": "selective", "full": "full",
                "layers": "selective"}[plan.activation_checkpointing]
        option = " with selective_ac_option 'op' (its own op-level policy)" if (
            plan.activation_checkpointing == "selective_op") else ""
        notes.append(f"torchtitan: activation checkpointing '{mode}'{option} (every {plan.checkpoint_every} layers "
                     "for 'layers') goes in the config registry's activation_checkpoint section")
    if plan.strategy == "fsdp" and plan.fsdp.cpu_offload:
        args.append(_flag("training.enable_cpu_offload", True))
    if plan.ddp is not None:
        notes.append(f"torchtitan: DDP bucket_cap_mb {plan.ddp.bucket_cap_mb}"
                     f"{' and find_unused_parameters' if plan.ddp.find_unused_parameters else ''} not expressible")
    notes.append("torchtitan: add --module <model> --config <registry function> (paratune's model is not in its registry)")
    return args, notes


def write_tool_configs(plan: Plan, out_dir: Path) -> list[Path]:
    """accelerate.yaml, training_args.json (+ training_args_notes.txt), torchtitan_overrides.txt."""
    written = []
    acc, acc_notes = accelerate_config(plan)
    path = out_dir / "accelerate.yaml"
    path.write_text("".join(f"# NOTE {n}\n" for n in acc_notes) + yaml.safe_dump(acc, sort_keys=False))
    written.append(path)
    ta, ta_notes = training_arguments(plan)
    path = out_dir / "training_args.json"
    path.write_text(json.dumps({**ta, NOTES_KEY: ta_notes}, indent=2) + "\n")
    written.append(path)
    titan, titan_notes = torchtitan_overrides(plan)
    path = out_dir / "torchtitan_overrides.txt"
    body = "\n".join(titan) + "\n" if titan else ""
    path.write_text("".join(f"# NOTE {n}\n" for n in titan_notes) + body)
    written.append(path)
    return written
