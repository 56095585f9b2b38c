"""Classifying failures, however deeply Ray wrapped them."""

import pytest
from ray.train import ControllerError, WorkerGroupError

from paratune.failures import classify, classify_text
from paratune.plan import PlanError


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 281474976710656 bytes", "oom"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", "worker_died"),
    ("torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation timeout", "comm_timeout"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", "worker_died"),
    ("ValueError: something else", "error"),
    ("WorkerGroupStartupTimeoutError: The worker group startup timed out after 60.0 seconds waiting for 2 "
     "workers. Potential causes include: (1) temporary insufficient cluster resources", "error"),
])
def test_classify_text(text, reason):
    assert classify_text(text) == reason


def test_classify_looks_inside_worker_group_errors():
    inner = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 42 bytes")
    reason, message = classify(WorkerGroupError("Training failed due to worker errors", {1: inner}))
    assert reason == "oom" and "can't allocate memory" in message


def test_classify_controller_errors_and_invalid_plans():
    reason, _ = classify(ControllerError(RuntimeError("The actor died unexpectedly")))
    assert reason == "worker_died"
    reason, message = classify(WorkerGroupError("x", {0: PlanError("plan: micro_batch: got 0")}))
    assert reason == "invalid_config" and "micro_batch" in message


def test_ray_dead_worker_boilerplate_is_not_an_oom():
    text = ("WorkerHealthCheckFailedError: The actor is dead because its worker process has died. Worker exit "
            "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
            "End of file. Some common causes include: (1) the process was killed by the OOM killer due to high "
            "memory usage, (2) ray stop --force was called")
    assert classify_text(text) == "worker_died"
    assert classify_text("Task was killed due to the node running low on memory.") == "oom"
