"""Whether a plan can run, asked of every rule's owner in one place, for `validate`, `plan`, `tune`,
`train` and the trial alike.

A rule lives with what it is about: the Plan's own fields and degrees (paratune.config.plan, degrees: a
Plan that exists has passed them), each lever's (paratune.levers: its module), the model family's
layout rules (paratune.checks.preflight, which asks tp, pp, cp, ep, float8, the loss form, the adapters
and pretrained checkpoints), what a user's own training loop cannot take (paratune.trial.user_loop), and
the device's (each lever's device refusal, cp on CPU workers). `check_plan` and `device_refusal`
collect them; callers only say what they know (the model's config, the files to read, the device).
"""

from __future__ import annotations

from typing import Any

from paratune.config.degrees import CP_CPU_REASON
from paratune.config.devices import Device, has_fp8
from paratune.levers import device_refusal as levers_device_refusal
from paratune.config.plan import Plan, PlanError


def check_plan(plan: Plan, config: Any = None, *, inputs_source: str | None = None, build: bool = False) -> Any:
    """Raise PlanError (field, value, what is allowed) for the first rule the plan breaks beyond its
    own fields: its input files where `inputs_source` names the plan's file or "plan" (read where
    the command runs), the model family's layout rules on the meta model, a user loop's limits.
    `config`: the plan's built config where the caller has it (else built only where a rule needs it;
    `build`: always, after the inputs are checked, and returned: the trial counts its FLOPs).
    A config transformers cannot build raises ModelError or that library's own error, for the
    caller to report as it reports it."""
    if inputs_source is not None:
        from paratune.config.inputs import check_inputs

        check_inputs(plan, source=inputs_source)
    from paratune.checks.preflight import check_plan_against_model

    if build and config is None:
        from paratune.model.build import build_config

        config = build_config(plan.model, plan.model_overrides)
    check_plan_against_model(plan, config)
    from paratune.config.train_loop import TRAIN_LOOP_ENV, refusal

    if TRAIN_LOOP_ENV in plan.env and (why := refusal(plan)) is not None:
        raise PlanError(why)
    return config


def device_refusal(plan: Plan, gpu: str | None, fp8: bool) -> str | None:
    """Why the plan cannot run on the workers' device (None: it can). `gpu`: the GPU model, None
    for CPU workers; `fp8`: whether it has FP8 tensor cores. Context parallelism on CPU workers,
    then every lever's device refusal (paratune.levers)."""
    if plan.cp > 1 and gpu is None:
        return f"cp: {plan.cp} on CPU workers: {CP_CPU_REASON}; allowed: cp 1 on CPU"
    return levers_device_refusal(plan, gpu, fp8)


def device_entry_refusal(plan: Plan, device: Device) -> str | None:
    """`device_refusal` for a device-table entry (the cost model's): a plan on device 'auto' runs on
    the entry's kind, 'cpu' on CPU workers."""
    on_cpu = plan.device == "cpu" or (plan.device == "auto" and device.name == "cpu")
    return device_refusal(plan, None if on_cpu else (device.gpu or device.name), has_fp8(device))
