"""A tensor-parallel plan for a family transformers ships none for, derived from its blocks' linears.

transformers' `base_model_tp_plan` covers the families its maintainers wrote one for; OPT, Falcon,
Bloom, GPT-BigCode, StableLM, GPT-OSS and others have none, and torchtitan would write a
`parallelize` per model. paratune derives one from what every decoder block holds, in transformers'
own style names (paratune.parallel.tp implements them), so everything downstream (the preflight's
checks, float8's per-rank shapes, LoRA beside its base layer) reads it like a shipped plan:

- the attention module (the block's child named *attn* / *attention* holding linears): its input
  projections (q, k, v, or a fused qkv) `colwise_gather_output`, its output projection (the one
  back to the hidden size; o_proj / out_proj / dense / c_proj by name where several are) as
  `rowwise_split_input`. The projections' outputs are gathered, so the attention core runs on whole
  tensors on every rank, whatever the family's head layout (Bloom interleaves q|k|v per head,
  GPT-BigCode shares one KV head, Falcon groups them): weights, their gradients and optimizer state
  and the projections' matmuls are split tp ways; the attention's own FLOPs are not.
- the MLP (the child named *mlp* / *ffn* / *feed_forward*, or the block's own linears, OPT's fc1 /
  fc2): the linears from the hidden size `colwise`, the one back to it `rowwise`, outputs kept
  sharded in between, as Llama's plan does; gathered as above where the first linears' width is
  not the last one's input (a fused gate|up chunked in the forward) or the MLP holds parameters
  beyond its linears (a norm over the intermediate width would see a shard).
- everything else stays whole on every rank (norms, routers, a MoE's experts: expert parallelism's).

Every block must derive the same plan: a hybrid stack (linear-attention layers beside full ones) is
refused with the blocks that differ. A derived plan is held to loss parity like every other layout
(tests/test_families.py trains OPT at tp 2; bench/families_parity.py the families named above).
"""

from __future__ import annotations

import re

from torch import nn

ATTENTION = re.compile(r"attn|attention", re.I)
MLP = re.compile(r"mlp|ffn|feed_forward", re.I)
OUTPUT_NAMES = re.compile(r"(^|\.)(o_proj|out_proj|dense|c_proj|wo|o)$")


def family_tp_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """(the plan in transformers' key/style form, where it comes from: "transformers" or "derived").
    Raises ValueError with the reason where transformers has none and none can be derived."""
    shipped = getattr(model.config, "base_model_tp_plan", None) or {}
    if shipped:
        return dict(shipped), "transformers"
    return derived_tp_plan(model), "derived"


def derived_tp_plan(model: nn.Module) -> dict[str, str]:
    """The plan derived from the decoder blocks' linears (see the module's docstring)."""
    from paratune.config.sizes import config_sizes
    from paratune.model.build import decoder_parts

    parts = decoder_parts(model)
    sizes = config_sizes(model.config)
    blocks = list(parts.blocks)
    first = _block_plan(blocks[0], sizes.hidden, sizes.experts is not None)
    for index, block in enumerate(blocks[1:], start=1):
        try:
            other = _block_plan(block, sizes.hidden, sizes.experts is not None)
        except ValueError as err:
            raise ValueError(f"hybrid layers: block {index} ({type(block).__name__}) is not block 0's kind: {err}") from None
        if other != first:
            differs = sorted(set(other.items()) ^ set(first.items()))[0][0]
            raise ValueError(f"hybrid layers: block {index} ({type(block).__name__}) differs from block 0 "
                             f"({type(blocks[0]).__name__}) at {differs}")
    return {f"{parts.stack_path}.*.{name}": style for name, style in first.items()}


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear modules under `module`, in registration order, a LoRA wrapper's base layer by
    the wrapper's name (its adapters are laid out beside it by paratune.parallel.tp)."""
    out = []
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and not any(p.startswith("lora_") for p in name.split(".")):
            out.append((name.removesuffix(".base_layer"), child))
    return out


def _block_plan(block: nn.Module, hidden: int, routed: bool) -> dict[str, str]:
    children = {name: child for name, child in block.named_children() if _linears(child) or isinstance(child, nn.Linear)}
    attention = [n for n in children if ATTENTION.search(n) and not isinstance(children[n], nn.Linear)]
    if len(attention) != 1:
        named = [n for n, _ in block.named_children() if ATTENTION.search(n)]
        if len(named) == 1 and not attention:  # GPT-2's Conv1D projections
            kinds = sorted({type(m).__name__ for m in block.get_submodule(named[0]).children()})
            raise ValueError(f"{type(block).__name__}.{named[0]} holds no nn.Linear (its modules: {', '.join(kinds)})")
        raise ValueError(f"{type(block).__name__} has {len(attention)} attention modules with linears among its "
                         f"children ({', '.join(children) or 'none'}); a derived plan needs exactly one")
    plan = _attention_plan(attention[0], children[attention[0]], hidden)
    mlp = [n for n in children if MLP.search(n) and not isinstance(children[n], nn.Linear)]
    if len(mlp) > 1:
        raise ValueError(f"{type(block).__name__} has {len(mlp)} MLP modules ({', '.join(mlp)})")
    if mlp and routed:  # a MoE layer: the experts are expert parallelism's, the router stays whole
        return plan
    if mlp:
        plan.update(_mlp_plan(f"{mlp[0]}.", children[mlp[0]], _linears(children[mlp[0]]), hidden))
    else:  # the block's own linears (OPT's fc1 / fc2)
        own = [(n, m) for n, m in children.items() if isinstance(m, nn.Linear)]
        if own:
            plan.update(_mlp_plan("", None, own, hidden))
    return plan


def _attention_plan(name: str, module: nn.Module, hidden: int) -> dict[str, str]:
    linears = _linears(module)
    back = [n for n, m in linears if m.out_features == hidden]
    if not back:
        raise ValueError(f"{name} has no projection back to the hidden size {hidden}")
    named = [n for n in back if OUTPUT_NAMES.search(n)]
    output = (named or back)[-1]
    plan = {}
    for n, m in linears:
        if n == output:
            continue
        if m.in_features != hidden:  # low-rank (MLA's q_a/q_b) or chained projections
            raise ValueError(f"{name}.{n} takes {m.in_features} features, not the hidden size {hidden} (a chained "
                             "or low-rank projection)")
        plan[f"{name}.{n}"] = "colwise_gather_output"
    plan[f"{name}.{output}"] = "rowwise_split_input"
    return plan


def _mlp_plan(prefix: str, container: nn.Module | None, linears: list[tuple[str, nn.Linear]],
              hidden: int) -> dict[str, str]:
    ups = [(n, m) for n, m in linears if m.in_features == hidden and m.out_features != hidden]
    downs = [(n, m) for n, m in linears if m.out_features == hidden and m.in_features != hidden]
    others = [n for n, _ in linears if n not in {k for k, _ in ups + downs}]
    if len(downs) != 1 or not ups or others:
        raise ValueError(f"{prefix or 'the block'}'s linears ({', '.join(n for n, _ in linears)}) are not first layers "
                         f"from the hidden size {hidden} and one back to it")
    linear_params = {id(p) for _, m in linears for p in m.parameters()}
    extra = container is not None and any(id(p) not in linear_params for p in container.parameters())
    fused = any(m.out_features != downs[0][1].in_features for _, m in ups)
    if extra or fused:
        styles = ("colwise_gather_output", "rowwise_split_input")
    else:
        styles = ("colwise", "rowwise")
    return {**{f"{prefix}{n}": styles[0] for n, _ in ups}, f"{prefix}{downs[0][0]}": styles[1]}
