"""A user's own training loop as a plan names it: its env keys, the value checked where the
command runs, and what such a plan cannot take (torch-free; the loop itself: paratune.trial.user_loop)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from paratune.levers import lever_fields
from paratune.config.plan import Plan

TRAIN_LOOP_ENV = "PARATUNE_TRAIN_LOOP"


TRAIN_LOOP_PATH_ENV = "PARATUNE_TRAIN_LOOP_PATH"


ALLOWED = "'module:function' (a function taking one config dict) importable from the working directory"


class TrainLoopError(ValueError):
    """A --train-loop that cannot be used: names the option, the value and what is allowed."""


# --------------------------------------------------------------------------- driver side
def resolve(value: str, option: str = "--train-loop") -> tuple[str, str]:
    """(the 'module:function', the directory its top package imports from), importing it here
    so that a bad value is refused before any worker starts."""
    module, sep, name = value.partition(":")
    if not sep or not module or not name or not name.isidentifier():
        raise TrainLoopError(f"{option}: got {value!r}; allowed: {ALLOWED}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - ImportError, or the module's own error on import
        raise TrainLoopError(f"{option}: got {value!r}: module {module!r} cannot be imported "
                             f"({type(err).__name__}: {err}); allowed: {ALLOWED}") from None
    function = getattr(mod, name, None)
    if not callable(function):
        raise TrainLoopError(f"{option}: got {value!r}: module {module!r} has no function {name!r}; "
                             f"allowed: {ALLOWED}")
    root = Path(mod.__file__ or ".").resolve().parent
    if Path(mod.__file__ or "").name == "__init__.py":
        root = root.parent
    for _ in module.split(".")[1:]:
        root = root.parent
    return value, str(root)


def refusal(plan: Plan) -> str | None:
    """Why paratune cannot apply this plan to a user's loop (None: it can): the message names
    the field, the value and what is allowed."""
    allowed = ("allowed with --train-loop: strategy ddp or fsdp (full / grad_op), tp=pp=cp=ep=1, "
               f"no lever ({', '.join(f.name for f in lever_fields())} at their defaults)")
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(plan, name) > 1:
            return f"{name}: {getattr(plan, name)} with a user train loop (the loop builds its model; paratune " \
                   f"cannot split it); {allowed}"
    if plan.strategy == "zero":
        return f"strategy: 'zero' with a user train loop (DeepSpeed owns the loop's step); {allowed}"
    if plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.sharding == "hybrid":
        return f"fsdp.sharding: 'hybrid' with a user train loop; {allowed}"
    for lever_field in lever_fields():  # every lever (paratune.levers) acts on paratune's model, not the loop's
        value = getattr(plan, lever_field.name)
        if value != lever_field.default:
            return f"{lever_field.name}: {value!r} with a user train loop (the loop's model is its own); {allowed}"
    return None
