"""Routing balance of a mixture-of-experts trial: tokens routed to each expert, per MoE layer.

Worker side (torch); the trial (paratune.cluster.trial) turns it on for its measured steps, and
paratune.costs.measure.routing_summary makes each layer's busiest-expert / mean of the sums.
"""

from __future__ import annotations

import re
from typing import Any

import torch


class RoutingCounter:
    """Tokens routed to each expert of every routed-experts module, while `counting` is on.

    A forward pre-hook on each experts module (transformers 5.2x calls most families' as
    experts(hidden_states, top_k_index, top_k_weights); JetMoE's as experts(inputs, expert_size),
    the tokens per expert already counted) adds up the router's ids, or the counts; a call that
    carries neither is noted (`unread`), never a crash. Under
    expert parallelism the module's forward is the dispatch (an instance attribute), and its
    pre-hooks still run before it, on the router's global expert ids. Activation checkpointing's
    recompute runs the forward again inside backward (the autograd engine is executing a node
    then): such a call is not counted, so each routed token counts once.

    The counts stay on the router's device and grow by `index_add_`, which queues like any
    kernel: no host transfer and no sync inside a timed step (a `.to("cpu")` per MoE layer
    drained the stream each time; CUDA's bincount syncs too, to size its output from the
    largest id). They reach the host once, after the measured steps (`summed_over_ranks`)."""

    def __init__(self, model: torch.nn.Module, ep: int, counts_tokens: bool,
                 device: torch.device | str = "cpu") -> None:
        from paratune.model.build import routed_experts

        self.counting = False
        self.counts_tokens = counts_tokens  # tp ranks share their tokens: one of them counts
        self.counts: dict[str, torch.Tensor] = {}
        self.unread: set[str] = set()  # experts modules whose call carried neither ids nor counts
        self.handles = []
        for path, module, count in routed_experts(model):
            # ep's experts module keeps E / ep local experts (`_ep_rows` marks it): the router's ids span all E.
            experts = count * ep if getattr(module, "_ep_rows", None) else count
            path = _model_path(model, path)
            self.counts[path] = torch.zeros(experts, dtype=torch.int64, device=device)
            self.handles.append(module.register_forward_pre_hook(self._hook(path, experts), with_kwargs=True))

    def _hook(self, path: str, experts: int):
        def count_routed(module, args, kwargs):
            if not self.counting or not self.counts_tokens or torch._C._current_autograd_node() is not None:
                return None  # off, a tp rank that does not count, or a recompute inside backward
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            counts = self.counts[path]
            if isinstance(index, torch.Tensor) and not index.is_floating_point():  # the router's expert ids
                flat = index.detach().reshape(-1)
                if counts.device != flat.device:  # made elsewhere than the router runs: moved once
                    counts = self.counts[path] = counts.to(flat.device)
                counts.index_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))
            elif (isinstance(index, (list, tuple)) and len(index) == experts
                  and all(isinstance(n, int) for n in index)):  # tokens per expert (JetMoE's expert_size, on the host)
                counts += torch.tensor(index, dtype=torch.int64, device=counts.device)
            else:  # a family that hands its experts something else: its routing is not read
                self.unread.add(path)
            return None

        return count_routed

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def summed_over_ranks(self, world: int) -> list[list[int]]:
        """Every MoE layer's tokens per expert, summed over the ranks (pipeline stages hold
        different layers; each layer's by its path), layers in the model's order."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {p: c.tolist() for p, c in self.counts.items()})
        total: dict[str, list[int]] = {}
        for per_rank in gathered:
            for path, counts in per_rank.items():
                acc = total.setdefault(path, [0] * len(counts))
                total[path] = [a + b for a, b in zip(acc, counts)]
        return [total[p] for p in sorted(total, key=_natural_key)]


def _model_path(model: torch.nn.Module, path: str) -> str:
    """A pipeline rank's stages (a ModuleList of paratune.parallel.pp.StageModule) number their
    blocks from 0 ("0.layers.0.mlp.experts" on every stage): the path by the block's index in the
    whole model instead ("layers.5.mlp.experts"), so stages' layers do not collide when summed."""
    stage, _, rest = path.partition(".")
    if not (isinstance(model, torch.nn.ModuleList) and stage.isdigit() and rest.startswith("layers.")):
        return path
    offset = getattr(model[int(stage)], "layer_offset", None)
    if offset is None:
        return path
    index, _, tail = rest.removeprefix("layers.").partition(".")
    return f"layers.{offset + int(index)}.{tail}" if index.isdigit() else path


def _natural_key(path: str) -> list:
    """model.layers.10 after model.layers.9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]
