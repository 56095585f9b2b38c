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

import re
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from paratune.config.plan import Plan
from paratune.config.quiet import quiet_torchao_import  # noqa: F401 (the workers' name for it)

# CUDA's _scaled_mm: both matrix dimensions of each float8 operand must be multiples of 16.
SCALED_MM_MULTIPLE = 16
SKIPPED_ATTR = "paratune_float8_skipped"  # on the model: {linear's name: why it stayed in bf16}
HEAD_REASON = "the LM head (its logits feed the loss in bf16)"
# A float8 plan converting less than this share of its linear FLOPs (the head aside) is labelled
# partial: mostly bf16 under a float8 name otherwise.
PARTIAL_SHARE = 0.5


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
        return HEAD_REASON
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


@dataclass(frozen=True)
class Float8Coverage:
    """What a float8 plan converts, known before any worker starts: the same `skipped_linears` the
    workers' `convert_to_float8` applies (one rule), read on the checks' meta model, so `validate`
    and `plan` can say which linears a float8 plan leaves in bf16 and how much of its work that is.

    `share`: the converted linears' part of every non-head nn.Linear's FLOPs (in x out each, the
    same per token; the LM head, bf16 by design in every float8 plan, is not counted). Routed
    experts packed in one tensor (transformers 5's MoE) are no nn.Linear: torchao leaves them to
    bf16 in every plan, and they are not counted either."""

    linears: int  # nn.Linear modules in the model, the head included
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it stays bf16 (the head too)
    share: float = 1.0

    @property
    def partial(self) -> bool:
        """Converts less than half of the linear FLOPs it could: the plan's label says so."""
        return self.share < PARTIAL_SHARE

    def beyond_head(self) -> dict[str, str]:
        """The skipped linears besides the LM head (the head alone is every float8 plan's case)."""
        return {name: why for name, why in self.skipped.items() if why != HEAD_REASON}


def float8_coverage(model: nn.Module, plan) -> Float8Coverage:  # noqa: ANN001 - a Plan, or anything with tp, ep
    """What `convert_to_float8` would convert of `model` (the meta model before any layout) at the
    plan's tp and ep: kept per (tp, ep > 1) on the checks' frozen model."""
    from paratune.model.build import remembered

    def compute() -> Float8Coverage:
        skipped = skipped_linears(model, plan)
        linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
        flops = {name: m.in_features * m.out_features for name, m in linears.items()
                 if skipped.get(name) != HEAD_REASON}
        total = sum(flops.values())
        converted = sum(f for name, f in flops.items() if name not in skipped)
        return Float8Coverage(len(linears), skipped, converted / total if total else 1.0)

    return remembered(model, ("float8_coverage", plan.tp, plan.ep > 1), compute)


def plan_float8_coverage(plan) -> Float8Coverage | None:  # noqa: ANN001 - a Plan (model, overrides, tp, ep, float8)
    """float8_coverage of the plan's model, on the pre-launch checks' cached meta model (no weights,
    any size); None for a plan without float8."""
    if plan.float8 == "none":
        return None
    from paratune.model.build import meta_model
    from paratune.model.shapes import model_config_key

    quiet_torchao_import()  # a label's first call may build the first model of a library process
    return float8_coverage(meta_model(model_config_key(plan)), plan)


@lru_cache(maxsize=256)
def _label_share(model: str, overrides_json: str, tp: int, ep: int) -> float | None:
    import json
    from types import SimpleNamespace

    plan = SimpleNamespace(model=model, model_overrides=json.loads(overrides_json), tp=tp, ep=ep, float8="tensorwise")
    try:  # the label of any plan dict (a stored trial's too): a model that cannot be built here says nothing
        coverage = plan_float8_coverage(plan)
    except Exception:  # noqa: BLE001 - a label never fails a table
        return None
    return coverage.share if coverage is not None else None


def label_share(plan: dict) -> float | None:
    """The converted share of a float8 plan dict's linear FLOPs (Float8Coverage.share), for its
    label; None where the model cannot be built here. Cached per model, overrides, tp and ep."""
    import json

    overrides = json.dumps(plan.get("model_overrides") or {}, sort_keys=True, default=str)
    return _label_share(plan.get("model", "tiny-llama"), overrides, int(plan.get("tp", 1)), int(plan.get("ep", 1)))


def _pattern(name: str) -> str:
    """A linear's name with its indices as '*' (every block's q_proj reads as one line)."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", name)


def coverage_notice(plan: Plan, coverage: Float8Coverage | None = None) -> list[str]:
    """The lines `validate` and `plan` print for a float8 plan that leaves linears besides the LM
    head in bf16 (empty otherwise): which ones (grouped over the blocks), why, and the converted
    share of the linear FLOPs."""
    coverage = coverage if coverage is not None else plan_float8_coverage(plan)
    if coverage is None or not coverage.beyond_head():
        return []
    groups: dict[tuple[str, str], int] = {}
    for name, why in coverage.beyond_head().items():
        groups[(_pattern(name), why)] = groups.get((_pattern(name), why), 0) + 1
    lines = [f"float8: '{plan.float8}' at tp {plan.tp} leaves {len(coverage.skipped)} of {coverage.linears} linears "
             f"of '{plan.model}' in bf16 and converts {coverage.share:.0%} of the linear FLOPs (the LM head aside):"]
    lines += [f"  {pattern}{f' (x{count})' if count > 1 else ''}: {why}" for (pattern, why), count in groups.items()]
    head = [name for name, why in coverage.skipped.items() if why == HEAD_REASON]
    lines += [f"  {name}: {HEAD_REASON}, in every float8 plan" for name in head]
    lines.append(f"  a linear converts where its per-rank in and out features are multiples of {SCALED_MM_MULTIPLE}")
    return lines


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
