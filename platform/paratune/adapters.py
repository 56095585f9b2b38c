"""LoRA adapters as a plan field: peft's LoRA layers on the meta model, before any layout.

A plan with `peft: {method: lora, ...}` fine-tunes low-rank adapters and freezes the base. The
adapters are injected with peft's `inject_adapter_in_model` into the meta-built model (nothing is
allocated), before `parallelize`, so every layout wraps the same modules; the base weights keep
requires_grad False, and the optimizer gets only the trainable parameters (runner.make_optimizer).

Values go through paratune.materialize like every other parameter: the host template gets the
same adapters (a template hook), and `lora_values` gives peft's default init deterministically,
lora_A kaiming-uniform (a=sqrt(5)) from a generator seeded by (seed, module name), lora_B zeros:
the same numbers on every rank, every layout and in the single-process reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paratune.materialize import ModelInit, module_seed
from paratune.plan import Plan

# Layouts LoRA runs under (tested for loss parity against the reference); the rest are refused
# before any worker starts (`adapter_refusal`).
SUPPORTED_STRATEGIES = ("ddp", "fsdp")
ADAPTER_NAME = "default"


def lora_config(plan: Plan):
    """peft's LoraConfig of the plan's `peft` section (None target_modules: peft's family default)."""
    from peft import LoraConfig

    spec = plan.peft
    targets = spec.target_modules
    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                      target_modules=list(targets) if isinstance(targets, (list, tuple)) else targets)


def add_adapters(model: nn.Module, plan: Plan) -> nn.Module:
    """The plan's LoRA adapters injected into `model` in place (on meta: the adapters on meta too);
    only the adapters stay trainable. A plan without `peft` leaves the model as it is."""
    if plan.peft is None:
        return model
    from peft import inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(lora_config(plan), model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)
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


def build_adapted_model(config: Any, plan: Plan, sources: list | None = None,
                        device: str | torch.device = "cpu") -> nn.Module:
    """The whole model with the plan's adapters, materialized on `device` (the reference's model):
    the values every layout holds slice by slice. `sources`: e.g. a folder's pretrained weights."""
    from paratune.materialize import build_meta, materialize

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
    that rewrite the adapted linears, and target modules the model lacks or that are not nn.Linear."""
    if plan.peft is None:
        return None
    degrees = {k: getattr(plan, k) for k in ("tp", "pp", "cp", "ep") if getattr(plan, k) > 1}
    if degrees:
        return (f"peft: LoRA with {', '.join(f'{k} {v}' for k, v in degrees.items())}: not supported (the tp/pp/cp/ep "
                "plans name the original linears, which peft wraps); allowed: tp = pp = cp = ep = 1 with peft")
    if plan.strategy not in SUPPORTED_STRATEGIES:
        return (f"strategy: '{plan.strategy}' with peft: not supported (DeepSpeed's own construction and "
                f"optimizer do not see the frozen base); allowed with peft: {', '.join(SUPPORTED_STRATEGIES)}")
    if plan.float8 != "none":
        return f"float8: '{plan.float8}' with peft: float8 would convert the adapters' linears; allowed: 'none'"
    if plan.compile:
        return "compile: true with peft: not tested with LoRA layers; allowed: false"
    if config is None:
        from paratune.models import build_config

        config = build_config(plan.model, plan.model_overrides)
    from paratune.materialize import build_meta

    try:
        model = add_adapters(build_meta(config), plan)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        return f"peft.target_modules: {plan.peft.target_modules!r}: {err}; allowed: names of the model's linear layers"
    wrapped = [(n, m) for n, m in model.named_modules() if is_lora_layer(m)]
    if not wrapped:
        return f"peft.target_modules: {plan.peft.target_modules!r} adapts no module of the model"
    other = [n for n, m in wrapped if type(m.base_layer) is not nn.Linear]
    if other:
        return (f"peft.target_modules: {plan.peft.target_modules!r} adapts {other[0]} "
                f"({type(dict(wrapped)[other[0]].base_layer).__name__}); allowed: nn.Linear layers only")
    return None
