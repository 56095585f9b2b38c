"""Describe the machine a benchmark ran on (committed next to every result)."""

from __future__ import annotations

import datetime
import os
import platform


def describe() -> dict[str, str]:
    import torch

    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, {platform.system()} {platform.machine()}",
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for pkg in ("ray", "deepspeed", "transformers"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:
            pass
    return info
