"""The gloo harness itself: a rank that a library kills by a signal (a segfault in native code) cannot
report its own traceback, so the harness must say which plan failed and where that rank was."""

import pytest
from conftest import BASE_PLAN
from gloo_harness import run_plans_on_gloo

from paratune.config.plan import load_plan_dict

pytestmark = pytest.mark.integration


def segfault_on_rank_1(plan, rank, world, local_world, device):
    """Rank 1 reads address 0 (SIGSEGV); rank 0 waits for it in a collective."""
    import ctypes

    import torch
    import torch.distributed as dist

    if rank == 1:
        ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))
    return {"losses": []}


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack_and_plan():
    with pytest.raises(RuntimeError) as failed:
        run_plans_on_gloo([load_plan_dict(BASE_PLAN)], measure="test_gloo_harness:segfault_on_rank_1")
    report = str(failed.value)
    assert "plan 0 of 1 failed; worker exit codes: [0, -11]" in report, report[-3000:]
    assert "rank 1 died by a signal (faulthandler):" in report and "Segmentation fault" in report, report[-3000:]
    assert 'test_gloo_harness.py", line' in report and "in segfault_on_rank_1" in report, report[-3000:]
    assert "Extension modules:" not in report  # the stacks only
