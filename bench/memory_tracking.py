"""How bench/estimate_accuracy.py measures peak memory on CPU: the trial's own MemTracker step
(paratune.cluster.trial._tracked_peak_bytes), which sees the buffers DDP and DeepSpeed ZeRO-3 allocate
before the step.

This module used to patch that in for the bench (DDP's buckets through torch's `allreduce_hook`,
ZeRO-3's `ipg_buckets[dtype].buffer`); the trial now does both itself (paratune.parallel.ddp
`keep_bucket_buffers` on CPU memory-tracked trials, paratune.cluster.trial `_tensors_held_by`), so the
bench and every CPU trial measure the same way. `setup` stays as the hook the bench names
(tests/gloo_harness.py `setup=`) and patches nothing: registering DDP's comm hook twice fails.
"""

from __future__ import annotations


def setup() -> None:
    """Nothing to patch: the trial's measurement already sees DDP's and ZeRO-3's buckets."""
