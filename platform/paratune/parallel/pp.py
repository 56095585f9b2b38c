"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into stages (embedding with the first, final norm and LM head with the last,
layers balanced: stage sizes differ by at most one). Schedules: GPipe, 1F1B, interleaved 1F1B
(two stages per rank). The step's micro-batches (grad_accum of them) are the pipeline's.

The pieces are found whatever the family calls them (models.decoder_parts: Llama's embed_tokens /
norm / lm_head, GPT-NeoX's embed_in / final_layer_norm / lm_head), and each block is called with
the arguments its forward takes (positions; rotary tables where the family has them). Which
families' stages train exactly like the whole model is preflight's rule (PIPELINE_FAMILIES);
profiling (paratune.costs.profile) times one block, the embedding and the head of any family this way.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paratune.model.build import decoder_parts
from paratune.parallel.loss import FALLBACK_ATTR, FORM_ATTR, stage_loss


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Balanced contiguous split: the first (num_layers % num_stages) stages get one layer more."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def _block_arguments(block: nn.Module) -> tuple[set[str], list[str]]:
    """(keyword arguments a block's forward accepts, those it requires after the hidden states):
    Llama's and GPT-NeoX's take position_ids and position_embeddings; Falcon's requires alibi and
    attention_mask (None: rotary positions, SDPA's own causal mask)."""
    params = list(inspect.signature(type(block).forward).parameters.values())[2:]  # self, hidden_states
    accepts = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return accepts, required


class StageModule(nn.Module):
    """One pipeline stage of a transformers decoder: [embedding] + layers[a:b] + [norm + head]."""

    def __init__(self, model: nn.Module, layers: tuple[int, int], first: bool, last: bool, seq_shards: int = 1):
        super().__init__()
        parts = decoder_parts(model)
        self.embed_tokens = parts.embedding if first else None
        self.layers = nn.ModuleList(list(parts.blocks)[layers[0] : layers[1]])
        self.layer_offset = layers[0]  # its layers' indices in the whole model (layers.0 here is that one)
        self.norm = parts.norm if last else None
        self.lm_head = parts.head if last else None
        self.rotary_emb = parts.rotary  # no parameters: recomputed on every stage
        self.autocast = False  # bf16 autocast inside the stage (set when no FSDP2 mixed precision)
        # Under sequence parallelism the residual stream between blocks (and between stages) is a
        # sequence shard of 1/seq_shards of the tokens; positions are those of the whole sequence.
        self.seq_shards = seq_shards
        self._accepts, self._required = _block_arguments(self.layers[0]) if len(self.layers) else (set(), [])
        # The model's loss form (paratune.parallel.loss), on every stage: the runner reports it.
        setattr(self, FORM_ATTR, getattr(model, FORM_ATTR, "standard"))
        setattr(self, FALLBACK_ATTR, getattr(model, FALLBACK_ATTR, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.autocast:
            return self._forward(x)
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        if self.layers:
            seq_len = x.shape[1] if self.embed_tokens is not None else h.shape[1] * self.seq_shards
            position_ids = torch.arange(seq_len, device=h.device).unsqueeze(0)
            kwargs: dict = dict.fromkeys(self._required)  # attention_mask=None: SDPA applies the causal mask
            if "position_ids" in self._accepts:
                kwargs["position_ids"] = position_ids
            if self.rotary_emb is not None and "position_embeddings" in self._accepts:
                kwargs["position_embeddings"] = self.rotary_emb(h, position_ids)
            for layer in self.layers:
                h = layer(h, **kwargs)
                h = h[0] if isinstance(h, tuple) else h  # families whose blocks still return tuples
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h) if self.norm is not None else h)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as transformers computes it (mean over shifted tokens, fp32)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())


def build_stages(model: nn.Module, pp: int, pp_rank: int, schedule: str,
                 seq_shards: int = 1) -> list[tuple[int, StageModule]]:
    """(stage index, module) pairs owned by this pp rank; interleaved gives each rank two.
    `seq_shards`: the tp degree under sequence parallelism (stage inputs are sequence shards)."""
    per_rank = 2 if schedule == "interleaved_1f1b" else 1
    num_stages = pp * per_rank
    ranges = stage_layer_ranges(len(decoder_parts(model).blocks), num_stages)
    indices = [pp_rank + k * pp for k in range(per_rank)]  # round-robin, as interleaving expects
    return [(i, StageModule(model, ranges[i], i == 0, i == num_stages - 1, seq_shards)) for i in indices]


def last_stage_loss(stages) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The schedule's loss function: the last stage's head computes it when the loss is chunked
    (the stage then returns the hidden states, paratune.parallel.loss.ChunkedLossHead), else
    causal_lm_loss on the logits. Ranks without the last stage never call it."""
    heads = [stage.submod.lm_head for stage in stages if getattr(stage.submod, "lm_head", None) is not None]
    return partial(stage_loss, heads[0]) if heads else causal_lm_loss


def make_schedule(stages, n_microbatches: int, schedule: str):
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B, Schedule1F1B

    loss_fn = last_stage_loss(stages)
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
