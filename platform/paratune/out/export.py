"""The winner, ready to use: plan YAML, the DeepSpeed JSON or FSDP settings it implies, env vars,
and the exact commands that train with it: `paratune train` where the sweep ran, and the
`ray job submit` command for the Ray cluster."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from paratune.config.plan import Plan

JOB_ADDRESS = "http://127.0.0.1:8265"  # the dashboard/job server, reached via SSH port forwarding
# What a training job needs from the driver's environment (the sweep's): where results go, shared
# storage for checkpoints, the MLflow server.
JOB_ENV = ("PARATUNE_HOME", "PARATUNE_STORAGE", "MLFLOW_TRACKING_URI")
TRAIN_STEPS, CHECKPOINT_EVERY = 1000, 100


def own_command() -> str:
    """How to run this paratune from the user's shell: `paratune` when that name on PATH is this
    installation, else the script's full path (a venv not activated), else `python -m paratune`."""
    here = Path(sys.executable).parent / "paratune"
    found = shutil.which("paratune")
    if found and here.exists() and Path(found).resolve() == here.resolve():
        return "paratune"
    return str(here) if here.exists() else f"{shlex.quote(sys.executable)} -m paratune"


def train_command(plan_path: str, steps: int = TRAIN_STEPS, checkpoint_every: int = CHECKPOINT_EVERY,
                  name: str | None = None) -> str:
    """`paratune train` with an exported plan, where the sweep ran (a local sweep's next step)."""
    name_arg = f" --name {shlex.quote(name)}" if name else ""
    return (f"{own_command()} train {shlex.quote(plan_path)} --steps {steps} --checkpoint-every {checkpoint_every}"
            f"{name_arg}")


def fsdp_settings(plan: Plan) -> dict[str, Any]:
    """What to pass to torch.distributed.fsdp.fully_shard (FSDP2), per decoder block then root."""
    f = plan.fsdp
    assert f is not None
    return {
        "api": "torch.distributed.fsdp.fully_shard" if f.sharding != "no_shard"
        else "torch.distributed._composable.replicate_with_fsdp.replicate",
        "sharding": f.sharding,
        "mesh": {"hybrid": ["replicate", "shard"]}.get(f.sharding, ["shard"] if f.sharding != "no_shard" else ["replicate"]),
        "shard_group_size": f.shard_group_size,
        "reshard_after_forward": f.reshards_after_forward,
        "forward_backward_prefetch_blocks": f.prefetch,
        "mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"} if plan.precision == "bf16" else None,
        "offload_policy": "CPUOffloadPolicy" if f.cpu_offload else None,
        "activation_checkpointing": plan.activation_checkpointing,
        **expert_parallel_settings(plan),
    }


def expert_parallel_settings(plan: Plan) -> dict[str, Any]:
    """How the winner lays out experts (paratune.parallel.ep), for a training script to follow; empty without ep."""
    if plan.ep == 1:
        return {}
    experts = ("torch.distributed.fsdp.fully_shard per experts module over the expert_dp ranks, "
               "set_gradient_divide_factor(dp)" if plan.strategy == "fsdp"
               else "left out of DDP; gradients all-reduced over the expert_dp ranks and divided by dp once per step")
    return {"expert_parallel": {
        "ep": plan.ep, "expert_dp": plan.expert_dp_degree, "dp": plan.dp_degree,
        "mesh": ["pp", "edp", "ep", "etp"], "mesh_shape": [plan.pp, plan.expert_dp_degree, plan.ep, 1],
        "experts_per_rank": "E / ep of every layer's routed experts (the family's base_model_ep_plan)",
        "dispatch": "transformers.distributed.expert_parallel.AllToAllEP (dropless all-to-all)",
        "expert_gradients": experts}}


def ddp_settings(plan: Plan) -> dict[str, Any]:
    d = plan.ddp
    assert d is not None
    return {"api": "torch.nn.parallel.DistributedDataParallel", **d.model_dump(),
            "autocast": "bfloat16" if plan.precision == "bf16" else None,
            "activation_checkpointing": plan.activation_checkpointing, **expert_parallel_settings(plan)}


def job_command(plan_path: str, steps: int = TRAIN_STEPS, checkpoint_every: int = CHECKPOINT_EVERY,
                name: str | None = None, env: dict[str, str] | None = None) -> str:
    """The `ray job submit` command that trains with an exported plan on the Ray cluster.

    paratune is installed in the cluster's image (README "On a GPU cluster"): the entry point is
    `python -m paratune train`, and the job's environment comes inline (`env`: default, the
    driver's own JOB_ENV settings), so nothing is needed from the directory it is typed in. The
    plan path is absolute: the job's driver runs on the machine the sweep ran on (the head)."""
    env = {k: v for k in JOB_ENV if (v := os.environ.get(k))} if env is None else env
    runtime = f" --runtime-env-json {shlex.quote(json.dumps({'env_vars': env}))}" if env else ""
    name_arg = f" --name {shlex.quote(name)}" if name else ""
    return (f"ray job submit --address {JOB_ADDRESS}{runtime} -- python -m paratune train {shlex.quote(plan_path)} "
            f"--steps {steps} --checkpoint-every {checkpoint_every}{name_arg}")


def on_a_cluster() -> bool:
    """Whether this process joined a running Ray cluster (RAY_ADDRESS: a job, or a user's `ray
    start` cluster) rather than starting its own in-process one: which training command fits."""
    return os.environ.get("RAY_ADDRESS", "local") not in ("", "local")


def export_winner(plan: Plan, out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """Write the winner's files; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def write(name: str, text: str) -> None:
        path = out_dir / name
        path.write_text(text)
        written.append(path)

    write("plan.yaml", "# paratune winner: " + summary.get("label", plan.strategy) + "\n" + plan.to_yaml())
    if plan.strategy == "zero":
        from paratune.parallel.zero import deepspeed_config

        write("deepspeed.json", json.dumps(deepspeed_config(plan, on_gpu=True), indent=2) + "\n")
    elif plan.strategy == "fsdp":
        write("fsdp.json", json.dumps(fsdp_settings(plan), indent=2) + "\n")
    else:
        write("ddp.json", json.dumps(ddp_settings(plan), indent=2) + "\n")
    env_lines = ["# Communication settings of the winner: set before the process group starts"]
    env_lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(plan.env.items())] or ["# (none: defaults won)"]
    write("env.sh", "\n".join(env_lines) + "\n")
    plan_path = str((out_dir / "plan.yaml").resolve())
    name = f"{out_dir.resolve().parent.name}-train"  # one per sweep folder
    write("train.sh", "#!/usr/bin/env bash\n# Train with the winner where the sweep ran (checkpoints, resumes with\n"
          "# the same --name):\n" + train_command(plan_path, name=name) + "\n")
    write("job.sh", "#!/usr/bin/env bash\n# Train with the winner on the Ray cluster (paratune installed in its image;\n"
          "# needs RAY_AUTH_MODE=token and the cluster's token, see README 'On a GPU cluster'):\n"
          + job_command(plan_path, name=name) + "\n")
    write("summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    from paratune.out.export_tools import write_tool_configs

    written += write_tool_configs(plan, out_dir)
    return written
