"""Small helpers for tests that start servers and clusters as separate processes: a free port,
waiting for an HTTP endpoint, stopping a process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 90, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers (a 401 counts: the server is up, it wants the token); TimeoutError, or
    RuntimeError as soon as `proc` (the server) has exited."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError as err:
            if err.code == 401:
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        time.sleep(0.5)
    raise TimeoutError(url)


def stop_group(proc: subprocess.Popen, grace_s: float = 5) -> None:
    """SIGTERM the process group (`ray start --block` stops its node on it), SIGKILL what lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
