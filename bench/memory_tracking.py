"""How bench/estimate_accuracy.py measures peak memory on CPU: the trial's own MemTracker step
(paratune.trial._tracked_peak_bytes), with the buffers DDP and DeepSpeed ZeRO-3 allocate before
the step made visible to it.

Why: MemTracker counts a tensor from the moment an op it sees creates or touches it, or when it
is handed to `track_external` before the step. DDP's reducer allocates its buckets in C++ when it
is built (4 bytes a parameter in fp32, where the gradients live as views with
gradient_as_bucket_view) and zero_grad(set_to_none=True) drops the gradient views, so the tracker
first meets a bucket when the backward copies the first gradient into it. Until then, e.g. at the
start of the last micro-batch's backward (the activation peak), the buckets are memory the device
holds (a GPU's max_memory_allocated counts them from DDP's construction) that the tracker does not
count. Here each DDP module gets torch's own `allreduce_hook` (the documented drop-in for DDP's
built-in all-reduce: same division, same in-place all-reduce of the bucket, no extra tensor) wrapped
to remember each bucket's flat buffer; the tracker is then handed those buffers with the model.

The same for DeepSpeed ZeRO-3: its reduce bucket (`ipg_buckets[dtype].buffer`, reduce_bucket_size
elements) is allocated when the optimizer is built and kept, but sits one object deeper than
the trial's `_tensors_held_by` looks (it reads the optimizer's attributes and their lists and
dicts, not the IPGBucket objects in them), so the tracker first met it at the backward's first
gradient. Here `_tensors_held_by` also returns the buffers of those buckets.

`setup` runs in every worker process before any plan (tests/gloo_harness.py `setup=`).
"""

from __future__ import annotations

from typing import Any


def setup() -> None:
    """Patch DDP construction (remember bucket buffers) and MemTracker.track_external (track them)."""
    import torch
    import torch.distributed._tools.mem_tracker as mem_tracker
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    original_init = DistributedDataParallel.__init__

    def init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        buckets: dict[int, torch.Tensor] = {}
        self._bench_buckets = buckets

        def remembering_allreduce(state, bucket):  # noqa: ANN001 - DDP's comm hook signature
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        self.register_comm_hook(None, remembering_allreduce)

    DistributedDataParallel.__init__ = init

    original_track = mem_tracker.MemTracker.track_external

    def track_external(self, *external):  # noqa: ANN001, ANN202 - MemTracker's signature
        extra = [t for obj in external if isinstance(obj, DistributedDataParallel)
                 for t in getattr(obj, "_bench_buckets", {}).values()]
        return original_track(self, *external, *extra)

    mem_tracker.MemTracker.track_external = track_external

    import paratune.trial as trial

    original_held = trial._tensors_held_by

    def tensors_held_by(obj: object) -> list[torch.Tensor]:
        found = original_held(obj)
        seen = {id(t) for t in found}
        for bucket in (getattr(obj, "ipg_buckets", None) or {}).values():
            buffer = getattr(bucket, "buffer", None)
            for t in buffer if isinstance(buffer, (list, tuple)) else [buffer]:
                if isinstance(t, torch.Tensor) and not t.is_meta and id(t) not in seen:
                    found.append(t)
                    seen.add(id(t))
        return found

    trial._tensors_held_by = tensors_held_by
