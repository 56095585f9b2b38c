"""Model shapes and construction from a config: never from the hub, random init, same on every rank."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Hashable, TypeVar

if TYPE_CHECKING:  # torch is imported where a model is built: reading configs (validate, plan's checks) needs none
    import torch
    from torch import nn

from paratune.config.model_config import ModelError, _fit_layer_types, load_config_dict

T = TypeVar("T")


# Causal-LM classes transformers ships whose training step needs more than token ids, by model_type.
NOT_TRAINED_ON_TEXT = {
    "git": "computes its loss after its image tokens (GitForCausalLM slices the logits past the pixel_values' "
           "patches: token ids alone give it no positions to score)",
}


def build_config(model: str, overrides: dict[str, Any] | None = None):
    """A transformers PretrainedConfig for a decoder-only causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    data = load_config_dict(model, overrides)
    model_type = data.pop("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"model: model_type '{model_type}' is not a causal LM that transformers knows")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as err:  # noqa: BLE001 - transformers 5 also raises huggingface_hub's
        # StrictDataclassClassValidationError (not a ValueError) for inconsistent configs
        raise ModelError(f"model config: {type(err).__name__}: {err}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model: '{model}' is an encoder-decoder; paratune tunes decoder-only LMs")
    if model_type in NOT_TRAINED_ON_TEXT:
        raise ModelError(f"model: '{model}' ({model_type}) {NOT_TRAINED_ON_TEXT[model_type]}; paratune trains "
                         "causal LMs on token ids")
    config.use_cache = False
    config._attn_implementation = _checked_attn_implementation(config)
    return config


def _checked_attn_implementation(config) -> str:
    """The attention kernel, decided once here so every path builds the same model: the one the
    overrides name if the family supports it, else SDPA where supported, else eager."""
    from paratune.model.materialize import (
        ATTENTION_IMPLEMENTATIONS,
        attn_implementation,
        causal_lm_class,
        supported_attn_implementations,
    )

    requested = getattr(config, "_attn_implementation", None)
    allowed = supported_attn_implementations(config)
    if requested is not None and requested not in allowed:
        cls = causal_lm_class(config)
        if requested not in ATTENTION_IMPLEMENTATIONS:
            why = f"paratune builds with {' or '.join(ATTENTION_IMPLEMENTATIONS)}"
        elif getattr(cls, f"_supports_{requested}", False):  # the class would, the config's math would not
            why = f"SDPA has no attention logit soft-capping, which {cls.__name__}'s config sets (attn_logit_softcapping)"
        else:
            why = f"{cls.__name__} does not support it"
        raise ModelError(f"model_overrides.attn_implementation: got '{requested}'; {why}; allowed: {', '.join(allowed)}")
    return attn_implementation(config)


def build_model(config, seed: int, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                sources: list | None = None) -> nn.Module:
    """Model from config, whole, on `device`: random init, or the values `sources` give
    (`ModelInit.sources`; a folder's pretrained weights: `paratune.model.checkpoints.build_model_with_weights`).
    Its values are those every layout reproduces slice by slice (paratune.model.materialize)."""
    import torch

    from paratune.model.materialize import ModelInit, build_meta, materialize

    dtype = dtype or torch.float32
    model = build_meta(config, dtype)
    init = ModelInit(model, config, seed, dtype)
    init.sources += sources or []
    materialize(model, init, torch.device(device))
    return model


def _is_block(module: nn.Module, names: set[str]) -> bool:
    return any(cls.__name__ in names for cls in type(module).__mro__)


def _text_layers(config) -> int | None:
    """num_hidden_layers of the config's text part (multimodal configs nest it)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    return layers if isinstance(layers, int) else None


def block_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ModuleLists (path, list) of the decoder's repeated blocks, in model order.

    transformers names a family's block class(es) in `_no_split_modules` (LlamaDecoderLayer,
    GPTNeoXLayer, GPT2Block, ...): the blocks are the ModuleLists whose children are all of those
    classes (outermost only); where there are several, those inside the decoder (`get_decoder()`:
    a multimodal model's vision tower has blocks of its own). A family that names none (BioGPT,
    CTRL, OpenAI-GPT): the one ModuleList of `num_hidden_layers` modules of one class that hold
    parameters. Almost every family has one stack; a few (HRM, BLT) have several, in order.

    A model marked read-only (`freeze_structure`: the pre-launch checks' shared meta models) keeps
    its answer (`remembered`): a space's thousands of plans walk an 80-layer model's modules once."""
    return remembered(model, "block_stacks", lambda: _find_block_stacks(model))


def _find_block_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod)]
    found: list[tuple[str, nn.ModuleList]] = []
    if names:
        for name, mod in lists:
            if all(_is_block(child, names) for child in mod) and not any(
                    name.startswith(outer + ".") for outer, _ in found):
                found.append((name, mod))
    layers = _text_layers(model.config)
    if not found:
        found = [(name, mod) for name, mod in lists
                 if len(mod) == layers and len({type(c) for c in mod}) == 1
                 and any(True for _ in mod[0].parameters())]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if len(found) > 1 and isinstance(decoder, nn.Module) and decoder is not model:
        inside = {id(m) for m in decoder.modules()}
        found = [(name, mod) for name, mod in found if id(mod) in inside] or found
    if len(found) > 1 and not names:
        raise ModelError(f"cannot tell the decoder blocks of {type(model).__name__} apart: it names no block class "
                         f"(_no_split_modules) and {len(found)} ModuleLists hold num_hidden_layers ({layers}) "
                         f"modules of one class: {', '.join(n for n, _ in found)}")
    if not found:
        looked = (f"a ModuleList of {' / '.join(sorted(names))} (its _no_split_modules)" if names
                  else f"a ModuleList of num_hidden_layers ({layers}) modules of one class with parameters (it "
                       "names no block class in _no_split_modules)")
        raise ModelError(f"cannot find decoder blocks in {type(model).__name__}: looked for {looked}, found none")
    return found


# A model whose module tree no one changes any more (set by `freeze_structure`), and the answers kept
# on it (`remembered`). In the module's __dict__: not a parameter, buffer or submodule.
_FROZEN, _REMEMBERED = "_paratune_structure_frozen", "_paratune_remembered"


def freeze_structure(model: nn.Module) -> nn.Module:
    """Mark a model whose module tree will not change (a meta model only read by checks), so the
    walks over it (block_stacks, `remembered`) are done once. Never for a model a layout will wrap
    or shard."""
    model.__dict__[_FROZEN] = True
    return model



def remembered(model: nn.Module, key: Hashable, compute: Callable[[], T]) -> T:
    """compute(), a pure function of the model's module tree and `key`, once per key on a frozen
    model (`freeze_structure`): a space's thousands of plans ask the same few questions of one
    80-layer meta model (tp's splits at each degree, float8's skipped linears). Every time on any
    other model (a worker's, whose tree its layout changes)."""
    if not model.__dict__.get(_FROZEN):
        return compute()
    kept = model.__dict__.setdefault(_REMEMBERED, {})
    if key not in kept:
        kept[key] = compute()
    return kept[key]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the unit of sharding and checkpointing), in model order."""
    return [block for _, stack in block_stacks(model) for block in stack]


def _slot(root: nn.Module, target: nn.Module | None) -> tuple[nn.Module, str] | None:
    """(parent, attribute) under which `root` holds `target` (its first place), or None."""
    if target is None:
        return None
    for name, module in root.named_modules():
        if module is target and name:
            parent, _, attr = name.rpartition(".")
            return root.get_submodule(parent), attr
    return None


def _is_norm(module: nn.Module) -> bool:
    from torch import nn

    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


@dataclass(frozen=True)
class DecoderParts:
    """Where a decoder-only model keeps its pieces, whatever the family calls them: Llama's
    model.{embed_tokens, layers, norm, rotary_emb} + lm_head, GPT-NeoX's gpt_neox.{embed_in,
    layers, final_layer_norm, rotary_emb} + lm_head, GPT-2's transformer.{wte, h, ln_f} +
    lm_head, OPT's model.decoder.{embed_tokens, layers, final_layer_norm} + lm_head."""

    body: nn.Module  # the module that holds the block stack (LlamaModel, GPTNeoXModel, OPTDecoder)
    stack_attr: str  # body's attribute holding the blocks (an nn.ModuleList)
    stack_path: str  # the stack's path under model.base_model: transformers' TP plans say "<path>.*.<module>"
    embedding: nn.Module  # input token embedding (model.get_input_embeddings())
    head: nn.Module | None  # output projection (model.get_output_embeddings())
    norm: nn.Module | None  # the final norm before the head (a norm child of body, after the stack if several)
    rotary: nn.Module | None  # body's rotary embedding (no parameters; None: positions live elsewhere)

    @property
    def blocks(self) -> nn.ModuleList:
        return getattr(self.body, self.stack_attr)

    def slots(self, model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
        """(parent, attribute) of the stack, embedding, final norm and head (those the model has)."""
        out = {"blocks": (self.body, self.stack_attr)}
        for key in ("embedding", "norm", "head"):
            where = _slot(model, getattr(self, key))
            if where is not None:
                out[key] = where
        return out


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The pieces pipeline stages and tensor parallelism handle themselves (see DecoderParts).
    A model whose blocks sit in several stacks has no single stage layout: ModelError."""
    stacks = block_stacks(model)
    if len(stacks) > 1:
        raise ModelError(f"{type(model).__name__} keeps its blocks in {len(stacks)} stacks "
                         f"({', '.join(n for n, _ in stacks)}); paratune splits one stack only")
    path, stack = stacks[0]
    body_path, _, attr = path.rpartition(".")
    body = model.get_submodule(body_path)
    base = getattr(model, "base_model", model)
    base_path = next((n for n, m in model.named_modules() if m is base), "")
    stack_path = path.removeprefix(base_path + ".") if base_path else path
    names = list(body._modules)
    norms = [(i, child) for i, (n, child) in enumerate(body.named_children())  # OLMo's has no weights
             if child is not None and _is_norm(child)]
    after = [child for i, child in norms if i > names.index(attr)]
    norm = (after or [child for _, child in norms] or [None])[-1]
    rotary = next((child for n, child in body.named_children()
                   if child is not None and ("rotary" in n or "Rotary" in type(child).__name__)), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return DecoderParts(body=body, stack_attr=attr, stack_path=stack_path, embedding=model.get_input_embeddings(),
                        head=head, norm=norm, rotary=rotary)


# Where families keep the feed-forward width (Llama-likes and GPT-NeoX, OPT, GPT-2 / GPT-J).
FFN_WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner")


def ffn_width_key(config: dict[str, Any]) -> str:
    """The config key that holds the family's feed-forward width (a config.json dict); the first of
    FFN_WIDTH_KEYS the config has, else intermediate_size."""
    return next((k for k in FFN_WIDTH_KEYS if k in config), FFN_WIDTH_KEYS[0])


def config_key(config) -> str:
    """A config as canonical JSON (model_type and attention kernel included): a cache key, and
    enough to rebuild it."""
    data = config.to_dict()
    keep = {k: v for k, v in data.items() if not k.startswith("_") and k not in ("transformers_version",)}
    if getattr(config, "_attn_implementation", None):  # not in to_dict(); part of what is built
        keep["attn_implementation"] = config._attn_implementation
    return json.dumps(keep, sort_keys=True, default=str)


def config_from_key(key: str, **overrides: Any):
    """The config a config_key() describes (with overrides, e.g. fewer layers: a per-layer
    `layer_types` list follows the new layer count)."""
    from transformers import AutoConfig

    data = _fit_layer_types({**json.loads(key), **overrides}, overrides)
    return AutoConfig.for_model(data.pop("model_type"), **data)


# Where a family keeps its routed top-k: on the router or the MoE block (most: `top_k`), else in
# the config (`num_experts_per_tok`; Aria/Hunyuan `moe_topk`, DBRX ffn_config.moe_top_k).
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk", "moe_top_k", "num_experts_per_token")


def _own_int(module: object, attr: str) -> int | list | None:
    """An int (or per-layer list) set in the object's __init__, never a submodule or parameter."""
    value = vars(module).get(attr)
    if isinstance(value, bool):
        return None
    return value if isinstance(value, (int, list, tuple)) else None


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(path, module, number of experts) of every routed-experts module: a module with an int
    `num_experts` >= 2 that holds the experts' weights packed, expert first (transformers 5:
    MixtralExperts.gate_up_proj [E, 2I, H], JetMoe's ParallelExperts [E, out, in]), or a
    transformers *Experts class (DBRX keeps them flattened in a child; LongCat-Flash names no
    count: E is its packed weights' first dimension). Routers ([E, H], 2-D) and shared experts
    (ordinary MLPs, *SharedExperts) are not routed: every token uses them."""
    found: list[tuple[str, nn.Module, int]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f, _, _ in found):
            continue
        count = _own_int(module, "num_experts")
        packed = [p.shape[0] for p in module.parameters(recurse=False) if p.ndim >= 3]
        kind = type(module).__name__
        named = kind.endswith("Experts") and "Shared" not in kind
        if isinstance(count, int) and count >= 2 and (count in packed or named):
            found.append((name, module, count))
        elif named and not isinstance(count, int) and packed and packed[0] >= 2:
            found.append((name, module, packed[0]))
    return found


def _idle_parameters(experts: nn.Module, count: int, k: int) -> float:
    """Parameters of a routed-experts module that a token does not go through: of each packed
    tensor [E_p, ...] all but k / E_p (E_p is the tensor's own expert axis: LongCat-Flash packs its
    zero-computation experts into one tensor only), of anything else all but k / count."""
    idle = 0.0
    for p in experts.parameters():
        per = p.shape[0] if p.ndim >= 3 else count
        idle += p.numel() * (per - min(k, per)) / per
    return idle


def _config_top_k(config, layer: int | None) -> int | None:
    configs = [config, *(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for cfg in ([text] if text is not None else []) + configs:
        for attr in TOP_K_ATTRS:
            value = getattr(cfg, attr, None)
            if isinstance(value, (list, tuple)) and layer is not None and layer < len(value):
                value = value[layer]
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def routed_top_k(model: nn.Module, path: str, experts: nn.Module) -> int:
    """How many of an experts module's experts each token goes through: the nearest `top_k` (or
    alias) on the router or MoE block around it, within its decoder block; else the config's
    (a per-layer list is read at the block's index)."""
    blocks = {id(b): i for i, b in enumerate(decoder_blocks(model))}
    inner = {id(m) for m in experts.modules()}
    parts, layer = path.split("."), None
    for depth in range(len(parts) - 1, 0, -1):
        scope = model.get_submodule(".".join(parts[:depth]))
        for sub in scope.modules():
            if id(sub) in inner:
                continue
            for attr in TOP_K_ATTRS:
                value = _own_int(sub, attr)
                if isinstance(value, int) and value >= 1:
                    return value
        if id(scope) in blocks:
            layer = blocks[id(scope)]
            break
    value = _config_top_k(model.config, layer)
    if value is None or value < 1:
        raise ModelError(f"{type(model).__name__}: {path} ({type(experts).__name__}) routes each token to some of "
                         f"its experts, but no top-k was found (looked for an int {' / '.join(TOP_K_ATTRS)} on its "
                         f"router, its MoE block and the config; got {value!r})")
    return value


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts of a built model (any device, meta included); see parameter_counts."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding_module = model.get_input_embeddings()
    embedding = embedding_module.weight.numel()
    head_module = model.get_output_embeddings()
    head = head_module.weight.numel() if head_module is not None else 0
    tied = head_module is not None and head_module.weight is embedding_module.weight
    seen: set[int] = set()
    lookups = 0  # every embedding table (token, learned position, per-layer): a lookup, no matmul
    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            lookups += module.weight.numel()
    idle = 0.0  # the routed experts' parameters a token does not go through
    for path, experts, n_experts in routed_experts(model):
        idle += _idle_parameters(experts, n_experts, routed_top_k(model, path, experts))
    active = total - round(idle)
    sizes = [sum(p.numel() for p in block.parameters()) for block in decoder_blocks(model)]
    return {"total": total, "embedding": embedding, "head": 0 if tied else head, "tied_head": head if tied else 0,
            "layer": math.ceil(sum(sizes) / len(sizes)), "largest_layer": max(sizes), "layers": len(sizes),
            "active": active, "compute": active - lookups + (head if tied else 0)}


@lru_cache(maxsize=64)
def _layout(key: str) -> dict[str, int]:
    config = config_from_key(key)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count_parameters(model)


def parameter_layout(config) -> dict[str, int]:
    """Where the parameters are: total, input embedding, untied LM head (0 when tied), one decoder
    block (the mean where blocks differ, e.g. DeepSeek's dense first layers and MoE layers, so
    layer x layers is what the blocks hold; largest_layer: the biggest), number of blocks (exact,
    from the architecture built on the meta device)."""
    return dict(_layout(config_key(config)))


def parameter_counts(config) -> dict[str, int]:
    """Exact counts from the real architecture (built on the meta device: no memory, any size).

    `total`: every parameter (what memory holds). `active`: those one token goes through,
    embedding included (a mixture-of-experts layer: the router, the shared experts and top-k / E
    of the routed experts; Mixtral-8x7B 12.9B of 46.7B). `compute` is N in 6N: the active
    parameters a token's matmuls touch, i.e. all but the embedding lookups (token, learned
    positions); a tied LM head is counted once as storage but still costs a matmul.
    """
    layout = _layout(config_key(config))
    return {key: layout[key] for key in ("total", "embedding", "active", "compute")}


def adds_router_aux_loss(config) -> bool:
    """Whether the family's causal LM adds its routers' load-balancing loss to the loss it returns:
    `output_router_logits` on and a non-zero `router_aux_loss_coef` on the built config (the family
    class's default where config.json omits it; a family without one, DeepSeek-V3's aux-free
    routing, adds nothing). The loss needs every layer's router logits, inside the model's forward."""
    return bool(getattr(config, "output_router_logits", False)) and bool(getattr(config, "router_aux_loss_coef", 0))


@lru_cache(maxsize=16)
def meta_model(key: str) -> nn.Module:
    """The model of a config key (paratune.model.shapes.model_config_key) on the meta device, its
    structure frozen: what the pre-launch checks and float8's coverage walk. Cached: a sweep checks
    many plans of one model; only read, never run."""
    from paratune.model.materialize import build_meta

    return freeze_structure(build_meta(config_from_key(key)))
