"""What a device is: the device table, the GPU models' peaks, and one resolver of GPU names.

- GPU_PEAK_TFLOPS: dense peak per GPU model (the only table of GPU peaks: presets/devices.json's
  GPU entries name their model in `gpu` and take their peaks from here);
- `gpu_model`: a torch device name ("NVIDIA H100 80GB HBM3") -> its model, exactly or not at all;
  Ray's accelerator types ("H100") are the same model tokens (RAY_ACCELERATOR_TYPES);
- Device, `load_devices`, `get_device`: the table the cost model predicts with (presets/devices.json,
  extended by a user file), and `device_for_cluster`: the entry of the cluster's GPU (`auto`).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Callable

GiB = 2**30
PRECISIONS = ("fp32", "bf16")  # the precisions a plan trains in (shapes.BYTES' keys)


# Dense peak FLOP/s per GPU model (never the 2x structured-sparsity figures), keyed by the
# canonical model `gpu_model()` derives from a device name. Figures from NVIDIA's datasheets; where
# a datasheet gives only the sparsity figure, half of it. "fp32" is the non-tensor FP32 peak (torch
# keeps TF32 off for matmuls by default). A model without a "bf16" entry has no bf16 tensor cores.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": {"bf16": 989.0, "fp32": 67.0},  # H100 SXM5 datasheet: BF16 1,979* (sparse), FP32 67
    "h100-pcie": {"bf16": 756.0, "fp32": 51.0},  # H100 PCIe: BF16 1,513*, FP32 51
    "h100-nvl": {"bf16": 835.0, "fp32": 60.0},  # H100 NVL (94 GB): BF16 1,671*, FP32 60
    "h200": {"bf16": 989.0, "fp32": 67.0},  # H200 SXM: BF16 1,979*, FP32 67
    "h200-nvl": {"bf16": 835.0, "fp32": 60.0},  # H200 NVL: BF16 1,671*, FP32 60
    "h800": {"bf16": 989.0, "fp32": 67.0},  # H800 SXM5: as H100 SXM5 (NVLink and FP64 cut)
    "h800-pcie": {"bf16": 756.0, "fp32": 51.0},  # H800 PCIe: as H100 PCIe
    "gh200": {"bf16": 989.0, "fp32": 67.0},  # GH200 Grace Hopper: BF16 1,979*, FP32 67
    "b200": {"bf16": 2250.0, "fp32": 80.0},  # HGX B200: BF16 4.5 PFLOPS* per GPU
    "a100": {"bf16": 312.0, "fp32": 19.5},  # A100 40/80 GB, SXM and PCIe: BF16 312 (624*), FP32 19.5
    "a800": {"bf16": 312.0, "fp32": 19.5},  # A800: as A100 (NVLink cut)
    "l40s": {"bf16": 362.0, "fp32": 91.6},  # L40S: BF16 362.05 (733*), FP32 91.6
    "l40": {"bf16": 181.0, "fp32": 90.5},  # L40: BF16 181.05 (362.1*), FP32 90.5
    "l4": {"bf16": 121.0, "fp32": 30.3},  # L4: BF16 242*, FP32 30.3
    "a10": {"bf16": 125.0, "fp32": 31.2},  # A10: BF16 125 (250*), FP32 31.2
    "a10g": {"bf16": 70.0, "fp32": 31.2},  # A10G (AWS): no NVIDIA datasheet; the figure AWS users quote
    "mi300x": {"bf16": 1307.0, "fp32": 163.4},  # AMD Instinct MI300X: BF16 1,307.4 dense, FP32 (matrix) 163.4
    "v100-sxm2": {"fp32": 15.7},  # V100 SXM2: FP32 15.7; no bf16 tensor cores
    "v100-pcie": {"fp32": 14.0},  # V100 PCIe: FP32 14
    "v100s-pcie": {"fp32": 16.4},  # V100S PCIe: FP32 16.4
}

# Dense FP8 (E4M3/E5M2) tensor-core peak, TFLOP/s, of the GPU models that have FP8 (sm_89+: Ada,
# Hopper, Blackwell; AMD's CDNA3); a model absent here has none (A100, A10, V100). What the float8
# lever's converted matmuls run at in the roofline (paratune.costs.estimate). Kept apart from
# GPU_PEAK_TFLOPS, whose precisions are the ones a plan trains in (MFU is against bf16's).
GPU_FP8_TFLOPS: dict[str, float] = {
    "h100-sxm": 1979.0,  # H100 SXM5 datasheet: FP8 3,958* (sparse)
    "h100-pcie": 1513.0,  # H100 PCIe: FP8 3,026*
    "h100-nvl": 1671.0,  # H100 NVL: FP8 3,341*
    "h200": 1979.0,  # H200 SXM: FP8 3,958*
    "h200-nvl": 1671.0,  # H200 NVL: FP8 3,341*
    "h800": 1979.0,  # H800 SXM5: as H100 SXM5
    "h800-pcie": 1513.0,  # H800 PCIe: as H100 PCIe
    "gh200": 1979.0,  # GH200: FP8 3,958*
    "b200": 4500.0,  # HGX B200: FP8 9 PFLOPS* per GPU
    "l40s": 733.0,  # L40S: FP8 733 (1,466*)
    "l40": 362.0,  # L40: FP8 362 (724*)
    "l4": 242.0,  # L4: FP8 485*
    "mi300x": 2615.0,  # AMD Instinct MI300X: FP8 2,614.9 dense (5,229.8 with sparsity)
}

# How each model token of a device name resolves to a table key, by form factor: "sxm" (SXM or
# HBM3, as "NVIDIA H100 80GB HBM3" says), "pcie", "nvl", "" (the name says none), "*" (any:
# every form has the same peaks). A form not listed gives no model: never a guess.
_FORMS: dict[str, dict[str, str]] = {
    "H100": {"sxm": "h100-sxm", "pcie": "h100-pcie", "nvl": "h100-nvl"},
    "H200": {"": "h200", "sxm": "h200", "nvl": "h200-nvl"},
    "H800": {"": "h800", "sxm": "h800", "pcie": "h800-pcie"},
    "GH200": {"*": "gh200"},
    "B200": {"": "b200", "sxm": "b200"},
    "A100": {"*": "a100"},
    "A800": {"*": "a800"},
    "L40S": {"": "l40s"},
    "L40": {"": "l40"},
    "L4": {"": "l4"},
    "A10": {"": "a10"},
    "A10G": {"": "a10g"},
    "V100": {"sxm": "v100-sxm2", "pcie": "v100-pcie"},
    "V100S": {"pcie": "v100s-pcie"},
    "MI300X": {"*": "mi300x"},  # "AMD Instinct MI300X" (ROCm's torch names it so)
}
# Superchips whose name states CPU + GPU memory ("GH200 480GB"): the figure is not the GPU's.
_NAME_MEMORY_IS_NOT_GPU = {"GH200"}


@dataclass(frozen=True)
class GpuModel:
    """A GPU as the tables know it: `key` into GPU_PEAK_TFLOPS, and the memory (GB) the device
    name states (None when it does not: "NVIDIA H100 PCIe", "NVIDIA L40S")."""

    key: str
    memory_gb: int | None


def gpu_model(device_name: str) -> GpuModel | None:
    """The canonical model of a `torch.cuda.get_device_name()` string, or None when the name is
    not one the table knows exactly (a CPU, a MIG slice, a form factor not listed). Exact tokens,
    never substrings: "NVIDIA L40" is the L40, not the L4."""
    name = re.sub(r"^(NVIDIA\s+|AMD\s+Instinct\s+)?(Tesla\s+)?", "", device_name.strip())
    tokens = [t for t in re.split(r"[\s\-]+", name.upper()) if t]
    if not tokens or "MIG" in tokens:  # a MIG slice has a fraction of the SMs: no peak applies
        return None
    model, rest = tokens[0], tokens[1:]
    forms = _FORMS.get(model)
    if forms is None:
        return None
    if "PCIE" in rest:
        form = "pcie"
    elif "NVL" in rest:
        form = "nvl"
    elif any(t.startswith("SXM") or t.startswith("HBM") for t in rest):
        form = "sxm"
    else:
        form = ""
    key = forms.get(form, forms.get("*"))
    if key is None:
        return None
    memory = next((int(m.group(1)) for t in rest if (m := re.fullmatch(r"(\d+)GB?", t))), None)
    return GpuModel(key, None if model in _NAME_MEMORY_IS_NOT_GPU else memory)


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a device name at a precision, or None when unknown (a CPU, a name the
    table does not know exactly, a precision the device has no peak for)."""
    model = gpu_model(device_name)
    if model is None:
        return None
    peak = GPU_PEAK_TFLOPS[model.key].get(precision)
    return peak * 1e12 if peak is not None else None


# --------------------------------------------------------------------------- the device table
@dataclass(frozen=True)
class Device:
    """One accelerator (per-GPU figures). Links: the bandwidth one GPU gets in a ring collective."""

    name: str
    memory_gib: float
    tflops: dict[str, float]  # dense peak per precision
    intra_node_gbps: float  # GB/s per GPU inside a node (NVLink)
    inter_node_gbps: float  # GB/s per GPU across nodes (InfiniBand/EFA)
    gpus_per_node: int = 8
    host_link_gbps: float = 25.0  # GB/s between a GPU and host memory (PCIe): what offload pays
    gpu: str | None = None  # the GPU model (a GPU_PEAK_TFLOPS key): how `auto` finds it
    # GB/s of the GPU's own memory (HBM), where it differs from its model's datasheet figure
    # (paratune.costs.efficiency.HBM_GBPS): what memory-bound ops stream at. None: the model's.
    memory_gbps: float | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


DEVICE_FIELDS = ("memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps", "gpus_per_node", "host_link_gbps", "gpu",
                 "memory_gbps")
_REQUIRED_DEVICE_FIELDS = ("memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps")


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _device_from_spec(name: str, spec: object, source: str, base: dict | None = None) -> Device:
    """One device table entry, checked field by field: a wrong one is named with its value and
    what is allowed. An entry of a user file that names a shipped device overrides only the fields
    it gives (`base`: the shipped entry)."""
    where = f"{source}: device '{name}'"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: got {spec!r}; allowed: a mapping of fields ({', '.join(DEVICE_FIELDS)})")
    unknown = [k for k in spec if k not in DEVICE_FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (value {spec[unknown[0]]!r}); allowed fields: "
                         f"{', '.join(DEVICE_FIELDS)}")
    merged = {**(base or {}), **spec}
    missing = [k for k in _REQUIRED_DEVICE_FIELDS if k not in merged]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (required: {', '.join(_REQUIRED_DEVICE_FIELDS)}; "
                         f"optional: gpus_per_node, host_link_gbps, gpu, memory_gbps)")
    for field_name in ("memory_gib", "intra_node_gbps", "inter_node_gbps", "host_link_gbps", "memory_gbps"):
        if field_name in merged and not _positive_number(merged[field_name]):
            raise ValueError(f"{where}: {field_name}: got {merged[field_name]!r}; allowed: a number > 0")
    tflops = merged["tflops"]
    if (not isinstance(tflops, dict) or not tflops
            or any(not isinstance(k, str) or not _positive_number(v) for k, v in tflops.items())):
        raise ValueError(f"{where}: tflops: got {tflops!r}; allowed: a mapping of precision to dense peak "
                         f"TFLOP/s > 0, e.g. {{bf16: 989, fp32: 67}}")
    if not set(tflops) & set(PRECISIONS):
        raise ValueError(f"{where}: tflops: got {tflops!r}; it must give a peak for at least one of "
                         f"{', '.join(PRECISIONS)} (the precisions a plan trains in)")
    gpus = merged.get("gpus_per_node", 8)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"{where}: gpus_per_node: got {gpus!r}; allowed: a whole number >= 1")
    gpu = merged.get("gpu")
    if gpu is not None:
        if gpu not in GPU_PEAK_TFLOPS:
            raise ValueError(f"{where}: gpu: got {gpu!r}; allowed: {', '.join(sorted(GPU_PEAK_TFLOPS))} "
                             "(or leave it out: the entry is then found by name only)")
    return Device(name=name, memory_gib=float(merged["memory_gib"]), tflops={k: float(v) for k, v in tflops.items()},
                  intra_node_gbps=float(merged["intra_node_gbps"]), inter_node_gbps=float(merged["inter_node_gbps"]),
                  gpus_per_node=gpus, host_link_gbps=float(merged.get("host_link_gbps", 25.0)), gpu=gpu,
                  memory_gbps=float(merged["memory_gbps"]) if merged.get("memory_gbps") is not None else None)


def _with_gpu_peaks(spec: dict) -> dict:
    """A shipped entry of a GPU model takes its peaks from GPU_PEAK_TFLOPS (one table of peaks:
    presets/devices.json gives `tflops` only for what is no GPU model, the cpu)."""
    if isinstance(spec, dict) and "tflops" not in spec and spec.get("gpu") in GPU_PEAK_TFLOPS:
        fp8 = GPU_FP8_TFLOPS.get(spec["gpu"])
        return {**spec, "tflops": {**GPU_PEAK_TFLOPS[spec["gpu"]], **({"fp8": fp8} if fp8 else {})}}
    return spec


def has_fp8(device: "Device") -> bool:
    """Whether the device has FP8 tensor cores: its table entry gives an `fp8` peak."""
    return "fp8" in device.tflops


def load_devices(extra: str | Path | None = None) -> dict[str, Device]:
    """The shipped device table (presets/devices.json), extended or overridden by a user file
    (JSON or YAML: device name -> fields, as README's `--devices my_gpus.yaml`). A user entry with
    a shipped name overrides the fields it gives; a new name needs memory_gib, tflops and the two
    link bandwidths."""
    text = resources.files("paratune").joinpath("presets/devices.json").read_text()
    shipped = {k: _with_gpu_peaks(v) for k, v in json.loads(text).items() if not k.startswith("_")}
    devices = {name: _device_from_spec(name, spec, "presets/devices.json") for name, spec in shipped.items()}
    if extra is not None:
        from paratune.config.plan import read_yaml_mapping

        path = Path(extra)
        for name, spec in read_yaml_mapping(path, "device table", ValueError).items():
            if str(name).startswith("_"):  # comments, as in the shipped table
                continue
            devices[str(name)] = _device_from_spec(str(name), spec, str(path), shipped.get(str(name)))
    return devices


def get_device(name: str, extra: str | Path | None = None) -> Device:
    """One entry of the device table (and of `extra`, a user file); an unknown name is an error
    that lists the known ones."""
    devices = load_devices(extra)
    if name not in devices:
        raise ValueError(f"device: got '{name}'; allowed: {', '.join(sorted(devices))} (or add it with --devices FILE)")
    return devices[name]


# --------------------------------------------------------------------------- the cluster's device
# Ray's accelerator types (ray/_private/accelerators/nvidia_gpu.py: the NVML name's first model
# token, so "NVIDIA A100-SXM4-40GB" and "NVIDIA A100 80GB PCIe" are both "A100", and "NVIDIA H100
# 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL" are all "H100"; "A100-40G"/"A100-80G" are labels
# users add by hand, ray/util/accelerators/accelerators.py) -> the GPU models they can stand for,
# and the memory (GB) when the type says it: Ray's type is the model token `gpu_model` reads, so
# it stands for every form of that model in _FORMS (one name table for both).
RAY_ACCELERATOR_TYPES: dict[str, tuple[tuple[str, ...], int | None]] = {
    **{model: (tuple(dict.fromkeys(forms.values())), None) for model, forms in _FORMS.items()},
    "A100-40G": (("a100",), 40),
    "A100-80G": (("a100",), 80),
}


def devices_for_accelerator_type(accelerator_type: str, devices: dict[str, Device]) -> list[Device]:
    """Device-table entries a Ray accelerator type can be, in table order (exact type, never a
    prefix: "L40" is not "L4"). More than one: the type does not say (A100 40 or 80 GB)."""
    models, memory = RAY_ACCELERATOR_TYPES.get(accelerator_type, ((), None))
    return [d for d in devices.values()
            if d.gpu in models and (memory is None or round(d.memory_gib) == memory)]


def device_from_probe(device_name: str, total_memory_bytes: int, devices: dict[str, Device]) -> Device | None:
    """The table entry for a device as torch reports it (get_device_name, total_memory): its exact
    model, then the entry whose memory is nearest to what the device has (within 15%; the device
    reports a little less than its nominal size). The capacity is what the device reports, if less.
    None when the name or the memory matches no entry."""
    model = gpu_model(device_name)
    if model is None:
        return None
    total_gib = total_memory_bytes / GiB
    candidates = [d for d in devices.values() if d.gpu == model.key]
    if model.memory_gb is not None:  # the name says it ("A100-SXM4-40GB"): only that size
        candidates = [d for d in candidates if round(d.memory_gib) == model.memory_gb] or candidates
    if not candidates:
        return None
    best = min(candidates, key=lambda d: abs(d.memory_gib - total_gib))
    if abs(best.memory_gib - total_gib) > 0.15 * best.memory_gib:
        return None
    return replace(best, memory_gib=min(best.memory_gib, total_gib))


def probe_gpu(accelerator_type: str | None = None, timeout_s: float = 60.0) -> tuple[str, int] | None:
    """(torch.cuda.get_device_name(), total_memory in bytes) of one of the cluster's GPUs, asked by
    a one-GPU Ray task (on a node of `accelerator_type` when given); None when Ray is not running
    or no GPU answers within `timeout_s` (all busy)."""
    import ray

    if not ray.is_initialized():
        return None

    @ray.remote(num_gpus=1, num_cpus=0, max_retries=0)
    def ask() -> tuple[str, int]:
        import torch

        return torch.cuda.get_device_name(0), int(torch.cuda.get_device_properties(0).total_memory)

    options = {"accelerator_type": accelerator_type} if accelerator_type else {}
    ref = ask.options(**options).remote()
    try:
        name, total = ray.get(ref, timeout=timeout_s)
        return str(name), int(total)
    except Exception:  # noqa: BLE001 - no answer is an answer: fall back to the table
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001
            pass
        return None


def device_for_cluster(name: str, resources: dict[str, float], num_workers: int,
                       probe: Callable[[str | None], tuple[str, int] | None] | None = probe_gpu) -> Device:
    """`auto`: the cluster's GPU (Ray's accelerator_type resource) in the device table, or the CPU
    with host memory shared by the workers.

    Where Ray's type does not say which entry (plain "A100": 40 or 80 GB; "H100": SXM, PCIe or
    NVL), one GPU is asked (`probe`, a one-GPU Ray task). If it cannot answer, the entry with the
    least memory (then the first listed) is taken with a warning: predicting 80 GB on a 40 GB card
    would let plans through that cannot fit. A GPU the table does not know is an error that names
    it, never a silent CPU or a near match."""
    if name != "auto":
        return get_device(name)
    devices = load_devices()
    types = sorted(key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:"))
    has_gpus = resources.get("GPU", 0) > 0
    if not types and not has_gpus:
        cpu = devices["cpu"]
        host_gib = resources.get("memory", cpu.memory_gib * GiB * num_workers) / GiB
        return Device("cpu", host_gib / max(1, num_workers), cpu.tflops, cpu.intra_node_gbps, cpu.inter_node_gbps,
                      cpu.gpus_per_node)
    candidates: list[Device] = []
    for ray_type in types:
        candidates += [d for d in devices_for_accelerator_type(ray_type, devices) if d not in candidates]
    if len(candidates) == 1:
        return candidates[0]
    if has_gpus and probe is not None:
        answer = probe(types[0] if len(types) == 1 else None)
        if answer is not None:
            probed = device_from_probe(*answer, devices)
            if probed is not None:
                return probed
    if candidates:
        fallback = min(candidates, key=lambda d: d.memory_gib)
        warnings.warn(f"device: Ray reports accelerator_type {', '.join(types)}, which can be "
                      f"{', '.join(d.name for d in candidates)}, and no GPU answered the probe; predicting "
                      f"with {fallback.name} (the least memory). Set estimate.device (or --device) to be exact.",
                      stacklevel=2)
        return fallback
    raise ValueError(f"device: the cluster's GPUs (accelerator_type {', '.join(types) or 'not reported'}) are "
                     f"not in the device table; allowed: {', '.join(sorted(n for n in devices if n != 'cpu'))}, "
                     "or set estimate.device / add the GPU with --devices FILE")


def sync_device(device) -> None:
    """Wait for the device's queued work, so a clock read after it times the work (CUDA runs
    asynchronously; CPU ops are done when they return). Every timed step calls it: paratune's
    trial and training run and a user's loop alike."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def process_groups() -> list:
    """The process groups this rank belongs to, default first, in the order they were made (the
    same order on every rank: groups are made collectively). Read from c10d's registry behind
    feature detection; without it, the default group alone."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    registry = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if not isinstance(registry, dict):
        return [dist.group.WORLD]
    outsider = getattr(getattr(c10d, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return [group for group in registry if group is not None and group is not outsider]


def warm_up_process_groups(device) -> int:
    """Connect every process group of this rank and create the device's matmul handle before the
    first step, so neither lands in it: NCCL creates a group's communicator at its first collective
    (ProcessGroupNCCL's lazy init), cuBLAS its handle and workspace at the first matmul, and a
    compiled plan's `compile_s` is its first step's time beyond a measured one. One 1-element
    all-reduce per group, in creation order (NCCL's communicator set-up is itself a collective of
    the group's ranks); pipeline p2p pairs keep their lazy communicators. Returns the groups touched."""
    import torch
    import torch.distributed as dist

    groups = process_groups()
    probe = torch.zeros(1, device=device)
    for group in groups:
        dist.all_reduce(probe, group=group)
    square = torch.ones(16, 16, device=device)
    square @ square
    sync_device(device)
    return len(groups)
