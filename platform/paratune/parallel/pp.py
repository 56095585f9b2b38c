"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into stages (embedding with the first, final norm and LM head with the last,
layers balanced: stage sizes differ by at most one). Schedules: GPipe, 1F1B, interleaved 1F1B
(two stages per rank). The step's micro-batches (grad_accum of them) are the pipeline's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratune.models import decoder_blocks


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Balanced contiguous split: the first (num_layers % num_stages) stages get one layer more."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


class StageModule(nn.Module):
    """One pipeline stage of a transformers decoder: [embedding] + layers[a:b] + [norm + head]."""

    def __init__(self, model: nn.Module, layers: tuple[int, int], first: bool, last: bool, seq_shards: int = 1):
        super().__init__()
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList(decoder_blocks(model)[layers[0] : layers[1]])
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = base.rotary_emb  # no parameters: recomputed on every stage
        self.autocast = False  # bf16 autocast inside the stage (set when no FSDP2 mixed precision)
        # Under sequence parallelism the residual stream between blocks (and between stages) is a
        # sequence shard of 1/seq_shards of the tokens; positions are those of the whole sequence.
        self.seq_shards = seq_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.autocast:
            return self._forward(x)
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        seq_len = x.shape[1] if self.embed_tokens is not None else h.shape[1] * self.seq_shards
        position_ids = torch.arange(seq_len, device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:  # attention_mask=None: SDPA applies the causal mask itself
            h = layer(h, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as transformers computes it (mean over shifted tokens, fp32)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())


def build_stages(model: nn.Module, pp: int, pp_rank: int, schedule: str,
                 seq_shards: int = 1) -> list[tuple[int, StageModule]]:
    """(stage index, module) pairs owned by this pp rank; interleaved gives each rank two.
    `seq_shards`: the tp degree under sequence parallelism (stage inputs are sequence shards)."""
    per_rank = 2 if schedule == "interleaved_1f1b" else 1
    num_stages = pp * per_rank
    ranges = stage_layer_ranges(len(decoder_blocks(model)), num_stages)
    indices = [pp_rank + k * pp for k in range(per_rank)]  # round-robin, as interleaving expects
    return [(i, StageModule(model, ranges[i], i == 0, i == num_stages - 1, seq_shards)) for i in indices]


def make_schedule(stages, n_microbatches: int, schedule: str):
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B, Schedule1F1B

    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=causal_lm_loss)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=causal_lm_loss)
