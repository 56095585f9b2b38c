"""The parallel degrees' static rules (tp, pp, cp, ep with the strategy and the model's shape).

Checked by the Plan's validator (paratune.config.plan) before any worker starts, with the model's
config.json numbers where a rule needs them; what needs the built model is paratune.checks.preflight's.
No torch, and no import of paratune.config.plan (the Plan is typed as Any here to keep the import one-way).
"""

from __future__ import annotations

from typing import Any

from paratune.config.sizes import EXPERT_COUNT_KEYS, ConfigSizes, config_sizes


def _factorizations(world: int) -> str:
    return ", ".join(f"dp{world // (t * p)} x tp{t} x pp{p}" for t in range(1, world + 1) if world % t == 0
                     for p in range(1, world // t + 1) if (world // t) % p == 0)


def _model_numbers(plan: Any) -> ConfigSizes | None:
    """The model's shape for the rules that need it (paratune.config.sizes: aliases such as Bloom's
    n_head and class defaults resolved as transformers does); None when its config cannot be read
    (the model's own error is reported where the model is built)."""
    from paratune.config.model_config import ModelError, load_config_dict

    try:
        return config_sizes(load_config_dict(plan.model, plan.model_overrides))
    except ModelError:
        return None


def check_degrees(plan: Any) -> None:
    """Static rules of the parallel degrees (torchtitan's ParallelDims, with the model's shape)."""
    tp, pp, world = plan.tp, plan.pp, plan.num_workers
    if world % (tp * pp * plan.cp):
        if plan.cp > 1:
            raise ValueError(f"num_workers: {world} is not divisible by tp x pp x cp = {tp} x {pp} x {plan.cp}; "
                             f"allowed cp: {[c for c in range(1, world + 1) if world % (tp * pp * c) == 0]}")
        raise ValueError(
            f"num_workers: {world} is not divisible by tp x pp = {tp} x {pp}; allowed: "
            f"{_factorizations(world)[:400]}")
    if plan.cp > 1:
        _check_cp_degrees(plan)
    if plan.ep > 1:
        _check_ep_degrees(plan)
    if plan.sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel: true needs tp > 1, got tp 1; allowed: false with tp 1")
    if plan.pp_schedule != "1f1b" and pp == 1:  # the same training as 1f1b: a sweep would run it twice
        raise ValueError(f"pp_schedule: '{plan.pp_schedule}' needs pp > 1, got pp 1; allowed: '1f1b' with pp 1")
    if tp == 1 and pp == 1:
        return
    if plan.strategy == "zero":
        _check_zero_degrees(plan)
    if plan.fsdp is not None:
        _check_fsdp_degrees(plan.fsdp, plan)
    if tp > 1 and plan.gpus_per_node and (tp > plan.gpus_per_node or plan.gpus_per_node % tp):
        raise ValueError(f"tp: {tp} crosses node boundaries (gpus_per_node {plan.gpus_per_node}); allowed: "
                         f"{[d for d in range(1, plan.gpus_per_node + 1) if plan.gpus_per_node % d == 0]}")
    config = _model_numbers(plan)
    if config is None:
        return
    heads, kv_heads, layers = config.heads, config.kv_heads, config.layers
    if tp > 1 and config.tp_plan_shipped and (heads % tp or kv_heads % tp):
        raise ValueError(f"tp: {tp} must divide attention heads ({heads}) and KV heads ({kv_heads}); allowed: "
                         f"{[d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]}")
    if tp > 1 and config.vocab % tp:
        raise ValueError(f"tp: {tp} must divide vocab_size {config.vocab} (embedding and head are sharded)")
    if pp > 1:
        stages = pp * (2 if plan.pp_schedule == "interleaved_1f1b" else 1)
        if layers < stages:
            raise ValueError(f"pp: {pp} with schedule '{plan.pp_schedule}' needs >= {stages} layers, model has "
                             f"{layers}; allowed pp: {[d for d in range(1, layers + 1) if stages // pp * d <= layers]}")


# Why context parallelism cannot run on CPU workers (torch 2.13): its ring attention replaces the
# CUDA SDPA kernels only (flash, efficient, cudnn); CPU's SDPA kernel has no sharding rule.
CP_CPU_REASON = ("torch 2.13's context parallel rings only CUDA's SDPA kernels (flash, efficient, cudnn); on CPU: "
                 "'Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
                 "strategy registered'")


def _check_cp_degrees(plan: Any) -> None:
    """Context parallelism: what torch's context_parallel and paratune's step support."""
    cp = plan.cp
    if plan.seq_len % (2 * cp):
        raise ValueError(f"cp: {cp} needs seq_len divisible by 2 x cp = {2 * cp} (each rank takes a head and a tail "
                         f"chunk of every sequence, balancing causal attention), got seq_len {plan.seq_len}; allowed "
                         f"cp: {[c for c in range(1, plan.seq_len // 2 + 1) if plan.seq_len % (2 * c) == 0][:12]}")
    if plan.device == "cpu":
        raise ValueError(f"cp: {cp} with device 'cpu': {CP_CPU_REASON}; allowed: cp 1 on CPU")
    if plan.strategy == "zero":
        raise ValueError(f"cp: {cp} with strategy 'zero': DeepSpeed's engine has no context-parallel group; "
                         "allowed: cp with 'fsdp' or 'ddp'")
    if plan.pp > 1:
        raise ValueError(f"cp: {cp} together with pp {plan.pp} is not wired (pipeline stages would have to carry "
                         "the sequence shards and their positions); allowed: cp with tp and dp")
    if plan.fsdp is not None and plan.fsdp.sharding == "hybrid":
        raise ValueError(f"cp: {cp} with fsdp.sharding 'hybrid'; allowed: 'full', 'grad_op' or 'no_shard' "
                         "(cp is folded into the shard group)")
    if plan.sequence_parallel and plan.seq_len % (cp * plan.tp):
        raise ValueError(f"cp: {cp} with sequence_parallel needs seq_len divisible by cp x tp = {cp * plan.tp} (each "
                         f"rank's shard is split again over tp), got seq_len {plan.seq_len}")
    # Attention kernels and sliding windows are the model's: paratune.checks.preflight checks them before launch.
    if plan.device == "cuda" and plan.precision == "fp32":
        config = _model_numbers(plan)
        if config is None:
            return
        heads, kv_heads = config.heads, config.kv_heads
        if kv_heads != heads:
            raise ValueError(f"cp: {cp} with precision 'fp32' and grouped-query attention ({heads} heads, {kv_heads} "
                             "KV heads): CUDA runs fp32 GQA on SDPA's math kernel only, which context parallel cannot "
                             "ring; allowed: precision 'bf16' (flash attention)")


def routed_expert_count(config: dict[str, Any]) -> int | None:
    """The number of routed experts a config.json dict declares, None for a dense model."""
    for key in EXPERT_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value
    return None


def _check_ep_degrees(plan: Any) -> None:
    """Expert parallelism: what paratune.parallel.ep composes with (the rest is refused here)."""
    ep, dp = plan.ep, plan.dp_degree
    if dp % ep:
        raise ValueError(f"ep: {ep} must divide the data-parallel degree {dp} (num_workers / (tp x pp x cp)): the "
                         f"experts are split over dp ranks; allowed ep: {[d for d in range(1, dp + 1) if dp % d == 0]}")
    if plan.strategy == "zero":
        raise ValueError(f"ep: {ep} with strategy 'zero': DeepSpeed's expert parallelism needs its own MoE layer "
                         "(deepspeed.moe.layer.MoE), which transformers' models do not use, and ZeRO would gather "
                         "experts that are meant to stay apart; allowed: ep with 'ddp' or 'fsdp', or ep 1 with zero")
    if plan.tp > 1 and plan.sequence_parallel:
        raise ValueError(f"ep: {ep} with tp {plan.tp} and sequence_parallel: the MoE layer's input and output "
                         "would be sequence-sharded across the tp group, which the dispatch does not follow (it "
                         "slices a replicated input by token); allowed: sequence_parallel false with ep")
    if plan.cp > 1:
        raise ValueError(f"ep: {ep} with cp {plan.cp} is not wired (the cp ranks' sequence shards would join the "
                         "expert groups); allowed: cp 1 with ep")
    if plan.compile:
        raise ValueError(f"ep: {ep} with compile: true: the dispatch reads each layer's split sizes back to the "
                         "host (dropless all-to-all), a graph break in every block; allowed: compile false with ep")
    if plan.fsdp is not None and plan.fsdp.sharding in ("hybrid", "no_shard"):
        raise ValueError(f"ep: {ep} with fsdp.sharding '{plan.fsdp.sharding}': the experts are sharded over the "
                         "dp ranks ep does not use, the dense part over all of them; allowed: 'full' or 'grad_op'")
    config = _model_numbers(plan)
    if config is None:
        return
    experts = config.experts  # None: dense, or kept elsewhere (the preflight builds the model)
    if experts is not None and experts % ep:
        raise ValueError(f"ep: {ep} must divide the model's {experts} routed experts; allowed ep: "
                         f"{[d for d in range(1, min(experts, dp) + 1) if experts % d == 0 and dp % d == 0]}")


def _check_zero_degrees(plan: Any) -> None:
    """DeepSpeed ZeRO with tensor/pipeline degrees (what DeepSpeed 0.19.8 itself supports).

    tp: DeepSpeed's AutoTP training shards the model in `deepspeed.initialize` and composes with
    every ZeRO stage and offload (ZeRO over the dp ranks; parity in test_zero_model_parallel.py).
    pp: DeepSpeed pipelines only its own PipelineModule, with ZeRO stage 0-1
    (deepspeed/runtime/pipe/engine.py); paratune's stages are torch.distributed.pipelining's."""
    if plan.pp > 1:
        raise ValueError(f"pp: {plan.pp} with strategy 'zero'; allowed: pp 1 (DeepSpeed 0.19.8 pipelines only its "
                         "own PipelineModule, with ZeRO stage 0-1 at most; paratune's pipeline is "
                         "torch.distributed.pipelining), or strategy 'ddp'/'fsdp' with pp")
    if plan.sequence_parallel:
        raise ValueError("sequence_parallel: true with strategy 'zero'; allowed: false (DeepSpeed 0.19.8 AutoTP "
                         "shards linear layers only, it has no sequence-parallel norms), or strategy 'ddp'/'fsdp'")


def _check_fsdp_degrees(options: Any, plan: Any) -> None:
    """FSDP2 shardings on the dp axis of a tp/pp mesh."""
    if options.sharding == "hybrid" and options.shard_group_size is None and plan.gpus_per_node:
        per_node = plan.gpus_per_node // plan.tp  # dp ranks inside one node
        if per_node < 2 or plan.dp_degree % min(per_node, plan.dp_degree):
            raise ValueError(f"fsdp.sharding: 'hybrid' shards over the dp ranks of a node, {plan.gpus_per_node} GPUs "
                             f"/ tp {plan.tp} = {per_node}, which must be >= 2 and divide dp {plan.dp_degree}; "
                             "allowed: 'full' or 'grad_op', or set fsdp.shard_group_size")
