"""Measuring mixture-of-experts trials: routing balance per MoE layer and the all-to-all share.

Real tiny-mixtral trials on 2 gloo processes (test_parity_gloo's shared process set): tokens per expert summed over the ranks add up to every routed (token, expert) pair of
the measured steps, once each under activation checkpointing's recompute and under ep's
dispatch; the all-to-all share is found by the names gloo really records, 0 without ep.
"""

from __future__ import annotations

import pytest
import torch

from paratune.costs import measure
from paratune.config.plan import load_plan_dict
from paratune.trial.results import TrialResult
from paratune.cluster.trial import summarize
from gloo_harness import batch_result

TOP_K = 2  # tiny-mixtral: num_experts_per_tok
EXPERTS = 8


def _plan(**fields):
    base = dict(model="tiny-mixtral", num_workers=2, seq_len=16, global_batch=4, micro_batch=1, warmup_steps=1,
                measure_steps=2, profile_comm=True, track_memory=False, device="cpu")
    return load_plan_dict({**base, **fields})


CASES = {
    "ddp": _plan(strategy="ddp"),
    "ddp-ep2": _plan(strategy="ddp", ep=2),
    "fsdp-ep2-full-checkpointing": _plan(strategy="fsdp", ep=2, activation_checkpointing="full"),
}


@pytest.fixture(scope="module")
def runs():
    """The cases' outputs from test_parity_gloo's shared batch of 2 processes (one spawn for all)."""
    from test_parity_gloo import _runs

    return {name: run for (kind, name), run in _runs(2).items() if kind == "moe-measure"}


@pytest.mark.parametrize("case", list(CASES))
def test_every_routed_pair_of_the_measured_steps_counted_once(runs, case):
    plan, out = batch_result(runs[case])
    tokens = out["expert_tokens"]
    assert len(tokens) == 2, "tiny-mixtral has 2 MoE layers"
    pairs = plan.tokens_per_step * plan.measure_steps * TOP_K  # every rank's tokens, top-2 each
    for layer in tokens:
        assert len(layer) == EXPERTS
        assert sum(layer) == pairs, (case, layer)
    result = summarize(plan, out, 1.0)
    assert len(result.routing_balance_per_layer) == 2
    assert result.routing_balance == max(result.routing_balance_per_layer)
    assert 1.0 <= result.routing_balance <= EXPERTS / TOP_K


def test_the_gpu_peak_window_closes_before_the_profiled_step(runs):
    """The allocator's peak is read after the last measured step, before the extra profiled step
    (what a CUDA trial reports: steps 1-2 of 3, though 4 ran)."""
    _, out = batch_result(runs["ddp"])
    assert out["memory_window_steps"] == [1, 2] and out["steps_run"] == 4


def test_the_routing_hook_never_leaves_the_routers_device():
    """A timed step must not wait for the host: the hook counts on the index's device with
    index_add_ (no `.to("cpu")`, no bincount, which syncs on CUDA to size its output, no item()).
    On the meta device any host transfer raises, and a dispatch mode lists every op it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratune.model.build import build_config, build_model
    from paratune.trial.routing import RoutingCounter

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    model = build_model(build_config("tiny-mixtral", {}), seed=0)
    counter = RoutingCounter(model, ep=1, counts_tokens=True, device="meta")
    counter.counting = True
    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    hook = next(iter(experts._forward_pre_hooks.values()))
    index = torch.randint(0, EXPERTS, (16, TOP_K)).to("meta")
    with Ops() as ops:
        hook(experts, (torch.empty(16, 8, device="meta"), index), {})
    assert not ops.seen & {"aten._local_scalar_dense", "aten.bincount", "aten.item"}, ops.seen
    assert all(c.device.type == "meta" for c in counter.counts.values())
    counter.remove()
    real = RoutingCounter(model, ep=1, counts_tokens=True)
    real.counting = True
    hook = next(iter(experts._forward_pre_hooks.values()))
    real_index = torch.tensor([[0, 1], [1, 7]])
    hook(experts, (None, real_index), {})
    assert next(iter(real.counts.values())).tolist() == [1, 2, 0, 0, 0, 0, 0, 1]


def test_all_to_all_share_only_with_ep(runs):
    _, dense = batch_result(runs["ddp"])
    assert dense["all_to_all_share"] == 0.0
    for case in ("ddp-ep2", "fsdp-ep2-full-checkpointing"):
        _, out = batch_result(runs[case])
        assert 0.0 < out["all_to_all_share"] <= out["comm_share"], case


def test_routing_balance_arithmetic():
    assert measure.routing_balance([5, 5, 5, 5]) == 1.0
    assert measure.routing_balance([8, 0, 0, 0]) == 4.0
    assert measure.routing_balance([0, 0]) is None
    worst, per_layer = measure.routing_summary([[3, 1], [2, 2], [0, 0]])
    assert per_layer == [1.5, 1.0, None] and worst == 1.5


def test_cuda_all_to_all_kernels_by_their_annotation():
    """NCCL's all-to-all runs as ncclDevKernel_SendRecv kernels, as a pipeline's p2p does: only
    those inside the GPU-side "nccl:all_to_all" annotation are the all-to-all's."""
    E = measure.ProfileEvent
    events = [E("nccl:all_to_all", 100.0, 400.0, False, True),
              E("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 150.0, 350.0, True),
              E("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 600.0, 700.0, True),  # pp's p2p
              E("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 800.0, 900.0, True),
              E("nccl:all_to_all", 1000.0, 1100.0, False, False)]  # host label: a launch, not the work
    assert measure.all_to_all_share_from_events(events, 0.001, "cuda") == pytest.approx(0.2)
    assert measure.comm_share_from_events(events, 0.001, "cuda") == pytest.approx(0.4)
    with pytest.raises(ValueError, match="device_type"):
        measure.all_to_all_share_from_events(events, 0.001, "tpu")


def test_a_ledger_written_before_routing_fields_still_reads():
    old = {"status": "ok", "plan": {"model": "tiny-llama"}, "world_size": 2, "comm_share": 0.3}
    result = TrialResult.model_validate(old)
    assert result.routing_balance is None and result.all_to_all_share is None and result.expert_tokens == []


def test_routing_is_read_from_a_family_that_hands_its_experts_counts(tmp_path):
    """JetMoE calls its experts as experts(inputs, expert_size): the tokens per expert, already
    counted on the host. A real forward of a tiny JetMoE: every layer's counts add up to tokens x
    top-k, none unread."""
    from family_zoo import write_config

    from paratune.model.build import build_config, build_model
    from paratune.trial.routing import RoutingCounter

    config = build_config(str(write_config("jetmoe", tmp_path)), {})
    model = build_model(config, seed=0)
    counter = RoutingCounter(model, ep=1, counts_tokens=True)
    counter.counting = True
    with torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (2, 8)))
    assert counter.counts and not counter.unread
    for path, counts in counter.counts.items():
        assert int(counts.sum()) == 2 * 8 * config.num_experts_per_tok, path
