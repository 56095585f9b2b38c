"""Loss parity, the one judge of whether a plan trains correctly: its losses against a single process.

The single-process reference trains the same model, data, optimizer and global batch on one CPU
process; a distributed plan is correct only if its first steps' losses match it, within
`parity_tolerance`, or, where the first losses agree, within what the reference itself moves when its
initial weights move by fp32 rounding (`rounding_sensitivity`: a model that amplifies rounding at
its learning rate, e.g. CPM-Ant). A model too big for the driver's CPU is judged on a proxy: the same plan on a
few small layers of the same family (`parity_proxy`). The sweep's winner (paratune.sweep.finish)
and `paratune trial --parity` are judged by the same `winner_parity`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from paratune.model.checkpoints import build_model_with_weights
from paratune.config.data import TokenBatches
from paratune.config.sizes import config_sizes
from paratune.model.build import build_config, ffn_width_key, parameter_counts
from paratune.config.model_config import load_config_dict
from paratune.parallel.recompute import apply_checkpointing
from paratune.parallel.runner import StepRunner, make_optimizer
from paratune.config.plan import Plan, load_plan_dict
from paratune.trial.results import TrialResult
from paratune.cluster.trial import run_trial


def reference_losses(plan: Plan, steps: int | None = None) -> list[float]:
    """Per-step mean loss of the plan's training run on one CPU process (fp32, no sharding)."""
    return reference_training(plan, steps)[0]


def reference_training(plan: Plan, steps: int | None = None,
                       weight_noise: float = 0.0) -> tuple[list[float], torch.nn.Module]:
    """The single-process reference run: its per-step losses and the trained model (what every
    layout's exported weights are compared with). `weight_noise`: every initial weight scaled by
    (1 + weight_noise x a fixed normal draw), for rounding_sensitivity."""
    steps = plan.total_steps if steps is None else steps
    config = build_config(plan.model, plan.model_overrides)
    if plan.peft is not None:  # the same LoRA adapters, values and frozen base as every layout
        from paratune.model.adapters import build_adapted_model
        from paratune.model.checkpoints import checkpoint_sources

        model = build_adapted_model(config, plan, sources=checkpoint_sources(plan.model, config))
    else:
        model = build_model_with_weights(config, seed=plan.seed, weights=plan.model)  # a folder's pretrained values too
    if weight_noise:
        draws = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + weight_noise * torch.randn(param.shape, generator=draws, dtype=param.dtype))
    apply_checkpointing(model, plan)
    model.train()
    device = torch.device("cpu")
    runner = StepRunner(model, make_optimizer(model.parameters(), plan), plan, device,
                        autocast=plan.precision == "bf16")
    data = TokenBatches(plan.data, config_sizes(config).vocab, plan.seq_len, plan.global_batch, plan.seed)
    torch.manual_seed(plan.seed + 1)
    losses = []
    for step in range(steps):
        micro = data.micro_batches(step, dp_rank=0, dp_degree=1, micro_batch=plan.micro_batch)
        losses.append(float(runner.train_step(micro)))
    return losses, model


def rounding_sensitivity(plan: Plan, steps: int, scale: float = 1e-7, reference: list[float] | None = None) -> float:
    """How far the reference's own losses move when its initial weights move by fp32 rounding
    (x (1 + 1e-7 noise)): a layout's reduction order moves them by about as much. ~5e-7 on
    Llama-like models at lr 1e-2; models whose training amplifies rounding (CPM-Ant 8e-3,
    Gemma-3n 2e-2 in 3 steps) cannot be held to 1e-4 at that learning rate."""
    base = reference if reference is not None else reference_losses(plan, steps)
    return max_loss_difference(reference_training(plan, steps, weight_noise=scale)[0], base)


def first_losses_agree(loss: float, reference: float) -> bool:
    """The same model before any update: first losses within 1e-6, relative above a loss of 1 (fp32
    sums of a loss of 25 differ by 2e-6)."""
    return abs(loss - reference) <= 1e-6 * max(1.0, abs(reference))


def max_loss_difference(losses: list[float], reference: list[float]) -> float:
    """max |loss - reference| over the steps both have."""
    n = min(len(losses), len(reference))
    if n == 0:
        raise ValueError("losses: nothing to compare")
    return max(abs(a - b) for a, b in zip(losses[:n], reference[:n]))


def parity_tolerance(plan: Plan) -> float:
    """The largest max |loss - reference| a correct plan shows: fp32 agrees to ~5e-7, bf16 rounds."""
    return 1e-4 if plan.precision == "fp32" else 0.05


PARITY_MAX_REFERENCE_PARAMS = 200_000_000
# The proxy that stands in for a bigger model: a few small layers of the same family.
PROXY_HEAD_DIM = 16
PROXY_VOCAB = 512
PROXY_SEQ_LEN = 64
# Config keys that hold one entry per layer (transformers checks their length against the layers).
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


@dataclass(frozen=True)
class Parity:
    """One plan's loss-parity check against the single-process reference.

    A check that could not run (proxy not buildable, proxy trial failed, reference crashed)
    did not show that the plan trains correctly, so it fails, and `reason` says why.
    """

    passed: bool
    max_abs_loss_diff: float  # math.inf when nothing could be compared
    reason: str = ""  # why it failed; empty when it passed within the tolerance (said when within the model's
    # own rounding sensitivity instead: rounding_sensitivity)
    proxy: dict[str, Any] | None = None  # the proxy's shape (model overrides) when one stood in
    # What was compared (the plan's per-step losses, or its proxy's; the reference's): the sweep
    # report draws them. Empty where the check stopped before it had them.
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    # "as configured", or "deterministic": the model draws random numbers in training (dropout,
    # router jitter: `switched_off`), which no two layouts draw alike, so both sides of the check
    # ran with them off; the plan's measured steps keep the model's own settings.
    mode: str = "as configured"
    switched_off: dict[str, float] = field(default_factory=dict)

    def to_record(self, label: str, key: str) -> dict[str, Any]:
        """One entry of parity.json (math.inf and NaN as null: JSON has neither)."""
        return {"label": label, "key": key, "passed": self.passed, "max_abs_loss_diff": _finite(self.max_abs_loss_diff),
                "losses": [_finite(v) for v in self.losses], "reference_losses": [_finite(v) for v in self.reference_losses],
                "proxy": self.proxy, "reason": self.reason, "parity_mode": self.mode,
                "switched_off": self.switched_off}


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Config fields that draw random numbers in training: dropout probabilities of every kind
# (attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, attn_pdrop, activation_dropout,
# layerdrop, ...) and routers' jitter (Mixtral's and PhiMoE's router_jitter_noise, input_jitter_noise).
_STOCHASTIC = re.compile(r"drop|jitter", re.I)


def stochastic_settings(config: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The config's fields (sub-configs' too, as `text_config.x`) that make training draw random
    numbers, with their values: those above 0."""
    found: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            found.update(stochastic_settings(value, f"{prefix}{key}."))
        elif (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
              and _STOCHASTIC.search(key)):
            found[f"{prefix}{key}"] = value
    return found


def deterministic_plan(plan: Plan) -> tuple[Plan, dict[str, float]]:
    """The plan with every dropout and router jitter of its model off (model_overrides), and what
    was switched off ({} and the plan itself when the model draws nothing)."""
    settings = stochastic_settings(load_config_dict(plan.model, plan.model_overrides))
    if not settings:
        return plan, {}
    overrides = dict(plan.model_overrides)
    for path in settings:
        head, _, leaf = path.rpartition(".")
        if not head:
            overrides[leaf] = 0.0
        else:  # a sub-config: the whole dict, its field zeroed
            base = load_config_dict(plan.model, plan.model_overrides)
            node = overrides.setdefault(head.split(".")[0], dict(base.get(head.split(".")[0]) or {}))
            for part in head.split(".")[1:]:
                node = node.setdefault(part, {})
            node[leaf] = 0.0
    return plan.with_changes(model_overrides=overrides), settings


def proxy_shape(plan: Plan) -> dict[str, Any]:
    """Model overrides that shrink the plan's model to a CPU-sized proxy on which the plan stays valid.

    The proxy keeps the family (model_type and every other config key, GQA or not) and is sized
    to the plan's degrees: heads and KV heads multiples of tp, vocab divisible by tp, at least as
    many layers as pipeline stages, hidden = heads x a small head dim.
    """
    config = load_config_dict(plan.model, plan.model_overrides)
    sizes = config_sizes(config)
    heads, kv_heads, layers = sizes.heads, sizes.kv_heads, sizes.layers
    tp = plan.tp
    grouped = heads > kv_heads
    # kv_heads is a multiple of tp (the plan is valid) and so is the rounded bound: so is their minimum.
    proxy_kv = min(kv_heads, _round_up(2 if grouped else 4, tp))
    proxy_heads = proxy_kv * 2 if grouped else proxy_kv
    hidden = proxy_heads * PROXY_HEAD_DIM
    stages = plan.pp * (2 if plan.pp_schedule == "interleaved_1f1b" else 1)
    proxy_layers = max(2, stages)
    # Tokens from a tokenizer can be any id of the model's vocab (already divisible by tp).
    vocab = sizes.vocab if plan.data.tokenizer is not None else _round_up(PROXY_VOCAB, tp)
    shape: dict[str, Any] = {"num_hidden_layers": proxy_layers, "hidden_size": hidden,
                             ffn_width_key(config): 2 * hidden, "num_attention_heads": proxy_heads,
                             "vocab_size": vocab}
    if "num_key_value_heads" in config or grouped:  # families without GQA (GPT-NeoX, OPT) have no such key
        shape["num_key_value_heads"] = proxy_kv
    if "head_dim" in config:
        shape["head_dim"] = PROXY_HEAD_DIM
    for key in PER_LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, list) and len(value) == layers:
            shape[key] = [value[i % layers] for i in range(proxy_layers)]
    shape.update(_moe_proxy_shape(config, hidden, proxy_layers))
    return shape


# Mixture-of-experts widths and layouts a proxy shrinks (the experts' count and top-k stay: ep must
# still divide them, and the routing is the family's): expert and shared-expert widths, DeepSeek's
# multi-head latent attention ranks and head dims.
MOE_WIDTH_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size")
MLA_PROXY = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": PROXY_HEAD_DIM, "qk_nope_head_dim": 8,
             "v_head_dim": 16}  # DeepSeek derives head_dim from the rope head dim: the proxy's 16 too


def _moe_proxy_shape(config: dict[str, Any], hidden: int, proxy_layers: int) -> dict[str, Any]:
    """The MoE part of a proxy: small experts, and at least one MoE layer among the proxy's
    (DeepSeek's first_k_dense_replace dense layers, Qwen-MoE's mlp_only_layers, cut to fit)."""
    from paratune.config.degrees import routed_expert_count

    # many experts (DeepSeek-V3's 256, Qwen3-MoE's 128) keep their count: each one narrower instead
    experts = routed_expert_count(config) or 1
    width = max(16, 2 * hidden * min(16, experts) // experts)
    shape: dict[str, Any] = {key: width for key in MOE_WIDTH_KEYS if config.get(key)}
    if isinstance(config.get("first_k_dense_replace"), int):
        shape["first_k_dense_replace"] = min(config["first_k_dense_replace"], proxy_layers - 1)
    if isinstance(config.get("mlp_only_layers"), list):
        shape["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < proxy_layers - 1]
    if config.get("kv_lora_rank"):  # multi-head latent attention
        shape.update({k: v for k, v in MLA_PROXY.items() if k in config and (config[k] or k != "q_lora_rank")})
        shape.pop("head_dim", None)  # DeepSeek derives it (the rope head dim)
    return shape


def parity_proxy(plan: Plan) -> Plan:
    """The same plan (strategy, degrees, batch split, precision) on the proxy model, short and cheap.

    Raises PlanError if even the sized proxy breaks a plan rule (winner_parity turns that into
    a failed check)."""
    from paratune.model.checkpoints import weights_folder

    folder = weights_folder(plan.model)  # the proxy's shapes are not the checkpoint's: random init
    model = {} if folder is None else {"model": str(folder / "config.json")}
    return plan.with_changes(**model, model_overrides={**plan.model_overrides, **proxy_shape(plan)},
                             seq_len=min(plan.seq_len, PROXY_SEQ_LEN), warmup_steps=1, measure_steps=2,
                             grad_accum=plan.grad_accum)


def winner_parity(plan: Plan | dict[str, Any], result: TrialResult) -> Parity:
    """Whether the plan's per-step losses match the single-process reference on the same global
    batch (max difference within parity_tolerance): the one judge of the sweep's winner and of
    `paratune trial --parity`.

    For a model too big to train on the driver's CPU, the same plan is re-run on a proxy sized
    to the plan (parity_proxy) and that run is compared instead. Never raises: the sweep's finish
    calls it after the last trial, and an exception there would lose the whole sweep's winner.
    """
    shape, step = None, "loading the plan"
    losses: list[float] = []
    reference: list[float] = []
    off: dict[str, float] = {}
    try:
        plan = plan if isinstance(plan, Plan) else load_plan_dict(plan)
        step = "switching off the model's random draws"
        plan, off = deterministic_plan(plan)
        step, what = "building the model", ""
        if parameter_counts(build_config(plan.model, plan.model_overrides))["total"] > PARITY_MAX_REFERENCE_PARAMS:
            step = "sizing the proxy"
            shape = proxy_shape(plan)
            plan = parity_proxy(plan)
            step = "building the proxy"
            size = parameter_counts(build_config(plan.model, plan.model_overrides))["total"]
            if size > PARITY_MAX_REFERENCE_PARAMS:
                return Parity(False, math.inf, f"proxy has {size:,} parameters, over the "
                              f"{PARITY_MAX_REFERENCE_PARAMS:,} a reference on the driver's CPU allows", shape)
            step, what = "running the proxy trial", "proxy trial"
        elif off:  # the measured trial drew dropout masks no reference repeats: the plan again, without them
            step, what = "running the plan without its random draws", "trial without dropout / router jitter"
        if what:  # a trial of the check's own
            result = run_trial(plan)
            if not result.ok:
                message = f"{what} failed: {result.reason}: {result.message or ''}"
                return Parity(False, math.inf, message[:2000], shape, list(result.losses), mode=_mode(off),
                              switched_off=off)
        losses = list(result.losses)
        step = "running the reference"
        reference = list(reference_losses(plan, steps=len(losses)))
        diff = max_loss_difference(losses, reference)
    except Exception as err:  # noqa: BLE001 - any check that cannot run is a failed check, with its reason
        message = f"parity check failed while {step}: {type(err).__name__}: {err}"
        return Parity(False, math.inf, message[:2000], shape, losses, reference, _mode(off), off)
    tolerance = parity_tolerance(plan)
    if not math.isfinite(diff):
        return Parity(False, math.inf, "a loss is not finite", shape, losses, reference, _mode(off), off)
    if diff <= tolerance:
        return Parity(True, diff, "", shape, losses, reference, _mode(off), off)
    sensitivity = _amplified_rounding(plan, losses, reference)
    if diff <= sensitivity:
        return Parity(True, diff, f"max |loss - reference| {diff:.3g} is over {tolerance:g} but within the "
                      f"{sensitivity:.3g} the reference itself moves when its initial weights move by fp32 rounding: "
                      f"this model amplifies rounding at lr {plan.lr:g} (the first losses agree)", shape, losses,
                      reference, _mode(off), off)
    return Parity(False, diff, f"max |loss - reference| {diff:.3g} over tolerance {tolerance:g}", shape, losses,
                  reference, _mode(off), off)


def _amplified_rounding(plan: Plan, losses: list[float], reference: list[float]) -> float:
    """The reference's own rounding sensitivity where the first losses agree (the same model before any
    update: a layout that computes another model never passes this way); 0 where they do not, or
    where the check cannot run (the plan then fails on its difference, as before)."""
    if not first_losses_agree(losses[0], reference[0]):
        return 0.0
    try:
        return rounding_sensitivity(plan, len(losses), reference=reference)
    except Exception:  # noqa: BLE001 - no figure: the plain tolerance decides
        return 0.0


def _mode(off: dict[str, float]) -> str:
    return "deterministic" if off else "as configured"
