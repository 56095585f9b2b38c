"""The levers' static rules (paratune.levers): what every device refuses names field, value and why."""

from __future__ import annotations

import pytest

from paratune.levers import device_refusal, loss_form
from paratune.config.plan import PlanError, load_plan_dict

BASE = {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "micro_batch": 2}


@pytest.mark.parametrize("changes, field, says", [
    ({"checkpoint_every": 3}, "checkpoint_every: 3", "activation_checkpointing 'layers'"),
    ({"float8": "tensorwise"}, "float8: 'tensorwise' needs precision 'bf16'", "fp32"),
    ({"float8": "rowwise", "precision": "bf16", "strategy": "zero"}, "float8: 'rowwise' with strategy 'zero'",
     "'ddp' or 'fsdp'"),
    ({"float8_all_gather": True, "float8": "tensorwise", "precision": "bf16"}, "float8_all_gather: true needs "
     "strategy 'fsdp'", "got 'ddp'"),
    ({"float8_all_gather": True, "float8": "rowwise", "precision": "bf16", "strategy": "fsdp"},
     "float8_all_gather: true with float8 'rowwise'", "only supports tensorwise"),
    ({"compile": True, "strategy": "zero", "zero": {"stage": 3}}, "compile: true with zero.stage 3", "hooks"),
    ({"compile": True, "warmup_steps": 0}, "compile: true needs warmup_steps >= 1", "never be a measured step"),
    ({"loss": "vocab_parallel"}, "loss: 'vocab_parallel' needs tp > 1", "'chunked'"),
    ({"loss": "vocab_parallel", "tp": 2, "strategy": "zero"}, "loss: 'vocab_parallel' with strategy 'zero'",
     "AutoTP"),
    ({"loss": "vocab_parallel", "tp": 2, "pp": 2, "num_workers": 4, "micro_batch": 2},
     "loss: 'vocab_parallel' with pp 2", "schedule"),
    ({"float8_all_gather": True, "float8": "tensorwise", "precision": "bf16", "strategy": "fsdp",
      "fsdp": {"sharding": "no_shard"}}, "float8_all_gather: true with fsdp.sharding 'no_shard'", "never"),
    ({"loss": "chunked", "tp": 2}, "loss: 'chunked' with tp 2", "'vocab_parallel'"),
    ({"async_tp": True, "device": "cpu"}, "async_tp: true with device 'cpu'", "symmetric memory"),
    ({"async_tp": True, "tp": 2}, "async_tp: true needs compile: true, sequence_parallel: true", "allowed: false"),
    # CUDA's _scaled_mm reduces the weight gradient over a rank's tokens: 2 x 20 = 40 is no multiple of 16.
    ({"float8": "tensorwise", "precision": "bf16", "seq_len": 20}, "float8: 'tensorwise' with micro_batch 2 x "
     "seq_len 20 = 40 tokens a rank", "allowed: micro_batch a multiple of 4 at seq_len 20"),
    ({"float8": "rowwise", "precision": "bf16", "seq_len": 40, "cp": 2, "num_workers": 2, "strategy": "fsdp"},
     "micro_batch 2 x seq_len 40 / cp 2 = 40 tokens a rank", "micro_batch a multiple of 4 at seq_len 40 and cp 2"),
])
def test_a_lever_that_no_device_can_run_is_refused_with_its_reason(changes, field, says):
    with pytest.raises(PlanError) as err:
        load_plan_dict({**BASE, **changes})
    assert field in str(err.value) and says in str(err.value), str(err.value)


def test_float8_token_rule_allows_what_it_says():
    """The allowed micro-batches of the token rule make plans (4 x 20 = 80 = 5 x 16)."""
    for micro in (4, 8):
        plan = load_plan_dict({**BASE, "precision": "bf16", "float8": "tensorwise", "seq_len": 20,
                               "micro_batch": micro, "global_batch": 16})
        assert plan.micro_batch * plan.seq_len % 16 == 0


def test_the_levers_that_compose_make_a_plan():
    plan = load_plan_dict({**BASE, "strategy": "fsdp", "precision": "bf16", "float8": "tensorwise",
                           "float8_all_gather": True, "compile": True, "activation_checkpointing": "layers",
                           "checkpoint_every": 3, "loss": "chunked"})
    assert (plan.float8, plan.float8_all_gather, plan.compile, plan.checkpoint_every) == ("tensorwise", True, True, 3)
    async_tp = load_plan_dict({**BASE, "tp": 2, "sequence_parallel": True, "compile": True, "async_tp": True,
                               "device": "cuda"})
    assert async_tp.async_tp and loss_form(async_tp) == "vocab_parallel"


def test_the_loss_form_auto_is_vocab_parallel_under_torch_tp_only():
    assert loss_form(load_plan_dict(BASE)) == "standard"
    assert loss_form(load_plan_dict({**BASE, "tp": 2})) == "vocab_parallel"
    assert loss_form(load_plan_dict({**BASE, "tp": 2, "strategy": "zero"})) == "standard"  # DeepSpeed's AutoTP
    assert loss_form(load_plan_dict({**BASE, "loss": "chunked"})) == "chunked"
    pp = load_plan_dict({**BASE, "num_workers": 4, "tp": 2, "pp": 2, "micro_batch": 2, "global_batch": 8})
    assert loss_form(pp) == "standard"  # the schedule's backward runs outside loss_parallel


def test_the_device_refuses_what_it_cannot_run():
    float8 = load_plan_dict({**BASE, "precision": "bf16", "float8": "tensorwise"})
    assert "A100" in device_refusal(float8, "A100", has_fp8=False) and "sm_89" in device_refusal(float8, "A100", False)
    assert device_refusal(float8, "H100", has_fp8=True) is None
    assert device_refusal(float8, None, has_fp8=False) is None  # float8 trains on CPU (torch's _scaled_mm)
    async_tp = load_plan_dict({**BASE, "tp": 2, "sequence_parallel": True, "compile": True, "async_tp": True})
    assert "CPU workers" in device_refusal(async_tp, None, has_fp8=False)
    assert device_refusal(async_tp, "H100", has_fp8=True) is None
