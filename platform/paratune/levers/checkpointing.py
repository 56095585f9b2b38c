"""Activation checkpointing: which activations the decoder blocks keep for backward and which they
compute again (runtime: paratune.parallel.recompute)."""

from __future__ import annotations

from typing import Any, Literal

from paratune.levers.registry import Lever, LeverField, register

# none: keep every activation. selective: per op, every block: save the outputs of the matmuls and
# attention (SAVED_OPS in paratune.parallel.recompute), recompute the cheap ops (norms, activations,
# rotary, residual adds). selective_op: torchtitan's op-level policy (its selective_ac_option
# "op"; paratune.parallel.recompute.op_policy): per op, every block, every second matmul of the
# block recomputed, the others', attention's, reduce_scatter's and max's outputs kept: less memory
# than selective, more recompute (on a Llama block k, o and up are recomputed: ~1/3 of the
# block's forward matmul FLOPs). layers: recompute every `checkpoint_every`-th block whole
# (torchtitan's selective_ac_option "2"). full: recompute every block whole.
Checkpointing = Literal["none", "selective", "selective_op", "layers", "full"]


def _rules(plan: Any) -> None:
    ac = plan.activation_checkpointing
    if plan.checkpoint_every != 2 and ac != "layers":
        raise ValueError(f"checkpoint_every: {plan.checkpoint_every} is used only with activation_checkpointing "
                         f"'layers', got '{ac}'; allowed: leave it out, or activation_checkpointing 'layers'")


def _label(plan: dict) -> str | None:
    mode = plan.get("activation_checkpointing", "none")
    if mode == "none":
        return None
    return {"full": "ckpt", "selective": "sac", "selective_op": "sac/op", "layers": f"ckpt/{plan.get('checkpoint_every', 2)}"}.get(
        mode, f"ckpt:{mode}")


CHECKPOINTING = register(Lever(
    name="checkpointing",
    doc="activations recomputed in backward instead of kept: per op (paratune's or torchtitan's policy), "
        "every N-th block, or every block",
    fields=(
        LeverField("activation_checkpointing", Checkpointing, "none",
                   "none | selective (per op: matmuls and attention kept) | selective_op (torchtitan's op-level "
                   "policy: every second matmul recomputed; lower memory than selective, more recompute) | "
                   "layers | full", after="micro_batch"),
        LeverField("checkpoint_every", int, 2, "'layers': every N-th block recomputed", {"ge": 2, "le": 1024}),
    ),
    rules=_rules,
    label=_label,
    label_rank=70,
    apply=(("before_shard", "paratune.parallel.recompute:apply_lever"),),
))
