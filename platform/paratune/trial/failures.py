"""Failures are data: classify an exception into a reason the sweep can learn from.

Reasons: oom | comm_timeout | hang | worker_died | invalid_config | error, and four that are
the cluster's doing, not the plan's: node_lost (a node hosting the trial died), insufficient_resources
(the cluster cannot hold the trial, or gave it no room in time), invalid_placement (ranks were
placed where the plan cannot keep its node-local groups: paratune.trial.placement), environment (the
node's environment failed a system call NCCL made: ncclSystemError, most often a /dev/shm too
small for NCCL's shared-memory transport in a container). Ray wraps what the
workers raised (WorkerGroupError.worker_failures, ControllerError.controller_failure, RayTaskError
causes, WorkerHealthCheckFailedError.health_check_failure), so the classifier looks through every
layer before deciding.

On GPUs a collective timeout can kill its process instead of raising: with Ray Train's default
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown; torch's own default 3, SkipCleanUp, does the same)
ProcessGroupNCCL's watchdog rethrows the timeout on its own thread, std::terminate aborts the
process (SIGABRT), and the driver only sees a dead actor ("Worker unexpectedly exits with a
connection error code 2"). GPU workers should get TORCH_NCCL_ASYNC_ERROR_HANDLING=2
(CleanUpOnly: abort the communicators, keep the process, the next collective raises
DistBackendError); where a worker died anyway, its own log says why, and `classify` reads it
(`dead_worker_logs`): the watchdog's last words make the reason comm_timeout, an OOM's oom.
"""

from __future__ import annotations

import re
import threading
from typing import Literal

Reason = Literal["oom", "comm_timeout", "hang", "worker_died", "invalid_config", "error", "node_lost",
                 "insufficient_resources", "invalid_placement", "environment", "diverged"]
REASONS: tuple[str, ...] = ("oom", "comm_timeout", "hang", "worker_died", "invalid_config", "error", "node_lost",
                            "insufficient_resources", "invalid_placement", "environment", "diverged")
# Outcomes that say nothing about the plan: a sweep records them but never scores them (the
# searcher does not learn the plan is bad) and `--resume` measures the plan again (once the
# cluster or its environment is fixed).
CLUSTER_REASONS: frozenset[str] = frozenset({"node_lost", "insufficient_resources", "invalid_placement",
                                             "environment"})


class TrialTimeout(RuntimeError):
    """The trial ran past plan.trial_timeout_s: a hang (a collective or a worker stuck)."""


class Diverged(RuntimeError):
    """A step's loss was not finite (NaN or inf) on some rank: whatever its speed, the plan did
    not train, so it is a failed trial (reason `diverged`), never a winner."""


# NCCL could not make a system or external-library call (ncclSystemError; torch prints "unhandled
# system error"): the node's environment, not the plan. Its "Last error" names the call, e.g.
# shmutils.cc's "failed to extend /dev/shm/nccl-... to N bytes" when /dev/shm is full (Docker's
# 64 MB default), or a socket call on a wrong NCCL_SOCKET_IFNAME.
_NCCL_SYSTEM_ERROR = re.compile(r"ncclSystemError|unhandled system error|failed to extend /dev/shm|"
                                r"Error while creating shared memory segment", re.I)
ENVIRONMENT_HINT = ("the node's environment, not the plan: NCCL failed a system call; in containers the usual "
                    "cause is a small /dev/shm (docker run --shm-size=..., a memory-backed emptyDir on /dev/shm "
                    "in Kubernetes); run with NCCL_DEBUG=INFO for the failing call")

# Ray's words when an actor's node died (GCS: "The actor died because its node has died. Node Id: ...").
_NODE_DIED = re.compile(r"because its node has died|NodeDiedError|node (?:was )?marked dead", re.I)

_OOM = re.compile(
    r"out of memory|OutOfMemoryError|can't allocate memory|Cannot allocate memory|"
    r"MemoryError|std::bad_alloc|running low on memory|killed due to memory|"
    # cuBLAS/cuDNN/cuSOLVER/cuSPARSE handles and workspaces that could not be allocated: the
    # device is full even if the caching allocator did not say so (torch: "CUDA error:
    # CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "cuDNN error: ...").
    r"(?:CUBLAS|CUDNN|CUSOLVER|CUSPARSE)_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED", re.I)

# What a process torn down by ProcessGroupNCCL prints before it dies (torch 2.13,
# ProcessGroupNCCL.cpp / its heartbeat monitor): proof that the cause was a collective timeout
# or a stuck watchdog, not the death itself.
_WATCHDOG_TEARDOWN = re.compile(
    r"Watchdog caught collective operation timeout|"
    r"Process group watchdog thread terminated with exception|"
    r"To avoid data inconsistency, we are taking the entire process down|"
    r"ProcessGroupNCCL's watchdog got stuck|"
    r"Received a dump signal due to a collective timeout|"
    r"Terminating the process after attempting to dump debug info|"
    r"Timeout at NCCL work: \d+", re.I)

# Checked in this order: the most specific cause wins over its consequences (an OOM often kills
# the worker; a dead peer often surfaces as a timeout on the others, so a dead worker beats the
# survivors' timeouts; whether that worker itself died of a timeout, only its own log can say).
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("oom", _OOM),
    ("diverged", re.compile(r"Diverged: |loss not finite")),
    ("invalid_placement", re.compile(r"invalid_placement|PlacementError")),
    ("node_lost", _NODE_DIED),
    ("invalid_config", re.compile(r"PlanError|ModelError|DataError|invalid_config", re.I)),
    # Before worker_died and comm_timeout: the rank whose system call failed says why; its peers
    # then lose their connection or time out.
    ("environment", _NCCL_SYSTEM_ERROR),
    ("worker_died", re.compile(
        r"ActorDiedError|actor died|actor is dead|WorkerHealthCheckFailedError|WorkerCrash|"
        r"worker died|died unexpectedly|"
        r"SYSTEM_ERROR|exit code|SIGKILL|SIGSEGV|Connection reset by peer|Connection closed by peer|"
        r"ActorUnavailableError|node died|NodeDiedError", re.I)),
    # Not a communication problem: the cluster had no room for the workers in time.
    ("insufficient_resources", re.compile(r"WorkerGroupStartupTimeoutError|insufficient cluster resources|"
                                          r"insufficient_resources", re.I)),
    # A setup bug NCCL refuses (e.g. two ranks on one GPU), not a communication failure.
    ("error", re.compile(r"ncclInvalidUsage|ncclInvalidArgument", re.I)),
    # A collective that timed out (the watchdog's DistBackendError, the communicator it aborted:
    # "NCCL communicator was aborted on rank 3."), failed on the network (ncclRemoteError), or
    # that Ray Train's NCCL RAS hang detector gave up on (NCCLHangError).
    ("comm_timeout", _WATCHDOG_TEARDOWN),
    ("comm_timeout", re.compile(
        r"timed out|Timeout|timeout|watchdog|NCCLHangError|DistBackendError|communicator was aborted|"
        r"ncclRemoteError", re.I)),
]


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything Ray or Python wrapped inside it, outermost first."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        stack.extend(getattr(e, "worker_failures", {}).values())
        for attr in ("controller_failure", "health_check_failure", "cause", "__cause__", "__context__"):
            inner = getattr(e, attr, None)
            if isinstance(inner, BaseException):
                stack.append(inner)
    return seen


# Ray appends a list of possible causes ("killed by the OOM killer", ...) to every dead-worker
# message; those are guesses, not facts, and must not decide the reason.
_RAY_BOILERPLATE = re.compile(r"(?:Some common causes include|There are some potential root causes)[:.].*?(?=\n\S|$)",
                              re.S)


def classify_text(text: str) -> Reason:
    text = _RAY_BOILERPLATE.sub("", text)
    for reason, pattern in _PATTERNS:
        if pattern.search(text):
            return reason  # type: ignore[return-value]
    return "error"


def classify_dead_worker_log(log: str) -> tuple[Reason, str] | None:
    """Why a worker died, from the tail of its own stderr: (reason, the line that says so), or
    None when the log proves nothing. Only strong evidence counts (an OOM, the NCCL watchdog's
    teardown); a log is full of words like "timeout" that prove nothing."""
    for reason, pattern in (("oom", _OOM), ("environment", _NCCL_SYSTEM_ERROR), ("comm_timeout", _WATCHDOG_TEARDOWN)):
        for line in log.splitlines():
            if pattern.search(line):
                return reason, line.strip()[:500]  # type: ignore[return-value]
    return None


def _dead_actor_ids(chain: list[BaseException]) -> list[str]:
    """Actor ids of the dead workers in a failure (RayActorError.actor_id, or the `actor_id:` line
    of Ray's message)."""
    ids: list[str] = []
    for e in chain:
        found = [getattr(e, "actor_id", None)] if type(e).__name__ in ("ActorDiedError", "RayActorError") else []
        found += re.findall(r"actor_id: ([0-9a-f]{16,})", str(e))
        ids += [i for i in found if isinstance(i, str) and i and i not in ids]
    return ids


def dead_worker_logs(exc: BaseException, tail: int = 200, timeout_s: float = 15.0) -> str:
    """The stderr tails of the dead workers in a failure, from Ray's state API (the dashboard
    serves every node's logs); "" when Ray is not running, has no dashboard (a local test
    cluster), or nothing answers within `timeout_s`. Best effort: only ever adds evidence."""
    ids = _dead_actor_ids(_exception_chain(exc))
    if not ids:
        return ""
    try:
        import ray
        from ray._private.worker import get_dashboard_url

        if not ray.is_initialized() or not get_dashboard_url():
            return ""
    except Exception:  # noqa: BLE001
        return ""
    chunks: list[str] = []

    def fetch() -> None:
        from ray.util.state import get_log

        for actor_id in ids[:8]:
            try:
                chunks.append("".join(get_log(actor_id=actor_id, suffix="err", tail=tail,
                                              timeout=int(timeout_s), errors="replace")))
            except Exception:  # noqa: BLE001 - a log that cannot be read is no evidence
                continue

    worker = threading.Thread(target=fetch, name="paratune-dead-worker-logs", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return "\n".join(chunks)


def classify(exc: BaseException, worker_logs: str | None = None) -> tuple[Reason, str]:
    """(reason, message) for an exception raised by a trial, however deeply Ray wrapped it.

    A dead worker is only worker_died if its own log (`worker_logs`; fetched with
    `dead_worker_logs` when None) does not show the NCCL watchdog or an OOM taking it down."""
    from paratune.config.data import DataError
    from paratune.config.model_config import ModelError
    from paratune.config.plan import PlanError

    chain = _exception_chain(exc)
    for e in chain:
        if isinstance(e, TrialTimeout):
            return "hang", str(e)
        if isinstance(e, Diverged):
            return "diverged", str(e)
        if isinstance(e, (PlanError, ModelError, DataError)):
            return "invalid_config", f"{type(e).__name__}: {e}"
        if isinstance(e, (MemoryError,)) or type(e).__name__ == "OutOfMemoryError":
            return "oom", f"{type(e).__name__}: {e}"
    text = "\n".join(f"{type(e).__name__}: {e}" for e in chain)
    reason = classify_text(text)
    if reason == "worker_died":
        logs = dead_worker_logs(exc) if worker_logs is None else worker_logs
        found = classify_dead_worker_log(logs) if logs else None
        if found is not None:
            return found[0], f"worker died: {found[1]}" + (f" ({ENVIRONMENT_HINT})" if found[0] == "environment" else "")
    if reason == "environment":
        return reason, f"{_headline(chain, reason)} ({ENVIRONMENT_HINT})"[:700]
    return reason, _headline(chain, reason)


# Terminal colour and cursor codes (Ray colours its task tracebacks: "\x1b[36mray::PoolActor.run()\x1b[39m").
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def explain(exc: BaseException, limit: int = 2000) -> str:
    """A failure as a person should read it on a console or in a log: the innermost exception
    Ray or Python wrapped (`Type: message`, its whole message up to `limit` characters), without
    terminal codes or Ray's generic list of possible causes. (`classify` gives the one-line reason.)"""
    inner = _exception_chain(exc)[-1]
    text = _RAY_BOILERPLATE.sub("", _TERMINAL_CODES.sub("", str(inner))).strip()
    return f"{type(inner).__name__}: {text}"[:limit] if text else type(inner).__name__


def _headline(chain: list[BaseException], reason: str) -> str:
    """The innermost, most telling line of the failure (not Ray's generic wrapper)."""
    patterns = [p for r, p in _PATTERNS if r == reason]
    for e in reversed(chain):
        message = _RAY_BOILERPLATE.sub("", str(e)).strip()
        if not message:
            continue
        lines = [ln for ln in message.splitlines() if ln.strip()]
        for line in reversed(lines):
            if any(p.search(line) for p in patterns):
                return f"{type(e).__name__}: {line.strip()}"[:500]
        return f"{type(e).__name__}: {lines[-1].strip()}"[:500]
    return type(chain[0]).__name__
