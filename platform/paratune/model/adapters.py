"""LoRA adapters as a plan field: peft's LoRA layers on the meta model, before any layout.

A plan with `peft: {method: lora, ...}` fine-tunes low-rank adapters and freezes the base. The
adapters are injected with peft's `inject_adapter_in_model` into the meta-built model (nothing is
allocated), before `parallelize`, so every layout wraps the same modules; the base weights keep
requires_grad False, and the optimizer gets only the trainable parameters (runner.make_optimizer).

Values go through paratune.model.materialize like every other parameter: the host template gets the
same adapters (a template hook), and `lora_values` gives peft's default init deterministically,
lora_A kaiming-uniform (a=sqrt(5)) from a generator seeded by (seed, module name), lora_B zeros:
the same numbers on every rank, every layout and in the single-process reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from paratune.model.materialize import ModelInit, module_seed
from paratune.config.plan import PeftSpec, Plan
from paratune.model.shapes import HeldParams

ADAPTER_NAME = "default"


def lora_config(spec: PeftSpec):
    """peft's LoraConfig of a plan's `peft` section (None target_modules: peft's family default)."""
    from peft import LoraConfig

    targets = spec.target_modules
    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                      target_modules=list(targets) if isinstance(targets, (list, tuple)) else targets)


def add_adapters(model: nn.Module, plan: Plan | PeftSpec, device: torch.device | None = None) -> nn.Module:
    """The plan's LoRA adapters (a plan, or its `peft` section) injected into `model` in place, on
    meta (nothing allocated); only the adapters stay trainable. No `peft`: the model as it is.
    `device`: allocated there instead, in the base layers' dtype (peft's own placement), as on a
    model ZeRO-3 has already partitioned (HF's LoRA under ZeRO-3: DeepSpeed partitions them next)."""
    spec = plan.peft if isinstance(plan, Plan) else plan
    if spec is None:
        return model
    from peft import inject_adapter_in_model

    with torch.device(device if device is not None else "meta"):
        inject_adapter_in_model(lora_config(spec), model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=device is None)
    return model


def lora_values(seed: int):
    """A materialize ValueSource: peft's default LoRA init, seeded per module (not by construction order)."""

    def source(owner: str, module: nn.Module) -> dict[str, torch.Tensor] | None:
        parts = owner.split(".")
        if "lora_B" in parts:
            return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in module._parameters.items() if v is not None}
        if "lora_A" in parts:
            weight = module._parameters["weight"]
            gen = torch.Generator().manual_seed(module_seed(seed, owner))
            value = torch.empty(weight.shape, dtype=weight.dtype)
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)  # peft's init_lora_weights=True
            return {"weight": value}
        return None

    return source


def prepare_init(init: ModelInit, plan: Plan) -> None:
    """Give `init` the adapters' structure (its host template) and values (peft's init, seeded)."""
    if plan.peft is None:
        return
    init.template_hooks.append(lambda template: add_adapters(template, plan))
    init.sources.insert(0, lora_values(plan.seed))


def add_traced_adapters(model: nn.Module, peft_json: str, precision: str) -> None:
    """A plan's adapters (its `peft`, as JSON) on the memory trace's model, made of fake tensors:
    on meta first (peft's own move to the base layer's device cannot swap fake tensors), then each
    adapter parameter made anew where torch makes tensors now (the trace's fake mode). Under
    autocast ("bf16": DDP) the frozen linears in bf16, as `store_frozen_base` keeps them."""
    add_adapters(model, PeftSpec.model_validate_json(peft_json))
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype))
    if precision == "bf16":
        for param in _frozen_linear_params(model):
            param.data = param.data.to(torch.bfloat16)


def build_adapted_model(config: Any, plan: Plan, sources: list | None = None,
                        device: str | torch.device = "cpu") -> nn.Module:
    """The whole model with the plan's adapters, materialized on `device` (the reference's model):
    the values every layout holds slice by slice. `sources`: e.g. a folder's pretrained weights."""
    from paratune.model.materialize import build_meta, materialize

    model = add_adapters(build_meta(config), plan)
    init = ModelInit(model, config, plan.seed)
    init.sources += sources or []
    prepare_init(init, plan)
    materialize(model, init, torch.device(device))
    return model


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA-wrapped layer: the original layer under `base_layer`, its adapters beside it."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def adapter_refusal(plan: Plan, config: Any = None) -> str | None:
    """Why the plan's adapters cannot run as laid out, or None: layouts not tested with LoRA, levers
    that rewrite the adapted linears, and target modules the model lacks or that are not nn.Linear
    (under tp: outside the blocks, whose linears paratune.parallel.tp lays out with their adapters)."""
    if plan.peft is None:
        return None
    degrees = {k: getattr(plan, k) for k in ("pp", "cp", "ep") if getattr(plan, k) > 1}
    if degrees:
        return (f"peft: LoRA with {', '.join(f'{k} {v}' for k, v in degrees.items())}: not supported (not tested "
                "with peft's wrapped linears); allowed: pp = cp = ep = 1 with peft (tp: with ddp or fsdp)")
    if plan.tp > 1 and plan.strategy == "zero":
        return (f"peft: LoRA with ZeRO and tp {plan.tp}: not supported (DeepSpeed's AutoTP shards linears by name and "
                "would split peft's adapters as base layers); allowed with peft and tp > 1: strategy ddp or fsdp")
    if plan.float8 != "none":
        return f"float8: '{plan.float8}' with peft: float8 would convert the adapters' linears; allowed: 'none'"
    if plan.compile:
        return "compile: true with peft: not tested with LoRA layers; allowed: false"
    from paratune.model.build import config_key
    from paratune.model.shapes import model_config_key

    key = config_key(config) if config is not None else model_config_key(plan)
    refusal = _target_refusal(key, plan.peft.model_dump_json())
    if refusal is None and plan.tp > 1 and _counts_of(key, plan.peft.model_dump_json()).root:
        return (f"peft.target_modules: {plan.peft.target_modules!r} adapts a module outside the decoder blocks (the LM "
                f"head) with tp {plan.tp}: not supported; allowed with tp > 1: the blocks' linears")
    return refusal


@functools.lru_cache(maxsize=64)
def _target_refusal(key: str, peft_json: str) -> str | None:
    """Why the adapters' target modules cannot be adapted, checked on a one-block meta model (the
    blocks repeat; a space's plans share one answer)."""
    from paratune.model.materialize import build_meta
    from paratune.model.build import config_from_key

    spec = PeftSpec.model_validate_json(peft_json)
    try:
        model = add_adapters(build_meta(config_from_key(key, num_hidden_layers=1)), spec)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        return f"peft.target_modules: {spec.target_modules!r}: {err}; allowed: names of the model's linear layers"
    wrapped = [(n, m) for n, m in model.named_modules() if is_lora_layer(m)]
    if not wrapped:
        return f"peft.target_modules: {spec.target_modules!r} adapts no module of the model"
    other = [n for n, m in wrapped if type(m.base_layer) is not nn.Linear]
    if other:
        return (f"peft.target_modules: {spec.target_modules!r} adapts {other[0]} "
                f"({type(dict(wrapped)[other[0]].base_layer).__name__}); allowed: nn.Linear layers only")
    return None


@dataclass(frozen=True)
class AdapterCounts:
    """Parameter counts of a plan's LoRA adapters, by place (the memory and time models' input:
    under LoRA only these have gradients, optimizer states and gradient traffic)."""

    per_block: int  # the adapters of one decoder block (they repeat)
    root: int  # adapters outside the blocks (e.g. an adapted lm_head)
    largest: int  # the largest single adapter tensor
    frozen_linear_per_block: int = 0  # one block's frozen nn.Linear weights and biases (`store_frozen_base`)
    frozen_linear_root: int = 0  # ... outside the blocks (an untied lm_head)


@functools.lru_cache(maxsize=64)
def _counts_of(config_key: str, peft_json: str) -> AdapterCounts:
    from paratune.model.materialize import build_meta
    from paratune.model.build import config_from_key, decoder_blocks

    spec = PeftSpec.model_validate_json(peft_json)
    model = build_meta(config_from_key(config_key, num_hidden_layers=1))
    add_adapters(model, spec)
    in_block = {id(p) for block in decoder_blocks(model) for p in block.parameters()}
    adapters = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    block = sum(p.numel() for _, p in adapters if id(p) in in_block)
    linears = {id(p): p.numel() for p in _frozen_linear_params(model)}
    linear_block = sum(n for pid, n in linears.items() if pid in in_block)
    return AdapterCounts(block, sum(p.numel() for _, p in adapters) - block, max((p.numel() for _, p in adapters), default=0),
                         linear_block, sum(linears.values()) - linear_block)


def _frozen_linear_params(model: nn.Module) -> list[nn.Parameter]:
    """The frozen nn.Linear weights and biases (the base layers, an untied head), not one tied to
    another module (a tied head is the embedding, which autocast does not cast)."""
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    return list({id(p): p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)
                 if not p.requires_grad and id(p) not in elsewhere}.values())


def frozen_base_dtype(plan: Plan) -> torch.dtype:
    """The dtype LoRA's frozen linears are kept in: bf16 in a bf16 DDP plan, where autocast would
    round their fp32 copies to the same bf16 at every matmul (`store_frozen_base`), else fp32."""
    if plan.peft is not None and plan.precision == "bf16" and plan.strategy == "ddp":
        return torch.bfloat16
    return torch.float32


def store_frozen_base(model: nn.Module, plan: Plan) -> None:
    """Keep the frozen linears of a meta-built LoRA model in `frozen_base_dtype` before it is
    materialized (the values are then filled, rounded, into them): autocast's own cast of an fp32
    weight to bf16 rounds to nearest as the fill does, so each matmul sees the same numbers, and
    the base costs 2 bytes a parameter, not 4 (a 7B base: 15 GB, not 30). Norms and embeddings,
    which autocast leaves in fp32, stay fp32."""
    dtype = frozen_base_dtype(plan)
    if dtype == torch.float32:
        return
    frozen = {id(p) for p in _frozen_linear_params(model)}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in frozen and param.is_meta:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)


def adapter_counts(plan: Plan) -> AdapterCounts | None:
    """The plan's adapter counts (counted on a one-block meta model), or None without `peft`."""
    if plan.peft is None:
        return None
    from paratune.model.shapes import model_config_key

    return _counts_of(model_config_key(plan), plan.peft.model_dump_json())


def adapted_params(plan: Plan, held: HeldParams, layers_here: int) -> tuple[HeldParams, HeldParams]:
    """(what a rank holds, what it trains), by place, for a rank holding `layers_here` blocks:
    without `peft` both are `held`; with LoRA the rank holds the base and the adapters, and trains
    (keeps gradients, optimizer states, gradient traffic for) the adapters only."""
    counts = adapter_counts(plan)
    if counts is None:
        return held, held
    local = counts.per_block * layers_here + counts.root
    holds = replace(held, local=held.local + local, layer=held.layer + counts.per_block,
                    first=held.first + counts.per_block, root=held.root + counts.root)
    trains = HeldParams(local=local, layer=counts.per_block, first=counts.per_block, root=counts.root,
                        head=counts.root, embedding=0.0, largest=counts.largest)
    return holds, trains


def frozen_base_saving(plan: Plan, layers_here: int) -> float:
    """Bytes a rank's weights take less when its frozen linears are kept in bf16 (`store_frozen_base`)."""
    counts = adapter_counts(plan)
    if counts is None or frozen_base_dtype(plan) == torch.float32:
        return 0.0
    return 2.0 * (counts.frozen_linear_per_block * layers_here + counts.frozen_linear_root)
