"""Build big models without holding them whole: meta device first, then only each rank's shards.

Every rank used to build the whole model in fp32 on its device before sharding it; Llama-3-70B is
~282 GB that way, so every plan of a 70B space died at construction. Instead a model is built on
the `meta` device (no memory), the plan is applied to it (FSDP2, tensor/pipeline parallel), and
only then does each rank allocate what it holds (`to_empty`) and fill it.

The values must not depend on the layout: a sharded rank must hold exactly the slice of what the
single-process reference holds. So each parameter's full value is computed on the host, one
module at a time, by the model family's own `_init_weights` (transformers) under a seed derived
from (seed, module name): independent of construction order, of the device (CPU generator) and
of the sharding. A rank copies only its own slice of that value to its device. Host memory holds
one module's parameters at a time; the device never holds more than the rank's shards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn


def module_seed(seed: int, module_name: str) -> int:
    """A seed for one module's initialization: stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _fill_sentinel(t: torch.Tensor) -> None:
    """NaN (the most negative integer for integer tensors): no family's init writes it."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _is_sentinel(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def constructor_values(module: nn.Module, slots: list[str], owner: str, config=None,
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The values a module's own constructor gives the slots its family's `_init_weights` leaves
    unwritten (xIELU's learned alpha_p / alpha_n and its beta / eps buffers, set in
    XIELUActivation.__init__, which transformers' init never touches): the class built on the host
    as the family builds it, with its defaults and, where its constructor takes them, the
    model's `config` and `dtype` (Apertus: `ACT2CLS["xielu"](dtype=config.dtype)`) and the
    arguments the module keeps under their own names (Conv1D's nf / nx, a mixer's layer_idx). A class that
    needs other arguments, or whose defaults give other shapes, is refused: paratune never trains
    from uninitialized memory."""
    import inspect

    from paratune.config.model_config import ModelError

    accepts = inspect.signature(type(module).__init__).parameters
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fresh, err = None, None
    for candidate in ([config, text] if text is not config else [config]):  # a multimodal text block: its text config
        kwargs = {k: v for k, v in (("config", candidate), ("dtype", dtype)) if k in accepts and v is not None}
        kwargs.update({k: getattr(module, k) for k, p in accepts.items() if k not in kwargs and k != "self"
                       and p.default is inspect.Parameter.empty and hasattr(module, k)})
        try:
            fresh = type(module)(**kwargs)
            break
        except Exception as error:  # noqa: BLE001 - a constructor that needs arguments
            err = error
    if fresh is None:
        raise ModelError(f"model: {owner} ({type(module).__name__}) has {', '.join(slots)} that neither its family's "
                         f"_init_weights nor a checkpoint sets, and its class cannot be built with its defaults "
                         f"({type(err).__name__}: {err}); allowed: a model folder whose weights hold them") from None
    out = {}
    for k in slots:
        value = getattr(fresh, k, None)
        target = getattr(module, k)
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            raise ModelError(f"model: {owner}.{k} ({type(module).__name__}) is set by neither its family's "
                             "_init_weights nor its class's defaults; allowed: a model folder whose weights hold it")
        out[k] = value.detach().to(target.dtype)
    return out


@dataclass(frozen=True)
class InitTarget:
    """One parameter or buffer slot of a module, and where its value comes from."""

    module: nn.Module  # the live module object (FSDP/TP keep the object, replace its tensors)
    attr: str
    kind: str  # "param" | "buffer"
    owner: str  # name of the module whose `_init_weights` defines the value (tied: the first owner)
    owner_attr: str  # the attribute of `owner` that holds the value


# Where a module's values may come from before its family's `_init_weights`: (owner name, the
# template's module on meta) -> {attribute: full host tensor} for the attributes it knows, or None.
# A pretrained checkpoint is one source (its tensors for the module's parameters), adapters another.
ValueSource = Callable[[str, nn.Module], "dict[str, torch.Tensor] | None"]


class ModelInit:
    """Remembers a meta-built model's slots so its values can be filled after any parallelization.

    Slots are keyed by module object and attribute name, not by parameter object: FSDP2 and TP
    replace parameters with DTensors, pipeline stages regroup modules, but module objects stay.
    """

    def __init__(self, model: nn.Module, config, seed: int, dtype: torch.dtype = torch.float32):
        self.config, self.seed, self.dtype = config, seed, dtype
        first_name: dict[int, str] = {}
        for name, param in model.named_parameters():  # tied parameters: the first name wins
            first_name.setdefault(id(param), name)
        self.targets: list[InitTarget] = []
        from transformers import PreTrainedModel

        for mod_name, module in model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                if param is not None:
                    owner, _, owner_attr = first_name[id(param)].rpartition(".")
                    self.targets.append(InitTarget(module, attr, "param", owner, owner_attr))
            for attr, buf in module._buffers.items():
                if buf is not None:
                    self.targets.append(InitTarget(module, attr, "buffer", mod_name, attr))
        pretrained = [n for n, m in model.named_modules() if isinstance(m, PreTrainedModel)]
        self._pretrained_names = sorted(pretrained, key=len, reverse=True)
        self._template: nn.Module | None = None
        self.meter: ConstructionMeter | None = None  # stopped once the model is materialized
        # Where ranks exchange module values (the compute device: NCCL needs GPU tensors); None:
        # every rank computes every value itself (no process group, e.g. the reference).
        self.comm_device: torch.device | None = None
        # Values tried in order before `_init_weights` (what no source gives, e.g. rotary buffers
        # absent from a checkpoint, still comes from the family's init).
        self.sources: list[ValueSource] = []
        # Applied to the host template after it is built, so it has the live model's structure
        # (modules the plan adds on the meta model, such as LoRA adapters, exist in both).
        self.template_hooks: list[Callable[[nn.Module], None]] = []

    # ---- values on the host ---------------------------------------------------------------
    def _template_model(self) -> nn.Module:
        if self._template is None:
            self._template = build_meta(self.config, self.dtype)
            for hook in self.template_hooks:
                hook(self._template)
        return self._template

    def _init_fn(self, owner: str):
        template = self._template_model()
        for name in self._pretrained_names:  # the nearest PreTrainedModel above the owner
            if name == "" or owner == name or owner.startswith(name + "."):
                return template.get_submodule(name)._init_weights
        return template._init_weights

    @torch.no_grad()
    def host_values(self, owner: str) -> dict[str, torch.Tensor]:
        """Full values of one module's own parameters and buffers, on the CPU, as the reference has
        them. Deterministic: a fresh CPU generator state seeded by (seed, module name)."""
        module = self._template_model().get_submodule(owner)
        slots = [k for k, v in [*module._parameters.items(), *module._buffers.items()] if v is not None]
        given: dict[str, torch.Tensor] = {}
        for source in self.sources:
            for k, v in (source(owner, module) or {}).items():
                given.setdefault(k, v)
        if all(k in given for k in slots):
            return {k: given[k].detach() for k in slots}
        module.to_empty(device="cpu", recurse=False)
        for k in slots:  # a sentinel shows what the family's init leaves unwritten (to_empty's memory is garbage)
            _fill_sentinel(getattr(module, k))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, owner))
            self._init_fn(owner)(module)
        values = {k: v for k, v in [*module._parameters.items(), *module._buffers.items()] if v is not None}
        unwritten = [k for k in slots if k not in given and _is_sentinel(values[k])]
        if unwritten:
            unwritten = self._ancestor_init(owner, module, unwritten)
        if unwritten:  # seeded as the init is: a constructor that draws (Conv1D's normal_) gives every process one value
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, owner))
                values.update(constructor_values(module, unwritten, owner, self.config, self.dtype))
        module.to_empty(device="meta", recurse=False)  # give the host memory back
        return {k: (given[k] if k in given else v).detach() for k, v in values.items()}

    def _ancestor_init(self, owner: str, module: nn.Module, unwritten: list[str]) -> list[str]:
        """The slots still unwritten after the enclosing modules' `_init_weights` ran, nearest first
        (Falcon-H1's model-level init writes every mixer's mup_vector): the ancestors stay on meta,
        so their own values cost nothing and only this module's host memory is written."""
        template = self._template_model()
        parts = owner.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            name = ".".join(parts[:depth])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, owner))
                try:
                    self._init_fn(name)(template.get_submodule(name))
                except Exception:  # noqa: BLE001 - an init that cannot run beside meta tensors: the next source
                    continue
            unwritten = [k for k in unwritten if _is_sentinel(getattr(module, k))]
            if not unwritten:
                break
        return unwritten

    def shared_values(self, owner: str, src: int) -> dict[str, torch.Tensor]:
        """`host_values(owner)` computed by rank `src` only and broadcast to every rank, on
        `comm_device` (the GPU under NCCL: one module's values on the device for a moment)."""
        import torch.distributed as dist

        module = self._template_model().get_submodule(owner)  # on meta: shapes and dtypes
        slots = {k: v for k, v in [*module._parameters.items(), *module._buffers.items()] if v is not None}
        if dist.get_rank() == src:
            host = self.host_values(owner)
            out = {k: host[k].to(self.comm_device) for k in slots}
        else:
            out = {k: torch.empty(v.shape, dtype=v.dtype, device=self.comm_device) for k, v in slots.items()}
        for k in slots:
            dist.broadcast(out[k], src)
        return out

    # ---- filling a materialized model ------------------------------------------------------
    def targets_by_owner(self, keep: set[int] | None = None) -> dict[str, list[InitTarget]]:
        """Slots grouped by the module whose values they take, in model order (the same order on
        every rank); `keep`: ids of the module objects to include (None = all)."""
        by_owner: dict[str, list[InitTarget]] = {}
        for target in self.targets:
            if keep is None or id(target.module) in keep:
                by_owner.setdefault(target.owner, []).append(target)
        return by_owner

    @torch.no_grad()
    def fill(self, modules: Iterable[nn.Module] | None = None) -> int:
        """Write every slot's value (this rank's slice of it) into the live, materialized model.

        `modules`: only slots of these module objects (a pipeline rank's stages); None = all.
        Returns the number of slots filled."""
        keep = None if modules is None else {id(m) for root in modules for m in root.modules()}
        by_owner = self.targets_by_owner(keep)
        filled = 0
        world = _world_size()
        # Every rank fills every module (no pipeline split): share the host work. Module i's value
        # is made by rank i % world and broadcast, so each rank computes 1/world of the model
        # (the same numbers whoever computes them: the generator is seeded by the module's name).
        shared = keep is None and world > 1 and self.comm_device is not None
        for i, (owner, targets) in enumerate(by_owner.items()):
            values = self.shared_values(owner, src=i % world) if shared else self.host_values(owner)
            for target in targets:
                slot = target.module._parameters if target.kind == "param" else target.module._buffers
                tensor = slot[target.attr]
                if tensor is None or tensor.is_meta:
                    raise RuntimeError(f"materialize: {owner}.{target.attr} is still on the meta device")
                value = values[target.owner_attr]
                rows = getattr(target.module, "_ep_rows", {}).get(target.attr)  # expert parallel: E / ep experts
                copy_local_slice(tensor, value if rows is None else value[rows])
                filled += 1
        return filled


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def copy_local_slice(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (a host tensor) into `dest` (plain tensor or DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(dest, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = dest.to_local()
        shape, offset = compute_local_shape_and_global_offset(full.shape, dest.device_mesh, dest.placements)
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"materialize: local shard {tuple(local.shape)} != expected {tuple(shape)} "
                               f"for placements {dest.placements}")
        region = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        local.copy_(region)
        return
    if dest.shape != full.shape:
        raise RuntimeError(f"materialize: tensor of shape {tuple(dest.shape)} cannot take a value of {tuple(full.shape)}")
    dest.copy_(full)


# Attention kernels a plan may choose (model_overrides {"attn_implementation": ...}): the two
# that run everywhere, CPU parity included, and that every family's eager fallback covers.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def causal_lm_class(config) -> type:
    """The transformers *ForCausalLM class a config builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def supported_attn_implementations(config) -> list[str]:
    """The ATTENTION_IMPLEMENTATIONS the family's model class supports (eager: every family).

    SDPA has no logit soft-capping: a config with `attn_logit_softcapping` (Gemma-2) gets eager
    only. transformers 5.17 (the GPU image's) still marks Gemma-2 `_supports_sdpa` and its
    sdpa_attention_forward drops `softcap` without a word (5.2x refuses it): other math than the
    model's, which parity against a reference on the same path cannot see."""
    cls = causal_lm_class(config)
    softcapped = getattr(config, "attn_logit_softcapping", None) is not None
    return [name for name in ATTENTION_IMPLEMENTATIONS if name == "eager" or (
        getattr(cls, f"_supports_{name}", False) and not (name == "sdpa" and softcapped))]


def attn_implementation(config) -> str:
    """The attention kernel a model of `config` is built with, the same on every path (trial,
    reference, ZeRO-3's own construction, the cost model's trace): the config's own choice (set
    by models.build_config, from model_overrides), else SDPA where the family supports it (no
    s x s matrix kept, and the mask-free causal path pipeline stages rely on), else eager
    (Gemma-2: SDPA cannot soft-cap attention logits, so transformers refuses it)."""
    chosen = getattr(config, "_attn_implementation", None)
    if chosen:
        return chosen
    return "sdpa" if "sdpa" in supported_attn_implementations(config) else "eager"


def build_meta(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model's structure with every parameter and buffer on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation(config))


def materialize(model: nn.Module, init: ModelInit, device: torch.device, modules: list[nn.Module] | None = None) -> None:
    """Allocate (`to_empty`) and fill a meta model, or the given parts of it, on `device`.

    Tied parameters stay tied: `to_empty` gives every module slot its own new tensor, so a tied
    LM head would silently become a second, independently trained embedding."""
    parts = modules if modules is not None else [model]
    shared = shared_parameter_slots(parts)
    for part in parts:
        part.to_empty(device=device)
    retie(shared)
    init.fill(modules)
    if init.meter is not None:
        init.meter.stop()


def shared_parameter_slots(parts: Iterable[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots that hold one parameter object together (tied weights), the
    first slot of each group first in module order (the one FSDP2 also treats as the owner)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[int] = set()
    for part in parts:
        for module in part.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for attr, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, attr))
    return [group for group in slots.values() if len(group) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every slot of each group at the parameter its first slot now holds."""
    for (first, first_attr), *rest in groups:
        param = first._parameters[first_attr]
        for module, attr in rest:
            module._parameters[attr] = param


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (rotary tables) on the compute device: FSDP2's CPU offload moves parameters to the
    device around compute, never buffers, so a model materialized on the host keeps them there."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


class ConstructionMeter:
    """Peak tensor memory of this rank from the start of construction until the model is
    materialized (before any optimizer state or engine buffer exists).

    CUDA: the caching allocator's peak (max_memory_allocated) above what was allocated before.
    CPU: PyTorch's MemTracker (every tensor storage created meanwhile; meta tensors excluded)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: int | None = None
        self.seconds: float | None = None  # wall time of construction (host init included)
        self.method = ""
        self._t0 = 0.0
        self._tracker = None
        self._base = 0

    def start(self) -> "ConstructionMeter":
        import time

        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated during construction"
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._tracker = MemTracker()
            self._tracker.__enter__()
            self.method = "torch MemTracker during construction (tensor storage, meta excluded)"
        return self

    def stop(self) -> None:
        """Idempotent: the first call after the model exists records the peak."""
        if self.peak_bytes is not None:
            return
        import time

        self.seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        if self._tracker is None:
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        peak = tracker.get_tracker_snapshot("peak")
        self.peak_bytes = int(sum(v.get("Total", 0) for dev, v in peak.items() if str(dev) != "meta"))

    def abandon(self) -> None:
        """Leave the tracker without a reading (construction failed or never reached the end)."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
