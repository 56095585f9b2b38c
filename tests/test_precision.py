"""A bf16 plan computes in bf16 on every path (autocast, FSDP2 mixed precision, DeepSpeed bf16,
tensor- and pipeline-parallel plans with and without FSDP2 on the dp axis).

Every trial records the dtype of every matmul its nn.Linear forwards dispatch in one warm-up
step (paratune.trial.precision); here each strategy x tp/pp combination is run on real gloo processes
and must report bf16 only. fp32 plans are held to fp32 in test_parity_gloo.
"""

import pytest
import torch
from conftest import BASE_PLAN
from gloo_harness import one_torch_thread, run_plans_on_gloo  # noqa: F401 (fixture)
from torch import nn

from paratune.config.plan import load_plan_dict
from paratune.trial.precision import LinearMatmulDtypes

pytestmark = pytest.mark.integration

SHORT = {"precision": "bf16", "warmup_steps": 1, "measure_steps": 1, "track_memory": False}
COMBINATIONS = {
    "ddp": {"strategy": "ddp"},
    "fsdp-full": {"strategy": "fsdp"},
    "zero-2": {"strategy": "zero", "zero": {"stage": 2}},
    "zero-3": {"strategy": "zero", "zero": {"stage": 3}},
    "tp2-ddp": {"tp": 2},
    "tp2-fsdp-dp1": {"tp": 2, "strategy": "fsdp"},  # no FSDP2 wrap at dp 1: autocast must do it
    "pp2-ddp": {"pp": 2},
    "pp2-fsdp-dp1": {"pp": 2, "strategy": "fsdp"},
    "dp2xtp2-fsdp": {"num_workers": 4, "tp": 2, "strategy": "fsdp"},
    "dp2xpp2-fsdp": {"num_workers": 4, "pp": 2, "strategy": "fsdp"},
}


# world 4 is `matrix` (make test-matrix): FSDP2's bf16 policy beside tp and pp at dp 2; world 2 runs
# FSDP2's policy (fsdp-full) and bf16 under tp and pp (tp2-fsdp-dp1, pp2-fsdp-dp1, tp2-ddp, pp2-ddp).
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_bf16_plans_compute_in_bf16(world):
    """All combinations of one world size in one set of processes (they run one after another)."""
    names = [n for n, c in COMBINATIONS.items() if c.get("num_workers", 2) == world]
    plans = [load_plan_dict({**BASE_PLAN, **SHORT, **COMBINATIONS[n]}) for n in names]
    outs = run_plans_on_gloo(plans)
    wrong = {n: o["linear_matmul_dtypes"] for n, o in zip(names, outs)
             if not (o["linear_matmul_dtypes"].get("bfloat16", 0) > 0 and set(o["linear_matmul_dtypes"]) == {"bfloat16"})}
    assert not wrong, f"bf16 plans that computed in another dtype: {wrong}"


def test_recorder_sees_what_autocast_does():
    """The recorder itself: fp32 outside autocast, bf16 inside, nothing outside nn.Linear."""
    layer, x = nn.Linear(8, 8), torch.randn(2, 8)
    with LinearMatmulDtypes() as fp32:
        layer(x)
        x @ x.T  # not inside a Linear: not counted
    with LinearMatmulDtypes() as bf16, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    assert dict(fp32.counts) == {"float32": 1} and dict(bf16.counts) == {"bfloat16": 1}
