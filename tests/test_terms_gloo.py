"""Issue 43's terms in both time models, each shown in its direction on real CPU runs where a CPU
can show it (gloo processes, a real checkpointed model), and in the calibrated model's composition
(paratune.costs.timemodel.compose) beside the roofline's (paratune.costs.estimate)."""

from __future__ import annotations

import pytest
from gloo_harness import run_plans_on_gloo
from test_timemodel import make_profile

from paratune.costs.estimate import comm_volume, dp_overlap_share
from paratune.levers import async_tp_hidden
from paratune.config.plan import load_plan_dict
from paratune.costs.timemodel import compose

# ------------------------------------------------------------------ counted on gloo (2 processes)
CALLS: list[tuple[str, int]] = []


def count_fsdp_collectives() -> None:
    """Setup of each gloo worker: FSDP2's all-gathers and reduce-scatters (torch 2.13 calls
    dist.all_gather_single / dist.reduce_scatter_single) recorded with their input bytes."""
    import torch.distributed as dist

    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)

        def counting(output, input, *args, _name=name, _original=original, **kwargs):  # noqa: A002 - torch's name
            CALLS.append((_name, input.numel() * input.element_size()))
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counting)


def measure_with_counts(plan, rank, world, local_world, device):
    """train_and_measure, and the collectives it ran (per step)."""
    from paratune.trial.worker import train_and_measure

    CALLS.clear()
    out = train_and_measure(plan, rank, world, local_world, device)
    steps = plan.warmup_steps + plan.measure_steps
    gathers = [b for n, b in CALLS if n == "all_gather_single"]
    scatters = [b for n, b in CALLS if n == "reduce_scatter_single"]
    return {**out, "gathers_per_step": len(gathers) / steps, "gather_bytes_per_step": sum(gathers) / steps,
            "scatters_per_step": len(scatters) / steps}


def _gloo_plan(**changes):
    base = {"model": "tiny-llama", "seq_len": 32, "num_workers": 2, "global_batch": 4, "strategy": "fsdp",
            "fsdp": {"sharding": "full"}, "device": "cpu", "precision": "fp32", "warmup_steps": 1,
            "measure_steps": 1, "track_memory": False, "profile_comm": False}
    return load_plan_dict({**base, **changes}, source="test")


@pytest.mark.integration
def test_fsdp2_regathers_and_reduce_scatters_every_micro_batch_on_gloo():
    """Accumulation under FSDP2 gathers every block (twice: forward, and backward after
    resharding) and reduce-scatters its gradients every micro-batch: 2 micro-batches a step move
    twice what 1 does. The roofline's volume and the calibrated model's composition say the same."""
    one, two = _gloo_plan(micro_batch=2), _gloo_plan(micro_batch=1)  # grad_accum 1 and 2
    assert (one.grad_accum, two.grad_accum) == (1, 2)
    a, b = run_plans_on_gloo([one, two], setup="test_terms_gloo:count_fsdp_collectives",
                             measure="test_terms_gloo:measure_with_counts")
    assert a["gathers_per_step"] > 0 and a["scatters_per_step"] > 0
    assert b["gathers_per_step"] == pytest.approx(2 * a["gathers_per_step"])
    assert b["scatters_per_step"] == pytest.approx(2 * a["scatters_per_step"])
    assert b["gather_bytes_per_step"] == pytest.approx(2 * a["gather_bytes_per_step"])
    assert comm_volume(two).dp == pytest.approx(2 * comm_volume(one).dp)
    profile = make_profile()  # a CPU profile: no overlap, every collective counted
    one_c = one.with_changes(model="small-llama", seq_len=128)
    two_c = two.with_changes(model="small-llama", seq_len=128, grad_accum=2)
    assert compose(two_c, profile)["dp_comm"] == pytest.approx(2 * compose(one_c, profile)["dp_comm"])


# ------------------------------------------------------------------ a real checkpointed model on CPU
def test_full_recompute_runs_the_forward_again_counted_on_a_real_model():
    """FLOPs of one step of a real (tiny) model under torch's FlopCounterMode: full checkpointing
    adds the blocks' forward, what recompute_share (1/3 of forward + backward) and efficiency's
    matmul term (x 4/3) count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from paratune.costs.efficiency import recompute_share
    from paratune.model.build import build_config
    from paratune.parallel.recompute import checkpoint_blocks

    def step_flops(mode: str) -> int:
        torch.manual_seed(0)
        config = build_config("tiny-llama", {"num_hidden_layers": 4})
        model = AutoModelForCausalLM.from_config(config)
        if mode != "none":
            checkpoint_blocks(model, mode)
        ids = torch.randint(0, config.vocab_size, (2, 64))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        return counter.get_total_flops()

    none, full = step_flops("none"), step_flops("full")
    plan = load_plan_dict({"model": "tiny-llama", "seq_len": 64, "num_workers": 1, "global_batch": 2,
                           "activation_checkpointing": "full", "strategy": "ddp"}, source="test")
    assert full > none
    # the head is not recomputed: measured a little under 4/3, the model's 1 + 1/3 above it
    assert 1.2 < full / none <= 1 + recompute_share(plan)
    assert full / none == pytest.approx(1 + recompute_share(plan), rel=0.1)


# ------------------------------------------------------------------ the calibrated model's composition
def _cuda_profile():
    return make_profile().model_copy(update={"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"})


def _tp_plan(**changes):
    return load_plan_dict({"model": "small-llama", "seq_len": 128, "global_batch": 16, "num_workers": 2,
                           "micro_batch": 2, "tp": 2, "sequence_parallel": True, "compile": True, "device": "cuda",
                           **changes}, source="test")


def test_the_calibrated_model_hides_the_forwards_tp_collectives_under_async_tp():
    profile = _cuda_profile()
    plain, fused = compose(_tp_plan(), profile), compose(_tp_plan(async_tp=True), profile)
    assert fused["tp_comm"] == pytest.approx(plain["tp_comm"] * (1 - async_tp_hidden(_tp_plan(async_tp=True))))
    assert fused["compute"] == plain["compute"]


def test_prefetch_hides_fsdp2s_gathers_under_the_micro_batch_on_gpus_not_on_cpu():
    """FSDP2 prefetches the next block's gather under the current one's compute (forward and
    backward): on a GPU profile only the first gather of a micro-batch is exposed while the
    gathers take less than the compute; on CPU workers compute and collectives share the cores,
    so all of it counts. The roofline hides FSDP2's under the whole micro-batch, DDP's under its
    backward."""
    fsdp = load_plan_dict({"model": "small-llama", "seq_len": 128, "global_batch": 16, "num_workers": 2,
                           "micro_batch": 2, "strategy": "fsdp", "fsdp": {"sharding": "full"}}, source="test")
    cpu = compose(fsdp, make_profile())["dp_comm"]
    gpu = compose(fsdp, _cuda_profile())["dp_comm"]
    assert 0 < gpu < cpu
    assert dp_overlap_share(fsdp) == 1.0
    assert dp_overlap_share(fsdp.with_changes(strategy="ddp", fsdp=None)) == pytest.approx(2 / 3)


def test_the_calibrated_model_counts_fsdp2s_copies_every_micro_batch_on_gpus():
    """FSDP2's copy-out of each gather and copy-in to each reduce-scatter run on the compute
    stream every micro-batch (paratune.costs.efficiency.fsdp_copy_bytes): on a GPU profile an FSDP2
    plan's compute exceeds DDP's at the same blocks by exactly those copies, per micro-batch; on
    CPU workers (no HBM figure) and for DDP (its gradients are views of its buckets) none."""
    from paratune.costs.efficiency import fsdp_copy_seconds_per_micro_batch

    def plan(strategy, micro_batch):
        extra = {"fsdp": {"sharding": "full"}} if strategy == "fsdp" else {}
        return load_plan_dict({"model": "small-llama", "seq_len": 128, "global_batch": 16, "num_workers": 2,
                               "micro_batch": micro_batch, "strategy": strategy, "precision": "bf16",
                               "device": "cuda", **extra}, source="test")

    gpu = _cuda_profile()
    for micro_batch in (2, 1):  # 4 then 8 micro-batches a step
        fsdp, ddp = plan("fsdp", micro_batch), plan("ddp", micro_batch)
        copies = fsdp_copy_seconds_per_micro_batch(fsdp, gpu.device_name)
        assert copies > 0 and fsdp_copy_seconds_per_micro_batch(ddp, gpu.device_name) == 0.0
        assert compose(fsdp, gpu)["compute"] - compose(ddp, gpu)["compute"] == pytest.approx(
            copies * fsdp.grad_accum, rel=1e-9)
    cpu = make_profile()
    assert compose(plan("fsdp", 2), cpu)["compute"] == compose(plan("ddp", 2), cpu)["compute"]
