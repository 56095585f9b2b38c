"""Optional dependencies: which plan needs which `paratune[...]` extra, and whether this install has it.

`pip install paratune` is what every sweep needs (Ray Train/Tune, torch, transformers, MLflow,
Optuna, ...): DDP and FSDP2 plans. A plan that needs more is refused before launch, naming the
extra (plan.py's rules call `missing_extra`), and a space that sweeps it drops those plans,
counted under one rule ("strategy: 'zero' needs DeepSpeed, which is not installed"):

    paratune[deepspeed]  strategy zero (DeepSpeed ZeRO)
    paratune[float8]     float8 tensorwise / rowwise (torchao)
    paratune[lora]       a plan's peft section: LoRA adapters (peft)
    paratune[exports]    the parsers that check the winner's exported configs (accelerate's; tyro
                         for torchtitan's, whose own package installs with --no-deps: docs/install.md)
    paratune[gpu]        liger-kernel's fused loss for loss 'chunked' on CUDA (used where present)
    paratune[all]        all of the above

Installed means importable here (importlib's find_spec: nothing is imported). No torch, no Ray.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from paratune.levers import levers

# extra -> (the module that must be importable, the package's name in messages)
EXTRAS: dict[str, tuple[str, str]] = {
    "deepspeed": ("deepspeed", "DeepSpeed"),
    "float8": ("torchao", "torchao"),
    "lora": ("peft", "peft"),
    "exports": ("accelerate", "accelerate"),
    "gpu": ("liger_kernel", "liger-kernel"),
}
_found: dict[str, bool] = {}


def installed(extra: str) -> bool:
    """Whether the extra's package is importable in this environment (looked up once a process)."""
    module = EXTRAS[extra][0]
    if module not in _found:
        try:
            _found[module] = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed install
            _found[module] = False
    return _found[module]


def install_hint(extra: str) -> str:
    return f"pip install 'paratune[{extra}]'"


def _shown(value: Any) -> str:
    """A plan value as a plan file writes it: 'text', true, 2."""
    return f"'{value}'" if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def missing_extra(plan: Any) -> str | None:
    """Why this install cannot run the plan (the field, its value, the extra to install and what is
    allowed without it), or None. `plan`: a Plan (its fields read only)."""
    if plan.strategy == "zero" and not installed("deepspeed"):
        return (f"strategy: 'zero' needs DeepSpeed, which is not installed; install it with "
                f"{install_hint('deepspeed')}; allowed without it: strategy 'ddp' or 'fsdp'")
    for lever in levers():  # a lever's extra (paratune.levers: float8's torchao)
        field = lever.off_default(plan) if lever.extra else None
        if field is not None and not installed(lever.extra):
            return (f"{field.name}: {_shown(getattr(plan, field.name))} needs {EXTRAS[lever.extra][1]}, which is not "
                    f"installed; install it with {install_hint(lever.extra)}; allowed without it: "
                    f"{field.name} {_shown(field.default)}")
    if plan.peft is not None and not installed("lora"):
        return (f"peft: LoRA adapters need peft, which is not installed; install it with "
                f"{install_hint('lora')}; allowed without it: no peft section (a full fine-tune)")
    return None

