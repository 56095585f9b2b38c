"""ZeRO with model parallelism: DeepSpeed's AutoTP training (tp) with every ZeRO stage, on real
gloo processes, against the single-process reference; ZeRO with pp is refused (DeepSpeed 0.19.8
pipelines only its own PipelineModule, with ZeRO stage 0-1).

fp32 losses must match within 1e-5 (observed <= 1e-6). grad_clip 0.05 clips on every step, so
parity also proves that DeepSpeed's clip takes the global norm over the tp shards.
"""

import pytest
from conftest import BASE_PLAN
from gloo_harness import assert_groups_use_plan_timeout, one_torch_thread, reference_for  # noqa: F401 (fixture)

from paratune.config.plan import PlanError, load_plan_dict
from paratune.sweep.parity import max_loss_difference


def _plan(**changes):
    return load_plan_dict({**BASE_PLAN, "strategy": "zero", **changes})


def _check_parity(plans, outs):
    from paratune.model.build import build_config, parameter_counts

    for plan, out in zip(plans, outs):
        label = plan.model_dump(include={"num_workers", "tp", "zero", "grad_clip", "model_overrides"})
        assert len(out["losses"]) == plan.total_steps, label
        assert max_loss_difference(out["losses"], reference_for(plan)) < 1e-5, (label, out["losses"])
        assert min(out["losses"][1:]) < out["losses"][0], label  # it trains
        total = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
        if plan.tp > 1:  # AutoTP sharded the layers: no rank optimizes the whole model
            assert max(out["local_parameter_counts"]) < 0.75 * total, (label, out["local_parameter_counts"])
            assert_groups_use_plan_timeout(plan, out)  # DeepSpeed's (dp, tp) mesh


@pytest.mark.integration
def test_zero_with_autotp_matches_the_reference_on_two_ranks():
    from gloo_harness import run_plans_on_gloo

    plans = [
        _plan(tp=2, zero={"stage": 1}, grad_clip=0.05),
        # zero.Init partitions the model before AutoTP re-shards its layers; tied embedding and
        # head become vocab-parallel with DeepSpeed's distributed loss.
        _plan(tp=2, zero={"stage": 3, "offload_optimizer": True, "offload_param": True},
              model_overrides={"tie_word_embeddings": True}),
        # The same processes, tp 1 next: DeepSpeed's tp groups from the plans before must be gone
        # (kept, this engine would average over a dp group of 1 rank, or fail on its mpu).
        _plan(tp=1, zero={"stage": 2}),
    ]
    _check_parity(plans, run_plans_on_gloo(plans))


@pytest.mark.integration
def test_zero_with_autotp_on_dp2_x_tp2():
    """Four ranks: ZeRO reduces over the dp group, AutoTP over the tp group, and the data a rank
    trains on is picked by paratune's dp rank: a wrong group layout breaks parity."""
    from gloo_harness import run_plans_on_gloo

    plans = [_plan(num_workers=4, tp=2, zero={"stage": 2}, grad_clip=0.05),
             _plan(num_workers=4, tp=2, zero={"stage": 3})]
    outs = run_plans_on_gloo(plans)
    _check_parity(plans, outs)
    zero2, zero3 = (out["local_parameter_counts"] for out in outs)
    assert max(zero3) < max(zero2)  # ZeRO-3 also partitions the tp shards over dp


def test_zero_with_pp_is_refused_with_deepspeeds_reason():
    with pytest.raises(PlanError, match=r"pp: 2 with strategy 'zero'; allowed: pp 1 \(DeepSpeed 0.19.8 pipelines "
                                        r"only its own PipelineModule, with ZeRO stage 0-1"):
        _plan(pp=2)
    with pytest.raises(PlanError, match=r"pp: 2 with strategy 'zero'"):
        _plan(num_workers=4, tp=2, pp=2, global_batch=8, micro_batch=2)


def test_zero_with_sequence_parallel_is_refused():
    with pytest.raises(PlanError, match=r"sequence_parallel: true with strategy 'zero'; allowed: false "
                                        r"\(DeepSpeed 0.19.8 AutoTP"):
        _plan(tp=2, sequence_parallel=True)


def test_zero_with_tp_is_a_plan_and_its_deepspeed_config_enables_autotp():
    from paratune.parallel.zero import deepspeed_config

    for stage in (0, 1, 2, 3):
        plan = _plan(num_workers=4, tp=2, zero={"stage": stage})
        assert plan.dp_degree == 2 and plan.grad_accum == 2
        config = deepspeed_config(plan, on_gpu=True)
        assert config["tensor_parallel"] == {"autotp_size": 2}
        # DeepSpeed counts the tp ranks in its batch check (micro x accum x every rank).
        assert config["train_batch_size"] == plan.micro_batch * plan.grad_accum * plan.num_workers
    assert "tensor_parallel" not in deepspeed_config(_plan(zero={"stage": 2}), on_gpu=True)
    with pytest.raises(PlanError, match=r"tp: 4 must divide attention heads \(4\) and KV heads \(2\)"):
        _plan(num_workers=4, tp=4, micro_batch=1)


def test_a_build_puts_torchs_linear_back_after_deepspeeds_zero3_init():
    """DeepSpeed's zero.Init leaves its own linear in torch.nn.functional (it saves every linear's
    input and weight, frozen or not); paratune's next build in the process restores torch's."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    from paratune.parallel.zero import restore_torch_linear

    restore_torch_linear()  # an earlier in-process ZeRO-3 test of the suite may have left it replaced
    original = F.linear
    assert not restore_torch_linear()  # nothing replaced: nothing done
    had = hasattr(Init, "linear_bk")
    try:
        # what zero.Init's _enable_mem_efficient_linear does (it logs through deepspeed.comm, which
        # needs a process group; the gloo ZeRO-3 runs of test_construction go through the real one)
        if not had:
            Init.linear_bk = F.linear
        F.linear = zero3_linear_wrap
        assert F.linear is zero3_linear_wrap and Init.linear_bk is original
        assert restore_torch_linear() and F.linear is original
    finally:
        F.linear = original
        if not had and hasattr(Init, "linear_bk"):
            del Init.linear_bk
