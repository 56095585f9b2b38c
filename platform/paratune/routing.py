"""How evenly a mixture-of-experts trial's routers spread tokens over the experts (worker side).

Each routed-experts module (models.routed_experts) is called by its MoE block as
experts(hidden_states, top_k_index, top_k_weights): a forward pre-hook counts top_k_index per expert,
with the model's global expert ids (under expert parallelism the hook runs before the dispatch,
so every rank counts its own tokens' choices, whichever rank computes them). Counts are summed over
the measured steps and over all ranks; per layer the balance is max / mean tokens per expert (1.0:
perfectly even; the busiest expert's, and under ep its rank's, work scales by it). A forward re-run
by activation checkpointing inside backward is not counted twice (autograd's graph task is current
then). The cost model takes the worst layer's figure as its imbalance factor.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    """The decoder block index in a module path (model.layers.3.mlp.experts -> 3)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    return int(found[0]) if found else None


class RoutingCounter:
    """Tokens per expert, per MoE layer, while `counting` is on (the measured steps)."""

    def __init__(self, roots: list[nn.Module], num_layers: int):
        from paratune.models import routed_experts

        self.counting = False
        self.num_layers = num_layers
        self._counts: dict[int, torch.Tensor] = {}
        self._handles = []
        for root in roots:
            offset = getattr(root, "layer_offset", 0)  # a pipeline stage numbers its blocks from 0
            for ordinal, (name, module, count) in enumerate(routed_experts(root)):
                layer = _layer_of(name)
                layer = None if layer is None else layer + offset
                experts = getattr(module, "_ep_global_experts", count)  # ep: the module now holds E / ep
                self._handles.append(module.register_forward_pre_hook(
                    self._hook(layer if layer is not None else ordinal, experts)))

    @property
    def has_experts(self) -> bool:
        return bool(self._handles)

    def _hook(self, layer: int, experts: int):
        def count(module: nn.Module, args) -> None:
            if not self.counting or len(args) < 2 or torch._C._current_graph_task_id() != -1:
                return  # off, not the (hidden, top_k_index, weights) call, or a recompute in backward
            index = args[1].detach().reshape(-1)
            counts = torch.bincount(index[index >= 0].to(torch.int64), minlength=experts)[:experts]
            held = self._counts.get(layer)
            self._counts[layer] = counts.cpu() if held is None else held + counts.cpu()
        return count

    def reduce(self, device: torch.device) -> tuple[list[int], list[list[int]]]:
        """(layers, tokens per expert of each) summed over all ranks (a collective: every rank
        calls it); layers without routed experts are left out."""
        import torch.distributed as dist

        width = max((c.numel() for c in self._counts.values()), default=0)
        width_t = torch.tensor([width], dtype=torch.int64, device=device)
        dist.all_reduce(width_t, op=dist.ReduceOp.MAX)
        width = int(width_t)
        table = torch.zeros((self.num_layers, width), dtype=torch.int64)
        for layer, counts in self._counts.items():
            if 0 <= layer < self.num_layers:
                table[layer, :counts.numel()] += counts
        table = table.to(device)
        dist.all_reduce(table)
        rows = table.cpu().tolist()
        layers = [i for i, row in enumerate(rows) if sum(row) > 0]
        return layers, [rows[i] for i in layers]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def balance(tokens_per_expert: list[int]) -> float:
    """max / mean tokens per expert of one layer (1.0: even); nan for a layer that saw no token."""
    total = sum(tokens_per_expert)
    if not tokens_per_expert or total == 0:
        return float("nan")
    return max(tokens_per_expert) / (total / len(tokens_per_expert))
