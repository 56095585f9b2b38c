"""float8 training through torchao 0.18 (the plan's `float8` lever, rules in paratune.levers).

`convert_to_float8` swaps the model's eligible `nn.Linear`s for torchao's `Float8Linear` (the
recipe's config, FSDP2's float8 all-gather where the plan asks), on the meta device, before any
layout. Three things paratune needs beyond torchao's own swap:

- Module identity. paratune's ModelInit remembers every parameter slot by module object (it
  fills the values after the layout), and torchao's swap puts new module objects in the tree.
  Each converted linear therefore keeps its object: it takes the Float8Linear's class and state
  (parameter names, and so the values materialize fills, unchanged).
- Eligibility. The LM head stays in bf16 (torchtitan's rule: its logits feed the loss), and so
  does any linear whose in or out features *on a rank* are not multiples of 16: CUDA's
  `_scaled_mm` requires both dimensions of its second operand, and the inner one of its first, in
  multiples of 16 (torch/_meta_registrations.py `_check_scaled_mm_sizes`, checked only off CPU).
  Conversion runs before tp (paratune.parallel.nd), so the rank's shape is the layer's with tp's
  split applied: a column-parallel linear's out_features / tp, a row-parallel one's in_features /
  tp (tiny-llama's MLP, 176 wide, is 88 a rank at tp 2). The weight gradient's matmul reduces over
  the tokens (torchao float8_linear.py: grad_output.t() @ input), so a rank's tokens per
  micro-batch must be a multiple of 16 too: that one is a plan rule (paratune.levers). CPU's
  `_scaled_mm` checks neither, so both rules hold on every device: a CPU trial converts what a
  GPU trial converts.
- CPU autocast. `Float8Linear.forward` casts its input to the autocast dtype only under GPU
  autocast (`torch.is_autocast_enabled()` is CUDA's; `float8_linear.py:258-261`). Under CPU
  autocast (bf16 DDP, pipeline stages, tp without FSDP2) torchao alone would quantize the fp32
  activation (its amax, so its scale, differ) and save it for backward in fp32; only at the mm
  does autocast re-tag the float8 operands bf16 (torchao's `_to_copy` override), so the output is
  bf16 either way. A pre-hook casts the input first, as GPU autocast does, so the CPU check trains
  what the GPU trains. FSDP2's MixedPrecisionPolicy feeds bf16 on both.
"""

from __future__ import annotations

import torch
from torch import nn

from paratune.config.plan import Plan
from paratune.config.quiet import quiet_torchao_import  # noqa: F401 (the workers' name for it)

# CUDA's _scaled_mm: both matrix dimensions of each float8 operand must be multiples of 16.
SCALED_MM_MULTIPLE = 16
SKIPPED_ATTR = "paratune_float8_skipped"  # on the model: {linear's name: why it stayed in bf16}


def import_torchao_float8():
    """torchao.float8, its import noise filtered; ModuleNotFoundError names the missing package."""
    quiet_torchao_import()
    try:
        import torchao.float8 as float8
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"float8 plans need torchao (0.18): {err}", name="torchao") from err
    return float8


def float8_config(plan: Plan):
    """torchao's Float8LinearConfig for the plan's recipe (and FSDP2's float8 all-gather)."""
    import dataclasses

    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(plan.float8)
    if plan.float8_all_gather:  # levers: fsdp + tensorwise only (torchao refuses rowwise itself)
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def skip_reason(module: nn.Linear, name: str, head: nn.Module | None, tp: int = 1,
                split: str | None = None) -> str | None:
    """Why a linear stays in bf16 (None: it is converted). `split`: the dimension tp splits over
    `tp` ranks ("out" column-parallel, "in" row-parallel, None: whole on every rank)."""
    if module is head or name.rpartition(".")[2] == "lm_head":
        return "the LM head (its logits feed the loss in bf16)"
    bad = []
    for what, n in (("in_features", module.in_features), ("out_features", module.out_features)):
        if split is not None and what.startswith(split) and tp > 1:
            if (n // tp) % SCALED_MM_MULTIPLE or n % tp:
                bad.append(f"{what} {n} / tp {tp} = {n / tp:g} per rank")
        elif n % SCALED_MM_MULTIPLE:
            bad.append(f"{what} {n}")
    if bad:
        return f"{', '.join(bad)} not a multiple of {SCALED_MM_MULTIPLE} (CUDA's _scaled_mm)"
    return None


def tp_splits(model: nn.Module, plan: Plan) -> dict[int, str]:
    """The dimension the plan's tp splits of each block linear, by module id (empty at tp 1)."""
    if plan.tp == 1:
        return {}
    from paratune.parallel.tp import linear_splits

    return linear_splits(model, expert_parallel=plan.ep > 1)


def skipped_linears(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Every nn.Linear the plan's float8 leaves in bf16 (name -> why), on the model as built (the
    meta model before any layout, as `convert_to_float8` and the preflight see it). Read only: on
    the pre-launch checks' frozen model the answer is kept per tp degree and expert parallelism."""
    from paratune.model.build import remembered

    return remembered(model, ("float8_skipped_linears", plan.tp, plan.ep > 1), lambda: _skipped_linears(model, plan))


def _skipped_linears(model: nn.Module, plan: Plan) -> dict[str, str]:
    from paratune.model.build import decoder_parts

    try:
        head = decoder_parts(model).head
    except Exception:  # noqa: BLE001 - a model without one stack still has its head by name
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    splits = tp_splits(model, plan)
    return {name: why for name, m in model.named_modules() if type(m) is nn.Linear
            and (why := skip_reason(m, name, head, plan.tp, splits.get(id(m)))) is not None}


def _autocast_input_on_cpu(module: nn.Module, args: tuple) -> tuple | None:
    """What Float8Linear.forward does under GPU autocast, for the other devices' autocast."""
    x = args[0]
    device = x.device.type
    if device == "cuda" or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def _take_over(old: nn.Linear, new: nn.Module) -> None:
    """`old` becomes `new` (class and state) and stays the object the model and ModelInit hold."""
    state = dict(vars(new))
    vars(old).clear()
    vars(old).update(state)
    old.__class__ = type(new)


def apply_lever(model: nn.Module, plan: Plan, place) -> None:  # noqa: ANN001 - a runner.WorkerPlace
    """The float8 lever's runtime (paratune.levers.float8: stage before_layout)."""
    convert_to_float8(model, plan)


def convert_to_float8(model: nn.Module, plan: Plan) -> None:
    """Swap the model's eligible linears for torchao's float8 ones (on the meta device, first).

    Records the skipped linears on the model (`paratune_float8_skipped`: name -> reason)."""
    if plan.float8 == "none":
        return
    float8 = import_torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    config = float8_config(plan)
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    skipped = skipped_linears(model, plan)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name in linears
                                      and name not in skipped)
    for name, old in linears.items():
        if name in skipped:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = getattr(parent, attr)
        if not isinstance(new, Float8Linear):
            raise RuntimeError(f"float8: torchao did not convert {name}")
        _take_over(old, new)
        setattr(parent, attr, old)
        old.register_forward_pre_hook(_autocast_input_on_cpu)
    setattr(model, SKIPPED_ATTR, skipped)


def converted_linears(model: nn.Module) -> list[str]:
    """Names of the model's float8 linears (torchao's Float8Linear), in model order."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ModuleNotFoundError:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan) -> None:
    """With FSDP2's float8 all-gather: after every optimizer step, every float8 weight's scale in one
    all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`, as torchtitan does), instead
    of one amax all-reduce per weight inside each all-gather. The same numbers either way."""
    if not plan.float8_all_gather:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda opt, args, kwargs: precompute_float8_dynamic_scale_for_fsdp(model))
