"""Predict before you spend: peak memory per GPU, communication per step and step time of a plan.

Memory follows docs/DESIGN.md ("Memory model"), per rank, in five parts:
- weights, gradients, optimizer states: bytes per parameter by strategy and precision, divided by
  the ranks that shard them (ZeRO/FSDP over dp; TP and PP split the model first);
- activations: what one micro-batch's forward saves for backward, plus the loss's logits buffers.
  By default measured *exactly* by tracing the model's forward on fake tensors with PyTorch's
  MemTracker (no memory, any size: a 1- and a 2-layer copy of the model give the per-layer and
  the rest), scaled by tokens and layers; `activation_model="formula"` uses the DESIGN.md
  formula instead (s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits; 2·s·b·h with recompute);
- communication buffers (DeepSpeed buckets, FSDP's gathered and reduce-scatter buffers).
The peak is taken at the start of the last micro-batch's backward: every activation is alive,
the logits gradient is being formed, and whatever gradients accumulate between micro-batches are
held (DDP's buckets always; FSDP2's unsharded gradients under no-sync accumulation).
Construction is checked apart (`construction_bytes`): the model is built in fp32 before any
optimizer exists, and a plan that cannot even be built is rejected like one that cannot train.

Where this differs from DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs_*`, checked in tests/test_estimate.py): DeepSpeed counts
fp16/bf16 weights and gradients (4P) plus 16P/N for the fp32 master, moments and fp32 gradient
partition (ZeRO-2; ZeRO-3 accumulates that partition in fp32 and has no 16-bit one). paratune
counts the same model states for ZeRO-2 in bf16 at the optimizer step (tested equal), and then:
(a) the fp32 copy of the gradient partition exists only at the step, not at the backward peak, so
the peak is the larger of the two moments; (b) in fp32 DeepSpeed still makes an fp32 copy of each
partition (seen in its flat groups), so the "master" is counted in fp32 too; (c) for ZeRO-3,
DeepSpeed's estimator holds one largest layer (params + grads, 4 bytes) in flight, while its
runtime keeps gathered parameters resident up to stage3_max_live_parameters (1e9 elements by
default): paratune counts that; (d) the reduce bucket, which DeepSpeed's estimator leaves out, is
counted at its configured size (the default 5e8 elements is 2 GB in fp32, even for a tiny model).

Time is a roofline: compute = model FLOPs (x4/3 with full recompute) over the device's dense
peak; communication = ring-collective bytes over the slowest link the group spans; the DP part
overlaps with backward, TP's does not; PP adds its bubble. Three constants (compute efficiency,
communication efficiency, a fixed per-step overhead) are fitted from measured trials
(`fit_time_constants`); until then DESIGN.md's reference MFU (~40%) and 70% of link bandwidth.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Literal

from paratune.plan import Plan

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2}
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default
ActivationModel = Literal["trace", "formula"]


# --------------------------------------------------------------------------- devices
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
    gpu: str | None = None  # the GPU model (paratune.measure.GPU_PEAK_TFLOPS key): how `auto` finds it

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


DEVICE_FIELDS = ("memory_gib", "tflops", "intra_node_gbps", "inter_node_gbps", "gpus_per_node", "host_link_gbps", "gpu")
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
                         f"optional: gpus_per_node, host_link_gbps, gpu)")
    for field_name in ("memory_gib", "intra_node_gbps", "inter_node_gbps", "host_link_gbps"):
        if field_name in merged and not _positive_number(merged[field_name]):
            raise ValueError(f"{where}: {field_name}: got {merged[field_name]!r}; allowed: a number > 0")
    tflops = merged["tflops"]
    if (not isinstance(tflops, dict) or not tflops
            or any(not isinstance(k, str) or not _positive_number(v) for k, v in tflops.items())):
        raise ValueError(f"{where}: tflops: got {tflops!r}; allowed: a mapping of precision to dense peak "
                         f"TFLOP/s > 0, e.g. {{bf16: 989, fp32: 67}}")
    if not set(tflops) & set(BYTES):
        raise ValueError(f"{where}: tflops: got {tflops!r}; it must give a peak for at least one of "
                         f"{', '.join(BYTES)} (the precisions a plan trains in)")
    gpus = merged.get("gpus_per_node", 8)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"{where}: gpus_per_node: got {gpus!r}; allowed: a whole number >= 1")
    gpu = merged.get("gpu")
    if gpu is not None:
        from paratune.measure import GPU_PEAK_TFLOPS

        if gpu not in GPU_PEAK_TFLOPS:
            raise ValueError(f"{where}: gpu: got {gpu!r}; allowed: {', '.join(sorted(GPU_PEAK_TFLOPS))} "
                             "(or leave it out: the entry is then found by name only)")
    return Device(name=name, memory_gib=float(merged["memory_gib"]), tflops={k: float(v) for k, v in tflops.items()},
                  intra_node_gbps=float(merged["intra_node_gbps"]), inter_node_gbps=float(merged["inter_node_gbps"]),
                  gpus_per_node=gpus, host_link_gbps=float(merged.get("host_link_gbps", 25.0)), gpu=gpu)


def load_devices(extra: str | Path | None = None) -> dict[str, Device]:
    """The shipped device table (presets/devices.json), extended or overridden by a user file
    (JSON or YAML: device name -> fields, as README's `--devices my_gpus.yaml`). A user entry with
    a shipped name overrides the fields it gives; a new name needs memory_gib, tflops and the two
    link bandwidths."""
    text = resources.files("paratune").joinpath("presets/devices.json").read_text()
    shipped = {k: v for k, v in json.loads(text).items() if not k.startswith("_")}
    devices = {name: _device_from_spec(name, spec, "presets/devices.json") for name, spec in shipped.items()}
    if extra is not None:
        from paratune.plan import read_yaml_mapping

        path = Path(extra)
        for name, spec in read_yaml_mapping(path, "device table", ValueError).items():
            if str(name).startswith("_"):  # comments, as in the shipped table
                continue
            devices[str(name)] = _device_from_spec(str(name), spec, str(path), shipped.get(str(name)))
    return devices


def get_device(name: str, extra: str | Path | None = None) -> Device:
    devices = load_devices(extra)
    if name not in devices:
        raise ValueError(f"device: got '{name}'; allowed: {', '.join(sorted(devices))} (or add it with --devices FILE)")
    return devices[name]


# --------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by place (exact, from the real architecture) and the sizes the model uses."""

    total: int
    embedding: int
    head: int  # untied LM head (0 when tied)
    layer: int  # one decoder block
    rest: int  # final norm and anything else outside the blocks
    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    compute: int  # N in 6N
    largest_leaf: int = 0  # parameters of the largest module that owns them directly (its own, not its children's)
    kv_heads: int = 0  # key/value heads (GQA); 0 = heads


@lru_cache(maxsize=64)
def _largest_leaf(key: str) -> int:
    """Parameters of the largest module that holds parameters itself (nn.Linear, nn.Embedding, a
    norm): what DeepSpeed's zero.Init builds whole before partitioning it. Counted on the meta
    device, on a one-block copy (blocks repeat), else on the whole model."""
    import torch
    from transformers import AutoModelForCausalLM

    from paratune.models import config_from_key

    def largest(config) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())

    try:
        return largest(config_from_key(key, num_hidden_layers=1))
    except Exception:  # noqa: BLE001 - a config that cannot shrink to one block (per-layer lists)
        return largest(config_from_key(key))


@lru_cache(maxsize=64)
def _shape_from_key(key: str) -> ModelShape:
    from paratune.models import config_from_key, parameter_counts, parameter_layout

    config = config_from_key(key)
    layout, heads = parameter_layout(config), config.num_attention_heads
    return ModelShape(
        total=layout["total"], embedding=layout["embedding"], head=layout["head"], layer=layout["layer"],
        rest=layout["total"] - layout["embedding"] - layout["head"] - layout["layer"] * layout["layers"],
        layers=layout["layers"], hidden=config.hidden_size, vocab=config.vocab_size, heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        compute=parameter_counts(config)["compute"], largest_leaf=_largest_leaf(key),
        kv_heads=getattr(config, "num_key_value_heads", None) or heads)


def model_shape(plan: Plan) -> ModelShape:
    from paratune.models import build_config, config_key

    return _shape_from_key(config_key(build_config(plan.model, plan.model_overrides)))


# --------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationCoefficients:
    """What one micro-batch's forward saves for backward: bytes per token, per decoder block and
    for the rest, and bytes that do not grow with tokens (autocast's low-precision weight copies,
    saved for backward when the parameters themselves are fp32, as under DDP)."""

    per_layer: float
    rest: float
    method: str
    per_layer_fixed: float = 0.0
    rest_fixed: float = 0.0


@lru_cache(maxsize=64)
def _traced_coefficients(config_json: str, checkpointing: str, precision: str) -> ActivationCoefficients:
    """Trace the forward of a 1- and a 2-layer copy of the model, at 64 and 128 tokens, on fake
    tensors (no memory) with PyTorch's MemTracker: their differences give one block's and the
    rest's bytes per token and the parts that do not grow with tokens. Linear in tokens (SDPA
    keeps no s x s matrix)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from paratune.materialize import attn_implementation
    from paratune.models import config_from_key
    from paratune.parallel import enable_full_recompute

    saved: dict[tuple[int, int], float] = {}
    for layers in (1, 2):
        config = config_from_key(config_json, num_hidden_layers=layers)
        for tokens in (64, 128):
            with FakeTensorMode():
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config))
                model.train()
                if checkpointing == "full":
                    enable_full_recompute(model)
                ids = torch.randint(0, config.vocab_size, (1, tokens))
                tracker = MemTracker()
                tracker.track_external(model)
                with tracker:
                    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                                else torch.autocast("cpu", enabled=False))
                    with autocast:
                        loss = model(input_ids=ids, labels=ids).loss  # held: its graph is what is saved
                    snapshot = tracker.get_tracker_snapshot("current")
                    del loss
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            saved[(layers, tokens)] = sum(v.get("Total", 0) for v in snapshot.values()) - params
    layer_64, layer_128 = saved[(2, 64)] - saved[(1, 64)], saved[(2, 128)] - saved[(1, 128)]
    rest_64, rest_128 = saved[(1, 64)] - layer_64, saved[(1, 128)] - layer_128
    per_layer, rest = (layer_128 - layer_64) / 64, (rest_128 - rest_64) / 64
    return ActivationCoefficients(per_layer=per_layer, rest=rest, method="traced (fake tensors, MemTracker)",
                                  per_layer_fixed=max(0.0, layer_64 - 64 * per_layer),
                                  rest_fixed=max(0.0, rest_64 - 64 * rest))


def _formula_coefficients(shape: ModelShape, checkpointing: str, precision: str, seq_len: int) -> ActivationCoefficients:
    """DESIGN.md: s·b·h·(34 + 5·a·s/h) bytes per layer at 16 bits (x2 in fp32); 2·s·b·h with
    full recompute; the rest is the logits (tokens x vocab) in fp32."""
    scale = BYTES[precision] / 2
    h, a = shape.hidden, shape.heads
    per_layer = (2 * h if checkpointing == "full" else h * (34 + 5 * a * seq_len / h)) * scale
    return ActivationCoefficients(per_layer=per_layer, rest=4.0 * shape.vocab + 2 * h * scale, method="formula (DESIGN.md)")


def activation_coefficients(plan: Plan, model: ActivationModel = "trace") -> ActivationCoefficients:
    shape = model_shape(plan)
    if model == "trace":
        from paratune.models import build_config, config_key

        try:
            return _traced_coefficients(config_key(build_config(plan.model, plan.model_overrides)),
                                        plan.activation_checkpointing, plan.precision)
        except Exception:  # noqa: BLE001 - a model the fake-tensor trace cannot follow
            pass
    return _formula_coefficients(shape, plan.activation_checkpointing, plan.precision, plan.seq_len)


# --------------------------------------------------------------------------- memory
@dataclass
class MemoryEstimate:
    """Predicted peak bytes per rank, by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    method: str = ""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers}

    def overflow(self, capacity_bytes: float) -> str | None:
        """None if it fits; else the reason, naming the part that overflows."""
        if self.total <= capacity_bytes:
            return None
        parts = self.parts()
        big = max(parts, key=parts.get)
        states = self.weights + self.gradients + self.optimizer
        if states > capacity_bytes:
            what = f"weights+grads+optimizer {states / GiB:.1f} GiB alone"
        else:
            what = f"{big} {parts[big] / GiB:.1f} GiB is the largest part"
        return f"predicted {self.total / GiB:.1f} GiB > {capacity_bytes / GiB:.1f} GiB per GPU ({what})"


def _replicas(plan: Plan) -> int:
    """Ranks that hold the same model-parallel slice and share its gradients: dp, and cp with it
    (context-parallel ranks see parts of the same sequences, so they are data-parallel for the
    weights: FSDP2 shards over dp x cp, DDP all-reduces over it)."""
    return plan.dp_degree * plan.cp


def _local_params(plan: Plan, shape: ModelShape) -> tuple[float, float]:
    """(parameters this rank's model-parallel slice holds, of which in one decoder block).

    TP shards every block and the (vocab-parallel) embedding and head; norms are small and
    counted as sharded. PP gives a stage its layers; the heavier end stage (embedding on the
    first, norm and head on the last) sets the peak.

    ZeRO's tp is DeepSpeed's AutoTP: it splits the blocks' linear layers and the LM head, but
    keeps an untied input embedding whole on every rank (tied, both are vocab-split)."""
    t, p = plan.tp, plan.pp
    layers_here = math.ceil(shape.layers / p)
    if plan.strategy == "zero" and t > 1:
        whole = shape.embedding + shape.rest if shape.head else 0.0
        return (layers_here * shape.layer + shape.head + (0 if shape.head else shape.embedding)) / t + whole, \
            shape.layer / t
    if p > 1:
        ends = max(shape.embedding, shape.head + shape.rest if shape.head else shape.embedding + shape.rest)
    else:
        ends = shape.embedding + shape.head + shape.rest
    return (layers_here * shape.layer + ends) / t, shape.layer / t


@dataclass
class ModelStates:
    """Bytes per rank of the model's state. `step_gradients`: gradient bytes that exist only at
    the optimizer step (DeepSpeed's fp32 copy of the gradient partition)."""

    weights: float
    gradients: float
    optimizer: float
    buffers: float
    step_gradients: float = 0.0


def model_states(plan: Plan, shape: ModelShape | None = None) -> ModelStates:
    """Weights, gradients, optimizer states and communication buffers per rank, by strategy.

    At the start of the last micro-batch's backward (the activation peak): gradients are those
    that accumulate between micro-batches; at the optimizer step add `step_gradients`."""
    shape = shape or model_shape(plan)
    local, layer = _local_params(plan, shape)
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    if plan.strategy == "ddp":
        # Autocast keeps fp32 parameters; gradients live in DDP's buckets (views) all the time.
        unbucketed = plan.ddp is not None and not plan.ddp.gradient_as_bucket_view
        return ModelStates(4 * local, 4 * local, 8 * local, 4 * local if unbucketed else 0.0)
    if plan.strategy == "fsdp":
        f = plan.fsdp
        assert f is not None
        shard = _fsdp_shard_degree(plan)
        weights, optim = 4 * local / shard, 8 * local / shard  # fp32 shards and their moments
        root = (shape.embedding + shape.head + shape.rest) / plan.tp
        if shard > 1:
            if f.reshards_after_forward:
                weights += pb * (layer * (1 + f.prefetch) + root)  # gathered: blocks in flight + root
            else:
                weights += pb * local  # grad_op: everything stays gathered until backward
            # Reduce-scattered every micro-batch: only shards accumulate (fp32).
            grads, buffers = (4 * local / shard if ga > 1 else 0.0), 4 * layer  # + the block being reduced
            step = 4 * local / shard if ga == 1 else 0.0
        else:
            grads, buffers, step = 4 * local, 0.0, 0.0
        if f.cpu_offload:  # shards, their gradients and the optimizer live in host memory
            weights, optim, grads, step = weights - 4 * local / shard, 0.0, 0.0, 0.0
        return ModelStates(weights, grads, optim, buffers, step)
    z = plan.zero
    assert z is not None
    if z.stage == 3 and plan.tp > 1:  # ZeRO-3 partitions what AutoTP leaves whole over the tp ranks too
        local = shape.total / plan.tp
    stage, part = z.stage, dp if z.stage >= 1 else 1
    weights = pb * local / (dp if stage == 3 else 1)
    if stage == 3 and dp > 1:
        # Gathered parameters stay resident up to stage3_max_live_parameters (DeepSpeed's default
        # 1e9 elements) plus the module in use; DeepSpeed's estimator assumes only its largest layer.
        largest = max(layer, shape.embedding / plan.tp, shape.head / plan.tp)
        weights += pb * min(local, ZERO3_MAX_LIVE_PARAMETERS + largest)
    # An fp32 flat copy of each partition (the master; DeepSpeed makes it in fp32 too) + 2 moments.
    optim = (12 if stage >= 1 else 8) * local / part
    step = 0.0
    if stage == 3:
        grads = 4 * local / dp  # ZeRO-3 accumulates its gradient partition in fp32
    elif stage == 2:
        grads = pb * local / dp  # the averaged gradient partition (bucket by bucket in backward)
        step = 4 * local / dp  # + its fp32 copy for the optimizer step
    else:
        grads = pb * local if ga > 1 else 0.0  # whole gradients, reduced at the boundary
        step = 4 * local / part if stage == 1 else 0.0
    # The reduce bucket (ZeRO-2/3, with more than one rank) is allocated at its configured size
    # whatever the model's: the default 5e8 elements is 2 GB in fp32. Two with overlap_comm
    # (ZeRO-2). ZeRO-1 reduces at the boundary, after the backward peak.
    buffers = 0.0
    if stage >= 2 and dp > 1:
        buffers = pb * z.reduce_bucket_size * (2 if z.overlap_comm and stage == 2 else 1)
    if z.offload_optimizer:  # master weights, moments and the fp32 gradients live in host memory
        optim, step = 0.0, 0.0
    if z.offload_param and stage == 3:
        weights -= pb * local / dp
    return ModelStates(weights, grads, optim, buffers, step)


def _fsdp_shard_degree(plan: Plan) -> int:
    """Ranks that share one parameter's shards under FSDP (1 for no_shard)."""
    f = plan.fsdp
    assert f is not None
    dp = _replicas(plan)
    node_dp = plan.gpus_per_node // plan.tp if plan.gpus_per_node else dp  # the dp ranks of one node
    shard = {"full": dp, "grad_op": dp, "hybrid": f.shard_group_size or node_dp, "no_shard": 1}[f.sharding]
    return max(1, min(shard, dp))


def construction_bytes(plan: Plan, shape: ModelShape | None = None) -> float:
    """Device bytes per rank while the model is built, before the optimizer exists: the model is
    built on the meta device and each rank materializes in fp32 only what it holds.

    - ddp, fsdp no_shard, ZeRO 0-2: every rank holds the whole model (its tp/pp slice), 4 bytes
      a parameter (DeepSpeed's bf16 cast then happens in place, one tensor at a time);
    - fsdp full/grad_op/hybrid: its shard of that slice (values are made on the host, only the
      shard is kept on the device);
    - plus, without pipeline stages and with more than one rank, one module's full fp32 values
      on the device for a moment (ranks take turns computing modules and broadcast them);
    - ZeRO-3: under `deepspeed.zero.Init` each module's parameters are partitioned as soon as the
      module is built, in the dtype of the DeepSpeed config (bf16 with bf16 enabled), so: the
      partition (params/dp) in that dtype, plus the largest single module built whole on the
      device. Its tensors are created in fp32 and then cast (zero_wrapper_for_fp_tensor_constructor
      in deepspeed/runtime/zero/partition_parameters.py), so for a moment both copies exist:
      4 + 2 bytes a parameter in bf16, 4 in fp32. Under parameter offload the partitions go to
      the host (zero.Init's remote_device) and only that module is on the device.
    - ZeRO with tp (DeepSpeed's AutoTP): AutoTP shards inside `deepspeed.initialize`, after the
      model exists: at ZeRO 0-2 every rank first builds the whole model in fp32 (4 bytes x all
      parameters); at ZeRO-3 zero.Init partitions the whole model over every rank, and AutoTP
      gathers one module whole (fp32) at a time to cut its slice.
    """
    shape = shape or model_shape(plan)
    local, _ = _local_params(plan, shape)
    if plan.strategy == "zero" and plan.zero is not None and plan.zero.stage == 3:
        pb = BYTES[plan.precision]
        if plan.tp > 1:
            partition = 0.0 if plan.zero.offload_param else pb * shape.total / plan.num_workers
            return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf + 4 * shape.largest_leaf
        partition = 0.0 if plan.zero.offload_param else pb * local / plan.dp_degree
        return partition + (4 + (pb if pb != 4 else 0)) * shape.largest_leaf
    if plan.strategy == "zero" and plan.tp > 1:
        return 4 * shape.total + (4 * shape.largest_leaf if plan.num_workers > 1 else 0.0)
    # Without pipeline stages every rank fills every module, one module's fp32 values broadcast
    # at a time through the device (paratune.materialize.ModelInit.shared_values).
    exchange = 4 * shape.largest_leaf if plan.num_workers > 1 and plan.pp == 1 else 0.0
    if plan.strategy == "fsdp":
        return 4 * local / _fsdp_shard_degree(plan) + exchange
    return 4 * local + exchange


def activation_bytes(plan: Plan, model: ActivationModel = "trace", shape: ModelShape | None = None) -> tuple[float, str]:
    """Saved activations of the micro-batches a rank holds at once, plus the loss's logits gradient."""
    shape = shape or model_shape(plan)
    coeff = activation_coefficients(plan, model)
    tokens = plan.micro_batch * plan.seq_len // plan.cp  # a context-parallel rank holds its part of each sequence
    layers_here = math.ceil(shape.layers / plan.pp)
    in_flight = 1
    if plan.pp > 1:  # micro-batches whose activations a stage holds at once
        in_flight = plan.grad_accum if plan.pp_schedule == "gpipe" else min(plan.grad_accum, plan.pp)
    tp_share = 1.0 / plan.tp if plan.sequence_parallel or plan.tp == 1 else 0.5 + 0.5 / plan.tp
    acts = tokens * in_flight * (coeff.per_layer * layers_here * tp_share + coeff.rest)
    if plan.strategy == "ddp":  # fp32 parameters under autocast: its bf16 weight copies are saved
        acts += (coeff.per_layer_fixed * layers_here + coeff.rest_fixed) / plan.tp
    acts += 2 * tokens * shape.vocab * 4  # the loss's fp32 logits gradient at the start of backward
    return acts, coeff.method


def estimate_memory(plan: Plan, model: ActivationModel = "trace") -> MemoryEstimate:
    """Peak memory per rank: the larger of the backward peak (states + activations) and the
    optimizer step (states + the step's gradient copies)."""
    shape = model_shape(plan)
    states = model_states(plan, shape)
    acts, method = activation_bytes(plan, model, shape)
    if states.step_gradients > acts:
        return MemoryEstimate(states.weights, states.gradients + states.step_gradients, states.optimizer, 0.0,
                              states.buffers, method=f"{method}; peak at the optimizer step")
    return MemoryEstimate(states.weights, states.gradients, states.optimizer, acts, states.buffers, method=method)


# --------------------------------------------------------------------------- communication
@dataclass
class CommVolume:
    """Bytes one rank sends per optimizer step, by parallel dimension."""

    dp: float
    tp: float
    pp: float
    cp: float = 0.0

    @property
    def total(self) -> float:
        return self.dp + self.tp + self.pp + self.cp


def comm_volume(plan: Plan) -> CommVolume:
    """Ring-collective volume per rank (DESIGN.md "Communication model")."""
    shape = model_shape(plan)
    local, _ = _local_params(plan, shape)
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    ring = 2 * (dp - 1) / dp if dp > 1 else 0.0  # all-reduce; half of it for a reduce-scatter or all-gather
    if plan.strategy == "ddp" or (plan.strategy == "fsdp" and plan.fsdp and plan.fsdp.sharding == "no_shard"):
        dp_bytes = ring * 4 * local  # fp32 gradients, once per step (no_sync between micro-batches)
    elif plan.strategy == "fsdp":
        gathers = 2 if plan.fsdp and plan.fsdp.reshards_after_forward else 1
        dp_bytes = ring / 2 * ga * (gathers * pb * local + 4 * local)  # reduce-scatter every micro-batch
    else:
        stage = plan.zero.stage if plan.zero else 2
        if stage == 3:
            dp_bytes = ring / 2 * ga * (2 * pb * local + pb * local)
        elif stage == 2:
            dp_bytes = ring / 2 * (ga * pb * local + pb * local)  # reduce every micro-batch, one gather
        else:
            dp_bytes = ring * pb * local
    tokens = plan.micro_batch * plan.seq_len // plan.cp
    t = plan.tp
    tp_bytes = (4 * math.ceil(shape.layers / plan.pp) * 2 * (t - 1) / t * tokens * shape.hidden * pb * ga) if t > 1 else 0.0
    # Activations forward and their gradients back at each stage boundary; interleaving doubles them.
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    pp_bytes = 2 * v * tokens * shape.hidden * pb * ga if plan.pp > 1 else 0.0
    # Ring attention (torch's context_parallel): in forward each rank receives the other ranks' K and
    # V of every layer, (cp - 1)/cp of the sequence's; in backward K and V again and their
    # gradients, which torch's ring carries in fp32.
    cp_bytes = 0.0
    if plan.cp > 1:
        kv = 2 * plan.micro_batch * plan.seq_len * shape.kv_heads * shape.head_dim / t  # K and V elements
        cp_bytes = math.ceil(shape.layers / plan.pp) * ga * (plan.cp - 1) / plan.cp * kv * (2 * pb + 4)
    return CommVolume(dp_bytes, tp_bytes, pp_bytes, cp_bytes)


# --------------------------------------------------------------------------- time
@dataclass
class TimeConstants:
    """Achieved fraction of peak compute and of link bandwidth, and a fixed per-step cost."""

    compute_efficiency: float = 0.4
    comm_efficiency: float = 0.7
    overhead_s: float = 0.0
    # Fixed cost of each micro-batch (kernel launches, Python, the loss): why bigger micro-batches
    # run faster at the same compute.
    micro_batch_overhead_s: float = 0.005
    fitted_on: int = 0  # trials the constants were fitted on (0: defaults)


@dataclass
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble: float
    step_s: float
    tokens_per_s_per_gpu: float


def _time_terms(plan: Plan, device: Device) -> tuple[float, float, float, float]:
    """(ideal compute s, ideal DP comm s, ideal TP+PP comm s, pipeline bubble fraction)."""
    from paratune.measure import flops_per_token

    shape = model_shape(plan)
    flops = flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)
    flops *= plan.tokens_per_step / plan.num_workers
    if plan.activation_checkpointing == "full":
        flops *= 4 / 3  # one more forward
    peak = device.tflops.get(plan.precision, device.tflops.get("fp32", 1.0)) * 1e12
    compute = flops / peak
    vol = comm_volume(plan)
    per_node = plan.gpus_per_node or device.gpus_per_node
    dp_span = plan.num_workers > per_node  # the dp ring crosses nodes once dp x tp x pp does
    tp_span = plan.tp > per_node
    bw = lambda crosses: (device.inter_node_gbps if crosses else device.intra_node_gbps) * 1e9  # noqa: E731
    dp_s = vol.dp / bw(dp_span)
    mp_s = vol.tp / bw(tp_span) + vol.pp / bw(plan.num_workers > per_node)
    mp_s += vol.cp / bw(plan.tp * plan.cp > per_node)  # counted as exposed: the ring waits on its peers
    mp_s += _offload_bytes(plan, shape) / (device.host_link_gbps * 1e9)  # not overlapped either
    m = plan.grad_accum
    # Interleaving gives each rank v = 2 stages, which divides the fill/drain time by v (Megatron).
    v = 2 if plan.pp_schedule == "interleaved_1f1b" else 1
    bubble = (plan.pp - 1) / (v * m + plan.pp - 1) if plan.pp > 1 else 0.0
    return compute, dp_s, mp_s, bubble


def _offload_bytes(plan: Plan, shape: ModelShape) -> float:
    """Bytes a rank moves between host and device per step because of CPU offload."""
    local, _ = _local_params(plan, shape)
    dp, ga, pb = _replicas(plan), plan.grad_accum, BYTES[plan.precision]
    moved = 0.0
    if plan.strategy == "zero" and plan.zero is not None:
        if plan.zero.offload_optimizer:  # fp32 gradient partition down, updated parameters up
            moved += (4 + pb) * local / dp
        if plan.zero.offload_param and plan.zero.stage == 3:  # parameters up for forward and backward
            moved += 2 * ga * pb * local / dp
    elif plan.strategy == "fsdp" and plan.fsdp is not None and plan.fsdp.cpu_offload:
        moved += 2 * ga * 4 * local / dp + 4 * local / dp  # shards up per pass, gradients down
    return moved


def estimate_time(plan: Plan, device: Device, constants: TimeConstants | None = None) -> TimeEstimate:
    c = constants or TimeConstants()
    compute, dp_s, mp_s, bubble = _time_terms(plan, device)
    compute /= c.compute_efficiency
    comm = (dp_s + mp_s) / c.comm_efficiency
    # DP collectives overlap with backward (about two thirds of compute); TP/PP ones do not.
    exposed = max(0.0, dp_s / c.comm_efficiency - compute * 2 / 3) + mp_s / c.comm_efficiency
    step = compute / (1 - bubble) + exposed + c.overhead_s + c.micro_batch_overhead_s * plan.grad_accum
    return TimeEstimate(compute, comm, exposed, bubble, step, plan.tokens_per_step / step / plan.num_workers)


def fit_time_constants(samples: list[tuple[Plan, float]], device: Device) -> TimeConstants:
    """Least squares of measured step time on the model's terms:
    step ≈ a·compute + b·comm + c + d·micro-batches, all >= 0 (a = 1/compute efficiency,
    b = 1/comm efficiency). With few trials, fewer terms: a; then a, d; then all."""
    import numpy as np

    if not samples:
        return TimeConstants()
    rows, y = [], []
    for plan, measured in samples:
        compute, dp_s, mp_s, bubble = _time_terms(plan, device)
        rows.append([compute / (1 - bubble), dp_s + mp_s, 1.0, float(plan.grad_accum)])
        y.append(measured)
    X, Y = np.array(rows), np.array(y)
    n = len(samples)
    active = [0] if n < 2 else [0, 3] if n < 4 else [0, 1, 2, 3]
    coef = np.zeros(4)
    for _ in range(4):  # drop terms that come out negative (non-negative least squares, by hand)
        sol, *_ = np.linalg.lstsq(X[:, active], Y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [c for c, v in zip(active, sol) if v > 0] or [0]
    else:
        coef[0] = float(np.dot(X[:, 0], Y) / np.dot(X[:, 0], X[:, 0]))
    a, b, c, d = coef
    return TimeConstants(compute_efficiency=1 / a if a > 0 else 1.0, comm_efficiency=1 / b if b > 0 else 1e9,
                         overhead_s=float(c), micro_batch_overhead_s=float(d), fitted_on=n)


# --------------------------------------------------------------------------- together
@dataclass
class Estimate:
    plan: Plan
    memory: MemoryEstimate
    comm: CommVolume
    time: TimeEstimate
    capacity_bytes: float
    overflow: str | None = None
    construction: float = 0.0  # device bytes per rank while the model is built (construction_bytes)

    @property
    def fits(self) -> bool:
        return self.overflow is None

    def summary(self) -> dict[str, float]:
        """Flat numbers for MLflow and JSON."""
        return {"predicted_peak_memory_gib": self.memory.total / GiB,
                **{f"predicted_{k}_gib": v / GiB for k, v in self.memory.parts().items()},
                "predicted_construction_gib": self.construction / GiB,
                "predicted_comm_gb_per_step": self.comm.total / 1e9,
                "predicted_step_time_s": self.time.step_s,
                "predicted_tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu}


def estimate(plan: Plan, device: Device, constants: TimeConstants | None = None, capacity_gib: float | None = None,
             margin: float = 0.0, activation_model: ActivationModel = "trace") -> Estimate:
    """Memory, communication and time for one plan; `overflow` says why it would not fit in
    min(device memory, capacity_gib) x (1 + margin): at construction, in training, or both."""
    memory = estimate_memory(plan, activation_model)
    capacity = min(device.memory_bytes, capacity_gib * GiB if capacity_gib else math.inf)
    result = Estimate(plan, memory, comm_volume(plan), estimate_time(plan, device, constants), capacity,
                      construction=construction_bytes(plan))
    limit = capacity * (1 + margin)
    reasons = []
    if result.construction > limit:
        reasons.append(f"construction needs {result.construction / GiB:.1f} GiB per rank (building the model, "
                       f"before the optimizer) > capacity {limit / GiB:.1f} GiB per GPU")
    steady = memory.overflow(limit)
    if steady:
        reasons.append(steady)
    result.overflow = "; ".join(reasons) or None
    return result



def estimate_space(space, device: Device, capacity_gib: float | None = None, margin: float = 0.0,
                   constants: TimeConstants | None = None, activation_model: ActivationModel = "trace") -> list[Estimate]:
    """Every valid plan of a space (env choices aside: they change neither memory nor volume),
    those that fit first, fastest first; then those that do not, smallest first."""
    results = [estimate(c.plan, device, constants, capacity_gib, margin, activation_model) for c in space.candidates]
    return sorted(results, key=lambda e: (not e.fits, -e.time.tokens_per_s_per_gpu if e.fits else e.memory.total))


class Calibration:
    """Predictions for a sweep's plans, with the time model refitted on every measured trial.

    Memory is predicted from first principles (nothing to fit); step time uses constants fitted
    on the trials measured so far, so each trial's predicted time is an honest out-of-sample
    guess made before it ran."""

    def __init__(self, device: Device, capacity_gib: float | None, activation_model: ActivationModel = "trace"):
        self.device, self.capacity_gib, self.activation_model = device, capacity_gib, activation_model
        self.samples: list[tuple[Plan, float]] = []
        self.constants = TimeConstants()
        self.errors: list[dict[str, float]] = []

    def predict(self, plan: Plan, margin: float = 0.0) -> Estimate:
        return estimate(plan, self.device, self.constants, self.capacity_gib, margin, self.activation_model)

    def observe(self, plan: Plan, measured_peak_bytes: float | None, measured_step_s: float | None) -> dict[str, float]:
        """Record a measured trial: predicted beside measured, relative errors; then refit."""
        predicted = self.predict(plan)
        out = predicted.summary()
        out["time_constants_fitted_on"] = float(self.constants.fitted_on)
        if measured_peak_bytes:
            out["memory_prediction_error"] = predicted.memory.total / measured_peak_bytes - 1
        if measured_step_s:
            out["step_time_prediction_error"] = predicted.time.step_s / measured_step_s - 1
            self.samples.append((plan, measured_step_s))
            self.constants = fit_time_constants(self.samples, self.device)
        self.errors.append(out)
        return out

    def summary(self) -> dict[str, float]:
        """Median absolute relative errors so far, and the fitted constants."""
        import statistics

        out: dict[str, float] = {}
        for key in ("memory_prediction_error", "step_time_prediction_error"):
            values = [abs(e[key]) for e in self.errors if key in e]
            if values:
                out[f"{key}_median_abs"] = statistics.median(values)
        out.update(compute_efficiency=self.constants.compute_efficiency,
                   comm_efficiency=min(self.constants.comm_efficiency, 1e6), overhead_s=self.constants.overhead_s)
        return out


# Ray's accelerator types (ray/_private/accelerators/nvidia_gpu.py: the NVML name's first model
# token, so "NVIDIA A100-SXM4-40GB" and "NVIDIA A100 80GB PCIe" are both "A100", and "NVIDIA H100
# 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL" are all "H100"; "A100-40G"/"A100-80G" are labels
# users add by hand, ray/util/accelerators/accelerators.py) -> the GPU models they can stand for,
# and the memory (GB) when the type says it.
RAY_ACCELERATOR_TYPES: dict[str, tuple[tuple[str, ...], int | None]] = {
    "H100": (("h100-sxm", "h100-pcie", "h100-nvl"), None),
    "H200": (("h200", "h200-nvl"), None),
    "H800": (("h800", "h800-pcie"), None),
    "GH200": (("gh200",), None),
    "B200": (("b200",), None),
    "A100": (("a100",), None),
    "A100-40G": (("a100",), 40),
    "A100-80G": (("a100",), 80),
    "A800": (("a800",), None),
    "L40S": (("l40s",), None),
    "L40": (("l40",), None),
    "L4": (("l4",), None),
    "A10G": (("a10g",), None),
    "A10": (("a10",), None),
    "V100": (("v100-sxm2", "v100-pcie"), None),
    "V100S": (("v100s-pcie",), None),
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
    from paratune.measure import gpu_model

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
