"""Installs like a library: what core paratune needs, what each extra adds, and a plan that needs a
missing extra refused before launch naming it (a space drops those plans under one rule).

The development environment has every extra; here their absence is simulated (paratune.config.extras
looks a package up once per process). The real absence: tests/test_wheel.py installs the built
wheel core-only, and .ci/oldest_ray.sh does the same with the oldest supported Ray."""

import tomllib
from pathlib import Path

import pytest

from paratune.config import extras
from paratune.config.plan import PlanError, load_plan_dict

ROOT = Path(__file__).resolve().parents[1]
PLAN = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "micro_batch": 2, "num_workers": 2}


@pytest.fixture
def without(monkeypatch):
    """without("deepspeed", ...): those extras' packages look absent for the test."""

    def hide(*names: str) -> None:
        for name in names:
            monkeypatch.setitem(extras._found, extras.EXTRAS[name][0], False)

    return hide


def test_pyproject_keeps_the_optional_packages_out_of_the_core():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for package in ("deepspeed", "torchao", "peft", "accelerate", "tyro", "liger"):
        assert package not in core, package
    for name in ("torch", "ray[default,train,tune]", "transformers", "mlflow", "optuna", "pydantic", "pyyaml",
                 "rich", "numpy", "scipy", "matplotlib"):
        assert any(d.startswith(name) for d in project["dependencies"]), name
    optional = project["optional-dependencies"]
    assert optional["deepspeed"][0].startswith("deepspeed") and optional["float8"][0].startswith("torchao")
    assert optional["lora"][0].startswith("peft") and optional["exports"][0].startswith("accelerate")
    assert optional["all"] == ["paratune[deepspeed,float8,lora,exports]"]
    # The development environment installs everything (make install), and its extras are all there.
    assert ".[all,test]" in (ROOT / "Makefile").read_text()
    assert all(extras.installed(e) for e in ("deepspeed", "float8", "lora", "exports"))


def test_a_zero_plan_without_deepspeed_is_refused_naming_the_extra(without):
    without("deepspeed")
    with pytest.raises(PlanError) as refused:
        load_plan_dict({**PLAN, "strategy": "zero", "zero": {"stage": 2}})
    assert str(refused.value) == ("plan: strategy: 'zero' needs DeepSpeed, which is not installed; install it with "
                                  "pip install 'paratune[deepspeed]'; allowed without it: strategy 'ddp' or 'fsdp'")
    assert load_plan_dict({**PLAN, "strategy": "fsdp"}).strategy == "fsdp"


def test_float8_and_lora_plans_without_their_extras_are_refused_naming_them(without):
    without("float8", "lora")
    with pytest.raises(PlanError, match=r"float8: 'tensorwise' needs torchao, which is not installed; install it "
                                        r"with pip install 'paratune\[float8\]'; allowed without it: float8 'none'"):
        load_plan_dict({**PLAN, "precision": "bf16", "float8": "tensorwise"})
    with pytest.raises(PlanError, match=r"peft: LoRA adapters need peft, .* 'paratune\[lora\]'"):
        load_plan_dict({**PLAN, "peft": {"r": 8}})
    assert load_plan_dict({**PLAN, "precision": "bf16"}).float8 == "none"


def test_a_space_sweeping_zero_without_deepspeed_drops_those_plans_by_one_rule(without):
    from paratune.sweep.space import load_space

    full = load_space(ROOT / "search_spaces" / "local_cpu.yaml")
    without("deepspeed")
    core = load_space(ROOT / "search_spaces" / "local_cpu.yaml")
    zero_plans = [c for c in full.candidates if c.plan.strategy == "zero"]
    assert zero_plans and not [c for c in core.candidates if c.plan.strategy == "zero"]
    assert len(core.candidates) == len(full.candidates) - len(zero_plans)
    rule = "strategy: 'zero' needs DeepSpeed, which is not installed"
    assert core.removed[rule] == 3 * 4 * 2  # every zero combination (stage x micro-batch x checkpointing)
    report = core.pruning_report()
    assert f"{3 * 4 * 2} x {rule}" in report


def test_a_space_fixing_float8_without_torchao_says_which_extra_to_install(without):
    from paratune.sweep.space import SpaceError, space_from_dict

    without("float8")
    with pytest.raises(SpaceError) as refused:
        space_from_dict({"name": "f8", "fixed": {**PLAN, "precision": "bf16", "float8": "rowwise"},
                         "space": {"strategy": {"ddp": {}, "fsdp": {}}}})
    assert "2 x float8: 'rowwise' needs torchao, which is not installed; install it with pip install " \
           "'paratune[float8]'" in str(refused.value)
