"""Check a plan against the model it will build, before any worker starts.

The Plan's own rules see only the config's numbers (heads, layers, vocabulary). Whether a
family's layers can be split the way the plan asks depends on the model itself: which
tensor-parallel styles transformers' plan for the family uses, how its blocks are laid out, how
its attention is masked. Those rules are checked here on the model built on the meta device (no
memory, any size), so an unsupported family/plan combination is an `invalid_config` with its
reason instead of a crash, or worse a silently different training, inside the workers.

Pipeline stages (paratune.parallel.pp) run token embedding -> blocks(h, positions, no attention
mask) -> final norm -> head, as Llama does (the pieces found whatever the family calls them).
That is the same model only where SDPA applies the causal mask itself, no layer's sliding window
is shorter than the sequence, the input embedding and the LM head are separate weights (they live
on different stages), nothing but the token embedding comes before the first block (GPT-2's and
OPT's learned positions do), and the family's *ForCausalLM adds nothing between the head and the
loss. PIPELINE_FAMILIES are those whose stages match the single-process reference in the
loss-parity tests (tests/test_families.py).

Tensor parallelism (paratune.parallel.tp) follows transformers' plan for the family (or, where it
ships none, the one paratune.parallel.tp_derive derives from the blocks' linears): only the
styles it implements, on the modules the plan names (under the blocks' stack: "layers.*." for
Llama and GPT-NeoX), with evenly split dimensions. ZeRO with tp is DeepSpeed's AutoTP, which
implements fewer of transformers' styles (Phi-3's fused projections are refused by DeepSpeed
itself, inside every worker, so here first). Sequence and
context parallelism need SDPA's mask-free causal path (no window shorter than the sequence).
"""

from __future__ import annotations


from torch import nn

from paratune.config.model_config import ModelError
from paratune.config.plan import Plan, PlanError

# Families whose pipeline stages train exactly like the reference (measured, fp32 < 1e-5).
PIPELINE_FAMILIES = ("gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3",
                     # mixtures of experts (their aux loss off: _check_pp), proven by tests/test_moe_families.py
                     "mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
# Why a known family is not among them (what its stages would get wrong).
PIPELINE_REFUSALS = {
    "gemma2": "Gemma2ForCausalLM soft-caps the logits after lm_head (final_logit_softcapping) and its "
              "eager attention needs an explicit causal/sliding mask, which stages do not pass",
}
# Direct children of a decoder block that sequence parallelism shards (the rest see the residual
# replicated or live inside the attention/MLP, whose inputs are gathered first).
SEQUENCE_PARALLEL_NORMS = ("input_layernorm", "post_attention_layernorm")


def _meta_model(key: str) -> nn.Module:
    """The model of a config key on the meta device (paratune.model.build.meta_model, cached)."""
    from paratune.model.build import meta_model

    return meta_model(key)


def check_plan_against_model(plan: Plan, config=None) -> None:
    """Raise PlanError (field, value, what is allowed) if the model cannot be laid out as the plan
    asks. `config`: the plan's built config (models.build_config), built here when not given."""
    cp = getattr(plan, "cp", 1)
    from paratune.model.checkpoints import checkpoint_refusal, weights_folder

    if weights_folder(plan.model) is not None:  # pretrained weights: every parameter under its own name
        from paratune.model.build import build_config

        config = config if config is not None else build_config(plan.model, plan.model_overrides)
        refusal = checkpoint_refusal(plan.model, config)
        if refusal is not None:
            raise PlanError(refusal)
    if plan.loss in ("vocab_parallel", "chunked"):  # an explicit loss form the model may not take
        from paratune.model.build import build_config
        from paratune.parallel.loss import loss_form_refusal

        config = config if config is not None else build_config(plan.model, plan.model_overrides)
        refusal = loss_form_refusal(plan, config)
        if refusal is not None:
            raise PlanError(refusal)
    if getattr(plan, "peft", None) is not None:  # LoRA: the layouts and levers it runs with, its targets
        from paratune.model.adapters import adapter_refusal
        from paratune.model.build import build_config

        config = config if config is not None else build_config(plan.model, plan.model_overrides)
        refusal = adapter_refusal(plan, config)
        if refusal is not None:
            raise PlanError(refusal)
    ep = getattr(plan, "ep", 1)
    per_block = plan.strategy == "fsdp" or plan.activation_checkpointing != "none" or plan.compile
    if plan.tp == 1 and plan.pp == 1 and cp == 1 and ep == 1 and plan.float8 == "none" and not per_block:
        return  # data parallelism keeps every layer whole: nothing family-specific to check
    from paratune.model.build import build_config, config_key

    config = config if config is not None else build_config(plan.model, plan.model_overrides)
    model = _meta_model(config_key(config))
    if per_block:
        _check_blocks(plan, model)
    if ep > 1:  # the family's EP plan must name experts paratune can split (paratune.parallel.ep)
        from paratune.parallel.ep import ep_refusal

        refusal = ep_refusal(plan, model)
        if refusal is not None:
            raise PlanError(refusal)
    if plan.tp > 1 and plan.strategy == "zero":
        _check_autotp(plan, config, model)
    elif plan.tp > 1:
        _check_tp(plan, config, model)
    if plan.float8 != "none":  # after tp's check: it reads tp's plan
        _check_float8(plan, model)
    if cp > 1:
        _check_cp(plan, config, cp)
    if plan.sequence_parallel:
        _check_sequence_parallel(plan, config, model)
    if plan.pp > 1:
        _check_pp(plan, config, model)


def _check_blocks(plan: Plan, model: nn.Module) -> None:
    """FSDP2 shards, checkpointing and compile work block by block: a model whose decoder blocks
    cannot be told apart (XLM's four parallel lists) is refused here, not on the workers."""
    from paratune.model.build import decoder_blocks

    try:
        decoder_blocks(model)
    except ModelError as err:
        uses = [what for what, on in (("strategy fsdp", plan.strategy == "fsdp"), ("compile", plan.compile),
                                      (f"activation_checkpointing {plan.activation_checkpointing}",
                                       plan.activation_checkpointing != "none")) if on]
        raise PlanError(f"{' and '.join(uses)} works block by block: {err}; allowed: strategy ddp or zero, "
                        "without compile or checkpointing") from None


def _check_float8(plan: Plan, model: nn.Module) -> None:
    """A float8 plan converts at least one linear: every linear whose shape on a rank CUDA's
    _scaled_mm cannot take stays bf16 (paratune.parallel.float8), and a plan where that is all of
    them would measure bf16 under a float8 label (its trial fails the float8 dtype check, late)."""
    from paratune.model.build import remembered
    from paratune.parallel.float8 import skipped_linears

    linears = remembered(model, "linear_names", lambda: [name for name, m in model.named_modules() if type(m) is nn.Linear])
    skipped = skipped_linears(model, plan)
    if linears and len(skipped) == len(linears):
        example = next((f"{n}: {why}" for n, why in skipped.items() if "LM head" not in why), "")
        raise PlanError(f"float8: '{plan.float8}' converts no linear of '{plan.model}' at tp {plan.tp} (every one stays "
                        f"bf16; e.g. {example}); allowed: float8 'none', or a tp whose per-rank widths are multiples "
                        "of 16")


def attention_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as the family applies it."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * layers
    if types:
        return [None if kind == "full_attention" else window for kind in types]
    return [window] * layers  # Mistral, Phi-3: one window on every layer


def _short_windows(plan: Plan, config) -> str | None:
    """A description of the layers whose window is shorter than the sequence, if any."""
    short = [i for i, w in enumerate(attention_windows(config)) if w is not None and w < plan.seq_len]
    if not short:
        return None
    shown = ", ".join(map(str, short[:6])) + (", ..." if len(short) > 6 else "")
    return f"sliding_window {config.sliding_window} < seq_len {plan.seq_len} on layers {shown}"


def _family(config) -> str:
    return f"model_type '{config.model_type}'"


def _parts(config, model: nn.Module, field: str, value: object, allowed: str):
    """models.decoder_parts, or the plan refused with its reason (blocks in several stacks)."""
    from paratune.config.model_config import ModelError
    from paratune.model.build import decoder_parts

    try:
        return decoder_parts(model)
    except ModelError as err:
        raise PlanError(f"{field}: {value} with {_family(config)}: {err}; allowed: {allowed}") from None


def _is_module(root: nn.Module, path: str, module: nn.Module) -> bool:
    """Whether `path` (a plan key, no wildcard) names `module` under `root`."""
    try:
        return root.get_submodule(path) is module
    except AttributeError:
        return False


def _check_tp(plan: Plan, config, model: nn.Module) -> None:
    from paratune.model.build import decoder_blocks, remembered
    from paratune.parallel.ep import expert_module_patterns
    from paratune.parallel.tp import block_prefix
    from paratune.parallel.tp_derive import family_tp_plan

    tp = plan.tp
    parts = _parts(config, model, "tp", tp, "tp 1")
    try:
        hf_plan, source = family_tp_plan(model)
    except ValueError as err:
        raise PlanError(f"tp: {tp} with {_family(config)}, which has no tensor-parallel plan in transformers "
                        f"(base_model_tp_plan), and none can be derived from its blocks: {err}; allowed: tp 1") from None
    if source == "derived" and plan.sequence_parallel:
        raise PlanError(f"sequence_parallel: true with {_family(config)}, whose tp plan paratune derives (transformers "
                        "ships none): the derived plan names no norms to shard along the sequence; allowed: false")
    embedding, head = parts.embedding, parts.head
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        raise PlanError(f"tp: {tp} with {_family(config)}: paratune shards the input embedding (nn.Embedding) and "
                        f"the LM head (nn.Linear) itself, and {type(model).__name__} has a "
                        f"{type(embedding).__name__} and a {type(head).__name__}; allowed: tp 1")
    replicas = plan.num_workers // (tp * plan.pp)  # the ranks DDP averages over (dp, x cp if any)
    if plan.strategy == "ddp" and plan.pp == 1 and replicas > 1 and head.weight is embedding.weight:
        raise PlanError(f"strategy: 'ddp' over {replicas} replicas with tp {tp} and tie_word_embeddings true: torch's "
                        "DDP over DTensor weights (_pre_dp_module_transform) swaps a tied weight in one of its two "
                        "modules only, and DDP's first broadcast fails on the mix of Tensor and DTensor; allowed: "
                        "strategy 'fsdp' (FSDP2 x TP keeps the tie), or ddp with dp 1")
    blocks = decoder_blocks(model)
    prefix = block_prefix(model, hf_plan)
    experts = expert_module_patterns(config) if getattr(plan, "ep", 1) > 1 else []  # ep's, not tp's
    refusal = remembered(model, ("tp_plan_entries", tp, tuple(experts)),
                         lambda: _tp_entries_refusal(plan, config, model, hf_plan, prefix, blocks, embedding, experts))
    if refusal is not None:
        raise PlanError(refusal)


def _tp_entries_refusal(plan: Plan, config, model: nn.Module, hf_plan: dict[str, str], prefix: str,
                        blocks: list[nn.Module], embedding: nn.Module, experts: list[str]) -> str | None:
    """Why transformers' tp plan cannot be applied entry by entry to every block at the plan's tp
    (None: it can). A function of the model, tp and the experts ep takes off tp only: kept per
    (tp, experts) on the checks' frozen model (80 blocks x 7 entries a plan, otherwise)."""
    try:
        _check_tp_entries(plan, config, model, hf_plan, prefix, blocks, embedding, experts)
    except PlanError as err:
        return str(err)
    return None


def _check_tp_entries(plan: Plan, config, model: nn.Module, hf_plan: dict[str, str], prefix: str,
                      blocks: list[nn.Module], embedding: nn.Module, experts: list[str]) -> None:
    from paratune.parallel.ep import under_experts
    from paratune.parallel.tp import LINEAR_STYLES, SUPPORTED_STYLES

    tp = plan.tp
    allowed_styles = ", ".join(SUPPORTED_STYLES)
    for pattern, style in hf_plan.items():
        if under_experts(pattern, experts):
            continue
        if style == "embedding_rowwise" and _is_module(model.base_model, pattern, embedding):
            # transformers 5.1x (the GPU image's 5.17) adds the tied input embedding to every plan as
            # "embed_tokens": "embedding_rowwise"; paratune shards that embedding itself, the same way.
            continue
        if not pattern.startswith(prefix):
            raise PlanError(f"tp: {tp} with {_family(config)}: transformers' plan entry '{pattern}': '{style}' is "
                            f"outside the decoder blocks ({prefix}), where paratune shards only the embedding and the "
                            "LM head; allowed: tp 1")
        if style not in SUPPORTED_STYLES:
            raise PlanError(f"tp: {tp} with {_family(config)}: transformers' plan shards {pattern} with '{style}' "
                            f"(packed/fused or expert layouts are not sharded by paratune); allowed: tp 1, or "
                            f"{'ep > 1, which takes the routed experts off tp, or ' if '.experts' in pattern else ''}"
                            f"families whose plans use only {allowed_styles}")
        name = pattern.removeprefix(prefix)
        for index, block in enumerate(blocks):
            try:
                module = block.get_submodule(name)
            except AttributeError:
                kinds = sorted({type(b).__name__ for b in blocks})
                types = sorted(set(getattr(config.get_text_config(), "layer_types", None) or []))
                hybrid = (f" (hybrid layers: {', '.join(kinds)})" if len(kinds) > 1 else
                          f" (hybrid layers: layer_types {', '.join(types)})" if len(types) > 1 else "")
                raise PlanError(f"tp: {tp} with {_family(config)}: transformers' plan names {pattern} ('{style}'), "
                                f"which block {index} ({type(block).__name__}) does not have{hybrid}; allowed: tp 1") from None
            _check_module(plan, config, pattern, style, module, LINEAR_STYLES)


def _check_autotp(plan: Plan, config, model: nn.Module) -> None:
    """ZeRO with tp is DeepSpeed's AutoTP, which follows the same transformers plan but implements
    fewer styles and rejects a plan with any other (deepspeed/module_inject/tp_plan_converter.py),
    inside `deepspeed.initialize` on every worker. The same test, on the same merged plan, here."""
    from paratune.model.build import remembered

    unsupported = remembered(model, "autotp_unsupported_styles", lambda: _autotp_unsupported_styles(model))
    if unsupported:
        raise PlanError(f"tp: {plan.tp} with strategy 'zero' and {_family(config)}: DeepSpeed's AutoTP rejects "
                        f"transformers' plan for the family, whose style(s) {unsupported} it does not implement; "
                        f"allowed: tp 1 with zero, or strategy 'ddp'/'fsdp' with tp {plan.tp} (paratune's own tensor "
                        "parallelism implements them)")


def _autotp_unsupported_styles(model: nn.Module) -> list[str]:
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES as AUTOTP_STYLES
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    hf_plan = _get_hf_tp_plan(model) or {}
    return sorted({style for style in hf_plan.values() if style.lower() not in AUTOTP_STYLES})


def _check_module(plan: Plan, config, pattern: str, style: str, module: nn.Module, linear_styles: set[str]) -> None:
    tp = plan.tp
    if style in linear_styles:
        if not isinstance(module, nn.Linear):
            raise PlanError(f"tp: {tp} with {_family(config)}: {pattern} is a {type(module).__name__}, and "
                            f"'{style}' shards nn.Linear only; allowed: tp 1")
        sharded = module.out_features if style.startswith("colwise") else module.in_features
        side = "out_features" if style.startswith("colwise") else "in_features"
        if sharded % tp:
            divisors = [d for d in range(1, sharded + 1) if sharded % d == 0 and d <= 64]
            raise PlanError(f"tp: {tp} must divide {pattern}.{side} = {sharded} ('{style}' splits it evenly "
                            f"over the tp ranks); allowed: {divisors}")
    elif not any(True for _ in module.parameters(recurse=False)):
        raise PlanError(f"tp: {tp} with {_family(config)}: {pattern} ('{style}') holds no parameters of its own; "
                        "allowed: tp 1")


def _check_sequence_parallel(plan: Plan, config, model: nn.Module) -> None:
    from paratune.model.build import decoder_blocks

    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        raise PlanError(f"sequence_parallel: true with attention '{attn}' ({_family(config)}): each rank builds the "
                        "attention mask from its slice of the sequence, which only SDPA's mask-free causal path "
                        "ignores; allowed: false, or model_overrides {\"attn_implementation\": \"sdpa\"} where "
                        "the family supports it")
    short = _short_windows(plan, config)
    if short:
        raise PlanError(f"sequence_parallel: true with {short}: the sliding-window mask would be built from one "
                        "rank's slice of the sequence; allowed: false, or seq_len <= the window")
    if _parts(config, model, "sequence_parallel", "true", "false").norm is None:
        raise PlanError(f"sequence_parallel: true with {_family(config)}: {type(model).__name__} has no final norm "
                        "before the LM head, where the sequence shards are gathered; allowed: false")
    for index, block in enumerate(decoder_blocks(model)):
        extra = sorted(name for name, child in block.named_children()
                       if name not in ("self_attn", "mlp", *SEQUENCE_PARALLEL_NORMS)
                       and any(True for _ in child.parameters()))
        if extra:
            raise PlanError(f"sequence_parallel: true with {_family(config)}: block {index} has {', '.join(extra)} on "
                            f"the sequence-sharded residual stream, and paratune shards only "
                            f"{', '.join(SEQUENCE_PARALLEL_NORMS)} there; allowed: false")


def _check_cp(plan: Plan, config, cp: int) -> None:
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        raise PlanError(f"cp: {cp} with attention '{attn}' ({_family(config)}): context parallelism rings SDPA's "
                        "kernels only; any other attention would attend to this rank's chunk of the keys alone; "
                        "allowed: cp 1, or model_overrides {\"attn_implementation\": \"sdpa\"} where the family "
                        "supports it")
    short = _short_windows(plan, config)
    if short:
        raise PlanError(f"cp: {cp} with {short}: torch's ring attention applies the causal mask only (no mask "
                        "tensor); allowed: cp 1, or seq_len <= the window")


def _stage_mismatch(model: nn.Module) -> str | None:
    """What Llama-style stages would leave out of a family's forward, where the model shows it:
    blocks in several stacks, or an embedding besides the token embedding in the decoder body
    (GPT-2's wpe, OPT's embed_positions: learned positions added before the first block; OPT's
    stages measured 3e-2 off the reference)."""
    from paratune.config.model_config import ModelError
    from paratune.model.build import decoder_parts

    try:
        parts = decoder_parts(model)
    except ModelError as err:
        return str(err)
    extra = [name for name, child in parts.body.named_children()
             if isinstance(child, nn.Embedding) and child is not parts.embedding]
    if extra:
        return (f"{type(parts.body).__name__} adds {', '.join(extra)} to the token embedding before the first block "
                "(learned positions), which pipeline stages do not apply")
    return None


def _check_pp(plan: Plan, config, model: nn.Module) -> None:
    pp = plan.pp
    family = config.model_type
    from paratune.model.build import adds_router_aux_loss

    if adds_router_aux_loss(config):
        raise PlanError(f"pp: {pp} with {_family(config)}, whose loss adds the routers' load-balancing loss "
                        "(output_router_logits true): the family computes it at the loss from every layer's router "
                        "logits, which pipeline stages do not pass on, so the pipeline would train without it; "
                        "allowed: pp 1, or model_overrides {\"output_router_logits\": false} to train without it")
    if family not in PIPELINE_FAMILIES:
        why = PIPELINE_REFUSALS.get(family) or _stage_mismatch(model) or (
            f"{type(model).__name__} has not been verified to train the same model when cut into Llama-style stages")
        raise PlanError(f"pp: {pp} with {_family(config)}: {why}; allowed: pp 1, or pp > 1 with model_type "
                        f"{', '.join(PIPELINE_FAMILIES)}")
    parts = _parts(config, model, "pp", pp, "pp 1")
    if parts.head is not None and parts.head.weight is parts.embedding.weight:
        raise PlanError(f"pp: {pp} with tie_word_embeddings true: the input embedding (first stage) and the LM head "
                        "(last stage) would train as two separate weights; allowed: pp 1, or model_overrides "
                        "{\"tie_word_embeddings\": false} (a different model)")
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        raise PlanError(f"pp: {pp} with attention '{attn}': pipeline stages pass no attention mask and only SDPA "
                        "then applies the causal mask itself (eager would attend to future tokens); allowed: pp 1, "
                        "or model_overrides {\"attn_implementation\": \"sdpa\"}")
    short = _short_windows(plan, config)
    if short:
        raise PlanError(f"pp: {pp} with {short}: pipeline stages pass no attention mask, so tokens would attend "
                        "past the window; allowed: pp 1, or seq_len <= the window")
