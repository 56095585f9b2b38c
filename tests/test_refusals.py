"""One refusal path (paratune.checks.refusals): a rule lives with its owner and one function collects them, so
`validate`, `plan` (a space's pruning), the trial and `train` refuse a plan alike, before any worker,
with the same words; the device's refusals (cp and every lever's) are one function for the cost model
and the launch. No Ray starts here: each entry point refuses before it would."""

import re

import pytest
import yaml

from paratune import cli
from paratune.config.devices import get_device
from paratune.levers import Lever, LeverField, register, unregister
from paratune.config.plan import PlanError, load_plan_dict, plan_class
from paratune.checks.refusals import check_plan, device_entry_refusal
from paratune.sweep.space import space_from_dict
from paratune.train.training import run_training
from paratune.cluster.trial import check_before_launch
from paratune.config.train_loop import TRAIN_LOOP_ENV

PLAN = {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2, "seq_len": 32}
# A plan its own fields allow and the model family refuses (tiny-llama has no routed experts).
FAMILY_RULE = "ep: 2 with model 'tiny-llama' (LlamaForCausalLM), which has no routed experts to split"


def test_a_family_rule_refuses_alike_in_validate_plan_trial_and_train(tmp_path, capsys):
    plan = load_plan_dict({**PLAN, "ep": 2})  # valid as a Plan: the family's rule is not the plan's own
    with pytest.raises(PlanError, match=re.escape(FAMILY_RULE)):
        check_plan(plan)
    # validate (before: it read the files only, and said yes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({**PLAN, "ep": 2}))
    assert cli.main(["validate", str(path)]) == 2
    assert FAMILY_RULE in " ".join(capsys.readouterr().out.split())
    # plan / tune: the space prunes it under the rule, and keeps ep 1
    space = space_from_dict({"name": "ep", "fixed": PLAN, "space": {"ep": [1, 2]}})
    assert [c.plan.ep for c in space.candidates] == [1]
    assert FAMILY_RULE in " ".join(space.examples.values())
    # the trial and train: failed before launch, the same words
    trial = check_before_launch(plan)
    assert trial.status == "failed" and trial.reason == "invalid_config" and FAMILY_RULE in trial.message
    trained = run_training(plan, steps=1, track=False)
    assert trained.status == "failed" and trained.reason == "invalid_config" and FAMILY_RULE in trained.message


def test_a_user_loop_refuses_every_lever_the_registry_holds():
    loop = {**PLAN, "env": {TRAIN_LOOP_ENV: "examples/train_loop.py"}}
    check_plan(load_plan_dict(loop))  # the loop alone: fine
    # the loss form acts on paratune's model, never the loop's: refused (before: silently ignored)
    with pytest.raises(PlanError, match="loss: 'chunked' with a user train loop"):
        check_plan(load_plan_dict({**loop, "loss": "chunked"}))
    toy = register(Lever(name="toy_loop", doc="", fields=(LeverField("toy_knob", bool, False, ""),)))
    try:
        toy_plan = load_plan_dict({**loop, "toy_knob": True}, plan_type=plan_class())
        with pytest.raises(PlanError, match="toy_knob: True with a user train loop"):
            check_plan(toy_plan)
    finally:
        unregister(toy.name)


def test_the_device_refuses_cp_and_each_lever_through_one_function():
    cpu, h100, a100 = get_device("cpu"), get_device("h100-80gb"), get_device("a100-80gb")
    cp = load_plan_dict({**PLAN, "cp": 2, "global_batch": 4, "micro_batch": 4, "precision": "bf16"})
    assert device_entry_refusal(cp, cpu).startswith("cp: 2 on CPU workers")
    assert device_entry_refusal(cp, h100) is None
    async_tp = load_plan_dict({**PLAN, "tp": 2, "global_batch": 4, "micro_batch": 4, "compile": True,
                               "sequence_parallel": True, "async_tp": True})
    assert device_entry_refusal(async_tp, cpu).startswith("async_tp: true on CPU workers")
    float8 = load_plan_dict({**PLAN, "precision": "bf16", "float8": "tensorwise", "micro_batch": 1,
                             "global_batch": 2})
    assert device_entry_refusal(float8, a100).startswith("float8: 'tensorwise' on a100")
    assert device_entry_refusal(float8, h100) is None
