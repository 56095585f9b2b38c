"""Routing balance and the all-to-all share: what a MoE trial records beside its speed."""

from __future__ import annotations

import pytest
import torch

from paratune.measure import all_to_all_share_from_events, comm_share_from_events
from paratune.models import build_config, build_model, routed_experts
from paratune.routing import RoutingCounter, balance


def _router_choices(config, ids) -> dict[int, torch.Tensor]:
    """Tokens per expert per layer, read independently: the MoE blocks' routers (their `gate`
    outputs) in one forward of the same model, without checkpointing."""
    model = build_model(config, seed=0)
    seen: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.model.layers):
        def keep(module, args, out, i=i):
            _, _, index = out  # (logits, top-k weights, top-k indices)
            seen[i] = torch.bincount(index.reshape(-1), minlength=module.num_experts)
        block.mlp.gate.register_forward_hook(keep)
    model(input_ids=ids, labels=ids)
    return seen


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_counter_counts_each_routed_token_once(checkpointing):
    """Counts match the routers' own choices; full checkpointing re-runs every block in backward,
    and that second pass is not counted."""
    from paratune.parallel.recompute import apply_checkpointing
    from paratune.plan import load_plan_dict

    config = build_config("tiny-mixtral")
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = _router_choices(config, ids)
    model = build_model(config, seed=0)
    apply_checkpointing(model, load_plan_dict({"model": "tiny-mixtral", "activation_checkpointing": checkpointing}))
    model.train()
    counter = RoutingCounter([model], config.num_hidden_layers)
    counter.counting = True
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.has_experts and sorted(counter._counts) == sorted(expected) == [0, 1]
    for layer, counts in counter._counts.items():
        assert torch.equal(counts, expected[layer]), (layer, counts, expected[layer])
    counter.counting = False  # off: a warm-up step is not counted
    model(input_ids=ids, labels=ids)
    assert all(torch.equal(counter._counts[layer], expected[layer]) for layer in expected)
    counter.remove()


def test_balance_is_max_over_mean():
    assert balance([4, 4, 4, 4]) == 1.0
    assert balance([8, 0, 4, 4]) == 2.0
    assert balance([0, 0]) != balance([0, 0])  # nan: no token


def test_a_dense_model_has_nothing_to_count():
    config = build_config("tiny-llama")
    model = build_model(config, seed=0)
    assert not routed_experts(model) and not RoutingCounter([model], config.num_hidden_layers).has_experts


def test_the_all_to_all_share_is_its_own_part_of_the_collectives():
    events = [("gloo:all_reduce", 0.0, 100_000.0, False), ("gloo:all_to_all", 200_000.0, 300_000.0, False),
              ("c10d::alltoall_base_", 250_000.0, 350_000.0, False), ("aten::mm", 0.0, 900_000.0, False)]
    assert comm_share_from_events(events, 1.0, "cpu") == pytest.approx(0.25)
    assert all_to_all_share_from_events(events, 1.0, "cpu") == pytest.approx(0.15)  # union of its two spans
    cuda = [("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0.0, 50_000.0, True),
            ("ncclDevKernel_AllGather_RING_LL(x)", 100_000.0, 200_000.0, True),
            ("nccl:all_to_all", 0.0, 500_000.0, False)]  # a host annotation: not the kernel's time
    assert all_to_all_share_from_events(cuda, 1.0, "cuda") == pytest.approx(0.05)
    assert comm_share_from_events(cuda, 1.0, "cuda") == pytest.approx(0.15)
