"""Failures are data: classify an exception into a reason the sweep can learn from.

Reasons: oom | comm_timeout | hang | worker_died | invalid_config | error. Ray wraps what the
workers raised (WorkerGroupError.worker_failures, ControllerError.controller_failure, RayTaskError
causes), so the classifier looks through every layer before deciding.
"""

from __future__ import annotations

import re
from typing import Literal

Reason = Literal["oom", "comm_timeout", "hang", "worker_died", "invalid_config", "error"]
REASONS: tuple[str, ...] = ("oom", "comm_timeout", "hang", "worker_died", "invalid_config", "error")

# Checked in this order: the most specific cause wins over its consequences (an OOM often kills
# the worker; a dead peer often surfaces as a timeout on the others).
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("oom", re.compile(
        r"out of memory|OutOfMemoryError|can't allocate memory|Cannot allocate memory|"
        r"MemoryError|std::bad_alloc|running low on memory|killed due to memory", re.I)),
    ("invalid_config", re.compile(r"PlanError|ModelError|DataError|invalid_config", re.I)),
    ("worker_died", re.compile(
        r"ActorDiedError|actor died|actor is dead|WorkerHealthCheckFailedError|WorkerCrash|"
        r"worker died|died unexpectedly|"
        r"SYSTEM_ERROR|exit code|SIGKILL|SIGSEGV|Connection reset by peer|Connection closed by peer|"
        r"ActorUnavailableError|node died|NodeDiedError", re.I)),
    # Not a communication problem: the cluster had no room for the workers in time.
    ("error", re.compile(r"WorkerGroupStartupTimeoutError|insufficient cluster resources", re.I)),
    ("comm_timeout", re.compile(
        r"timed out|Timeout|timeout|watchdog|NCCLHangError|DistBackendError.*time", re.I)),
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
        for attr in ("controller_failure", "cause", "__cause__", "__context__"):
            inner = getattr(e, attr, None)
            if isinstance(inner, BaseException):
                stack.append(inner)
    return seen


# Ray appends a list of possible causes ("killed by the OOM killer", ...) to every dead-worker
# message; those are guesses, not facts, and must not decide the reason.
_RAY_BOILERPLATE = re.compile(r"Some common causes include:.*?(?=\n\S|$)", re.S)


def classify_text(text: str) -> Reason:
    text = _RAY_BOILERPLATE.sub("", text)
    for reason, pattern in _PATTERNS:
        if pattern.search(text):
            return reason  # type: ignore[return-value]
    return "error"


def classify(exc: BaseException) -> tuple[Reason, str]:
    """(reason, message) for an exception raised by a trial, however deeply Ray wrapped it."""
    from paratune.data import DataError
    from paratune.models import ModelError
    from paratune.plan import PlanError

    chain = _exception_chain(exc)
    from paratune.trial import TrialTimeout

    for e in chain:
        if isinstance(e, TrialTimeout):
            return "hang", str(e)
        if isinstance(e, (PlanError, ModelError, DataError)):
            return "invalid_config", f"{type(e).__name__}: {e}"
        if isinstance(e, (MemoryError,)) or type(e).__name__ == "OutOfMemoryError":
            return "oom", f"{type(e).__name__}: {e}"
    text = "\n".join(f"{type(e).__name__}: {e}" for e in chain)
    reason = classify_text(text)
    return reason, _headline(chain, reason)


def _headline(chain: list[BaseException], reason: str) -> str:
    """The innermost, most telling line of the failure (not Ray's generic wrapper)."""
    for e in reversed(chain):
        message = str(e).strip()
        if not message:
            continue
        lines = [ln for ln in message.splitlines() if ln.strip()]
        pattern = dict(_PATTERNS).get(reason)
        for line in reversed(lines):
            if pattern is not None and pattern.search(line):
                return f"{type(e).__name__}: {line.strip()}"[:500]
        return f"{type(e).__name__}: {lines[-1].strip()}"[:500]
    return type(chain[0]).__name__
