"""Describe the machine a benchmark ran on (committed next to every result)."""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import os
import platform
import sys

# What a result depends on: the stack paratune runs on (a lent GPU machine's image has some of these
# only as carried wheels, and Ray, MLflow and Optuna not at all).
PACKAGES = ("torch", "transformers", "deepspeed", "pydantic", "accelerate", "peft", "safetensors", "numpy",
            "ray", "mlflow", "optuna")


def package_version(name: str) -> str:
    """The installed version of a package if it can be imported here, else why not. Read from its
    metadata, not by importing it (Ray alone takes seconds to import)."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses the name (the tests' image-shaped runs)
        found = False
    if not found:
        return "not importable"
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get(name) or __import__(name)
        return str(getattr(module, "__version__", "unknown version"))


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
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = str(torch.version.cuda)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - a build without NCCL says so
            info["nccl"] = f"unavailable ({type(err).__name__})"
    for pkg in PACKAGES[1:]:
        info[pkg] = package_version(pkg)
    return info


def versions_line(info: dict[str, str]) -> str:
    """'python 3.12.3, torch 2.11.0+cu130, cuda 13.0, nccl 2.27.7, transformers 5.17.0, ray not importable, ...'"""
    keys = ["python", "torch", "cuda", "nccl", *PACKAGES[1:]]
    return ", ".join(f"{k} {info[k]}" for k in keys if k in info)
