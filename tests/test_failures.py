"""Classifying failures, however deeply Ray wrapped them."""

import pytest
from ray.train import ControllerError, WorkerGroupError

from paratune.trial.failures import classify, classify_text
from paratune.config.plan import PlanError


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 281474976710656 bytes", "oom"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", "worker_died"),
    ("torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation timeout", "comm_timeout"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", "worker_died"),
    ("ValueError: something else", "error"),
    ("WorkerGroupStartupTimeoutError: The worker group startup timed out after 60.0 seconds waiting for 2 "
     "workers. Potential causes include: (1) temporary insufficient cluster resources", "insufficient_resources"),
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


# --------------------------------------------------------------------------- GPU failures
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from ray.exceptions import ActorDiedError  # noqa: E402
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError  # noqa: E402

from paratune.trial.failures import _dead_actor_ids, _exception_chain, classify_dead_worker_log, dead_worker_logs

GPU_CORPUS = Path(__file__).parent / "data" / "gpu" / "failures"
DRIVER_TEXTS = sorted(GPU_CORPUS.glob("*.txt"))
WORKER_LOGS = sorted((GPU_CORPUS / "logs").glob("*.log"))
WATCHDOG = ("[PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1187, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
            "600014 milliseconds before timing out.")


def test_the_gpu_corpus_covers_every_reason_it_claims():
    reasons = {p.name.split("--")[0] for p in DRIVER_TEXTS}
    assert {"oom", "comm_timeout", "worker_died", "error"} <= reasons
    assert len(DRIVER_TEXTS) >= 12 and len(WORKER_LOGS) >= 4


@pytest.mark.parametrize("path", DRIVER_TEXTS, ids=lambda p: p.stem)
def test_gpu_failure_texts(path):
    assert classify_text(path.read_text()) == path.name.split("--")[0]


@pytest.mark.parametrize("path", WORKER_LOGS, ids=lambda p: p.stem)
def test_dead_worker_logs_say_why(path):
    expected = path.name.split("--")[0]
    found = classify_dead_worker_log(path.read_text())
    assert (found[0] if found else "none") == expected


@pytest.mark.parametrize("exc, reason", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"),
     "oom"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB."), "oom"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "oom"),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "oom"),
    (torch.distributed.DistBackendError(WATCHDOG), "comm_timeout"),
    (torch.distributed.DistBackendError("NCCL communicator was aborted on rank 3. "), "comm_timeout"),
    (torch.distributed.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3691, unhandled cuda error (run "
        "with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA function "
        "failed.\nLast error:\nCuda failure 2 'out of memory'"), "oom"),
])
def test_gpu_exception_types_raw_and_wrapped_by_ray(exc, reason):
    assert classify(exc)[0] == reason
    assert classify(WorkerGroupError("Training failed due to worker errors", {2: exc}))[0] == reason


def _dead_worker(actor_id: str = "7c3b2f9a1d4e5f60718293a4b5c6d7e801000000") -> WorkerGroupError:
    """A worker whose process died, as Ray Train v2 reports it (health check -> ActorDiedError)."""
    died = ActorDiedError()
    died.actor_id = actor_id
    health = WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: Worker(...)", failure=died)
    return WorkerGroupError("[Rank 3]\nA worker health check failed.", {3: health})


def test_a_worker_torn_down_by_the_nccl_watchdog_is_a_comm_timeout():
    teardown = (GPU_CORPUS / "logs" / "comm_timeout--watchdog-teardown.log").read_text()
    reason, message = classify(_dead_worker(), worker_logs=teardown)
    assert reason == "comm_timeout" and "Watchdog caught collective operation timeout" in message
    # The same death with a log that proves nothing (SIGKILL, a crash) stays a dead worker.
    silent = (GPU_CORPUS / "logs" / "none--killed-without-a-word.log").read_text()
    assert classify(_dead_worker(), worker_logs=silent)[0] == "worker_died"
    assert classify(_dead_worker(), worker_logs="")[0] == "worker_died"
    oom = (GPU_CORPUS / "logs" / "oom--uncaught-cuda-oom.log").read_text()
    assert classify(_dead_worker(), worker_logs=oom)[0] == "oom"


def test_the_survivors_timeouts_do_not_hide_a_dead_peer():
    """Rank 3 died (no word in its log); rank 0's collective then timed out: the death is the cause."""
    dead = _dead_worker()
    both = WorkerGroupError("x", {0: torch.distributed.DistBackendError(WATCHDOG), **dead.worker_failures})
    assert classify(both, worker_logs="")[0] == "worker_died"


def test_dead_actor_ids_are_found_in_every_layer():
    exc = _dead_worker("0123456789abcdef0123456789abcdef01000000")
    assert any(isinstance(e, ActorDiedError) for e in _exception_chain(exc))  # through health_check_failure
    assert _dead_actor_ids(_exception_chain(exc)) == ["0123456789abcdef0123456789abcdef01000000"]
    text = (GPU_CORPUS / "worker_died--ray-dead-actor.txt").read_text()
    assert _dead_actor_ids([RuntimeError(text)]) == ["7c3b2f9a1d4e5f60718293a4b5c6d7e801000000"]


def test_dead_worker_logs_need_a_running_ray_with_a_dashboard(monkeypatch):
    """No dead actor named, no Ray in this process, or a Ray without a dashboard: no logs to read.
    Both Ray states are set here: whether this process runs Ray depends on the modules that ran
    before in it (the tests' in-process Ray starts with the first module that needs it)."""
    import ray
    import ray._private.worker

    assert dead_worker_logs(RuntimeError("no actor in here")) == ""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert dead_worker_logs(_dead_worker()) == ""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray._private.worker, "get_dashboard_url", lambda: "")
    assert dead_worker_logs(_dead_worker()) == ""


def test_an_nccl_system_error_is_the_environments_not_the_plans():
    """ncclSystemError (a /dev/shm too small for NCCL's shared-memory transport, a failed socket
    call) says nothing about the plan: its own reason, one of the cluster's (never scored, measured
    again on --resume), with what to do about it; a dead peer's survivors do not hide it."""
    from paratune.trial.failures import CLUSTER_REASONS, ENVIRONMENT_HINT

    text = (GPU_CORPUS / "environment--nccl-system-error-dev-shm.txt").read_text()
    reason, message = classify(WorkerGroupError("Training failed", {1: torch.distributed.DistBackendError(text)}))
    assert reason == "environment" and "environment" in CLUSTER_REASONS
    assert "failed to extend /dev/shm" in message and ENVIRONMENT_HINT in message
    survivors = WorkerGroupError("x", {0: torch.distributed.DistBackendError(WATCHDOG),
                                       1: torch.distributed.DistBackendError(text)})
    assert classify(survivors)[0] == "environment"
    shm_log = (GPU_CORPUS / "logs" / "environment--nccl-shm-warn.log").read_text()
    reason, message = classify(_dead_worker(), worker_logs=shm_log)
    assert reason == "environment" and "/dev/shm" in message
    # A network failure of a remote peer is still a communication failure.
    remote = (GPU_CORPUS / "comm_timeout--nccl-remote-error.txt").read_text()
    assert classify_text(remote) == "comm_timeout"


def test_a_failure_explained_for_the_console_is_whole_and_plain():
    """What a sweep prints when its profile (or anything run in a Ray actor) fails: the cause
    itself, whole, with no terminal codes (Ray colours its task traceback) and none of Ray's
    generic wrapper text."""
    from ray.exceptions import RayTaskError

    from paratune.trial.failures import explain
    from paratune.cluster.session import RequestFailed

    cause = ("RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn\n"
             "  (the embedding of a LoRA plan is frozen)")
    wrapped = RayTaskError("PoolActor.run", "Traceback (most recent call last):\n  \x1b[36mray::PoolActor.run()"
                           "\x1b[39m (pid=1, ip=127.0.0.1)\n  File \".../pool.py\", line 2", RequestFailed("error", cause))
    text = explain(wrapped)
    assert "\x1b" not in text and text == f"RequestFailed: {cause}"
    assert explain(ValueError("\x1b[31mred\x1b[0m")) == "ValueError: red"
