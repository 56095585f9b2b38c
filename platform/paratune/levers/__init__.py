"""The throughput levers of a plan: one module each (checkpointing, float8, compile, loss, async_tp),
registered in paratune.levers.registry, which everything that handles levers iterates.

Each lever owns plain plan fields, so a space sweeps it like a degree. Its rules see only the plan:
what no device can run is refused before any worker starts, with the reason. What depends on the
cluster's devices (float8 on a GPU without FP8, async TP on CPU workers) is its device refusal,
checked where the cluster is known (the cost model, the launch). The runtime side lives in
paratune.parallel (recompute, compile, float8, loss), applied in the registry's stages.

The registration order is the order the rules are checked in (the first broken one is the plan's
error, and a space counts its removed plans by it) and the workers apply them in.
"""

from __future__ import annotations

from paratune.levers import checkpointing, float8, compile, loss, async_tp  # noqa: F401 - registration order
from paratune.levers.async_tp import ASYNC_TP_CPU_REASON, async_tp_hidden
from paratune.levers.checkpointing import Checkpointing
from paratune.levers.compile import COMPILE_COMPUTE_SAVING, COMPILE_ZERO3_REASON
from paratune.levers.float8 import (DEVICES_WITHOUT_FP8_REASON, FLOAT8_MULTIPLE, Float8Recipe,
                                    float8_allowed_micro_batches, float8_rank_tokens)
from paratune.levers.loss import LossForm, loss_form
from paratune.levers.registry import (APPLY_STAGES, Lever, LeverField, applied_at, check_levers,
                                      compute_time_factor, device_refusal, export_notes, extra_memory_bytes,
                                      lever_fields, lever_labels, levers, ordered_fields, owner_of, register,
                                      tp_comm_hidden, unregister)

__all__ = [
    "APPLY_STAGES", "ASYNC_TP_CPU_REASON", "COMPILE_COMPUTE_SAVING", "COMPILE_ZERO3_REASON",
    "DEVICES_WITHOUT_FP8_REASON", "FLOAT8_MULTIPLE", "Checkpointing", "Float8Recipe", "Lever", "LeverField",
    "LossForm", "applied_at", "async_tp_hidden", "check_levers", "compute_time_factor", "device_refusal",
    "export_notes", "extra_memory_bytes", "float8_allowed_micro_batches", "float8_rank_tokens", "lever_fields",
    "lever_labels", "levers", "loss_form", "ordered_fields", "owner_of", "register", "tp_comm_hidden", "unregister",
]
