"""Loss parity, the one judge of whether a plan trains correctly: its losses against a single process.

The single-process reference trains the same model, data, optimizer and global batch on one CPU
process; a distributed plan is correct only if its first steps' losses match it, within
`parity_tolerance`, or, where the first losses agree, within the model's rounding envelope: a margin
over how far an ensemble of reference runs moves, step by step, when the initial weights move by fp32
rounding and the micro-batch split changes (`rounding_envelope`: a model that amplifies rounding at its
learning rate, e.g. CPM-Ant, is a chaotic process, and one perturbed run is no bound for another).
A model too big for the driver's CPU is judged on a proxy: the same plan on a few small layers of the
same family (`parity_proxy`). The sweep's winner (paratune.sweep.finish) and `paratune trial --parity`
are judged by the same `winner_parity`.
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


def reference_training(plan: Plan, steps: int | None = None, weight_noise: float = 0.0,
                       noise_draw: int = 0) -> tuple[list[float], torch.nn.Module]:
    """The single-process reference run: its per-step losses and the trained model (what every
    layout's exported weights are compared with). `weight_noise`: every initial weight scaled by
    (1 + weight_noise x a normal draw, the draw seeded by `noise_draw`), for rounding_envelope."""
    steps = plan.total_steps if steps is None else steps
    config = build_config(plan.model, plan.model_overrides)
    if plan.peft is not None:  # the same LoRA adapters, values and frozen base as every layout
        from paratune.model.adapters import build_adapted_model
        from paratune.model.checkpoints import checkpoint_sources

        model = build_adapted_model(config, plan, sources=checkpoint_sources(plan.model, config))
    else:
        model = build_model_with_weights(config, seed=plan.seed, weights=plan.model)  # a folder's pretrained values too
    if weight_noise:
        draws = torch.Generator().manual_seed(noise_draw)
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


# The rounding envelope of a model that amplifies fp32 rounding (paratune.sweep.parity.rounding_envelope).
# Its members: ENVELOPE_DRAWS independent draws of the initial weights x (1 + ROUNDING_SCALE x n), n ~ N(0, 1)
# (fp32's unit roundoff is 2^-24 = 6e-8: a layout's reduction order moves every sum by about that), and,
# where the global batch allows, the reference with another micro-batch split (other matmul shapes, so
# other kernel blockings and summation orders). The bound at each step is ENVELOPE_MARGIN x the largest
# deviation of a member at that step. Chosen on CPM-Ant's small plan under three CPU kernel sets (72 draws,
# resampled: 8 draws x 4 hold 99.5% of the others; the largest of 8 alone 83%, one draw alone 32%), and
# judged on rows that set nothing: 72 of 72 held-out draws and all 12 real ddp / fsdp layouts of CPM-Ant
# and Gemma-3n on the families bench's plan (bench/parity_envelope.py, bench/results/parity_envelope.md).
ROUNDING_SCALE = 1e-7
ENVELOPE_DRAWS = 8
ENVELOPE_MARGIN = 4.0


@dataclass(frozen=True)
class RoundingEnvelope:
    """How far the reference's own losses move, step by step, under roundings a layout also makes.

    `members` maps each perturbed reference run (how it was made) to its per-step |loss - reference|.
    A correct layout of a model that amplifies rounding is one more sample of the same process: its
    deviations lie within `margin` x the members' largest, step by step (the first loss is still held
    exact: before any update there is nothing to amplify)."""

    members: dict[str, list[float]]
    margin: float = ENVELOPE_MARGIN

    @property
    def spread(self) -> list[float]:
        """Per step: the largest deviation among the members."""
        steps = min(len(v) for v in self.members.values())
        return [max(v[s] for v in self.members.values()) for s in range(steps)]

    def bound(self, floor: float = 0.0) -> list[float]:
        """Per step: the largest |loss - reference| a correct layout shows (never below `floor`, the
        model's fixed tolerance)."""
        return [max(floor, self.margin * value) for value in self.spread]

    def steps_beyond(self, losses: list[float], reference: list[float], floor: float = 0.0) -> list[int]:
        """The steps whose |loss - reference| is beyond the bound (every step past the envelope's too)."""
        bound = self.bound(floor)
        return [s for s, (a, b) in enumerate(zip(losses, reference))
                if not abs(a - b) <= (bound[s] if s < len(bound) else 0.0)]

    def how(self) -> str:
        """How the bound was made, for the report."""
        draws = sum(1 for name in self.members if name.startswith("weights"))
        others = [name for name in self.members if not name.startswith("weights")]
        made = f"{draws} draws of the initial weights x (1 + {ROUNDING_SCALE:g} n)" + "".join(f", {o}" for o in others)
        return f"{self.margin:g} x the largest deviation, step by step, of {len(self.members)} perturbed references ({made})"

    def to_record(self, floor: float = 0.0) -> dict[str, Any]:
        return {"how": self.how(), "margin": self.margin, "spread": self.spread, "bound": self.bound(floor),
                "members": self.members}


def rounding_envelope(plan: Plan, steps: int, reference: list[float] | None = None, draws: int = ENVELOPE_DRAWS,
                      margin: float = ENVELOPE_MARGIN) -> RoundingEnvelope:
    """The ensemble of reference runs perturbed at the rounding scale (RoundingEnvelope): ~5e-7 on
    Llama-like models at lr 1e-2, so their fixed tolerance decides; models whose training amplifies
    rounding (CPM-Ant, Gemma-3n: 1e-3 to 1e-1 by the third loss) are held to it instead."""
    base = reference if reference is not None else reference_losses(plan, steps)

    def deviations(losses: list[float]) -> list[float]:
        return [abs(a - b) for a, b in zip(losses, base)]

    members = {f"weights draw {k}": deviations(reference_training(plan, steps, weight_noise=ROUNDING_SCALE,
                                                                     noise_draw=k)[0]) for k in range(draws)}
    split = _other_micro_batch(plan)
    if split is not None:
        members[f"micro-batch {split.micro_batch} instead of {plan.micro_batch}"] = deviations(
            reference_losses(split, steps))
    return RoundingEnvelope(members, margin)


def _other_micro_batch(plan: Plan) -> Plan | None:
    """The plan with another micro-batch on the same global batch (half, else double), or None where
    the plan's rules allow neither."""
    for micro in (plan.micro_batch // 2, plan.micro_batch * 2):
        if micro >= 1 and micro != plan.micro_batch and plan.global_batch % micro == 0:
            try:
                return plan.with_changes(micro_batch=micro)
            except ValueError:  # PlanError: this split breaks a rule (dp x micro-batch, pp's micro-batches)
                continue
    return None


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
    # rounding envelope instead: rounding_envelope)
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
    # A model that amplifies fp32 rounding is judged against its rounding envelope (RoundingEnvelope.to_record:
    # how it was made, per-step bound and spread, each member's deviations); None where the fixed tolerance decided.
    rounding_envelope: dict[str, Any] | None = None

    def to_record(self, label: str, key: str) -> dict[str, Any]:
        """One entry of parity.json (math.inf and NaN as null: JSON has neither)."""
        return {"label": label, "key": key, "passed": self.passed, "max_abs_loss_diff": _finite(self.max_abs_loss_diff),
                "losses": [_finite(v) for v in self.losses], "reference_losses": [_finite(v) for v in self.reference_losses],
                "proxy": self.proxy, "reason": self.reason, "parity_mode": self.mode,
                "switched_off": self.switched_off, "rounding_envelope": self.rounding_envelope}


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
    return _judge(plan, losses, reference, diff, shape, off)


def _judge(plan: Plan, losses: list[float], reference: list[float], diff: float,
           shape: dict[str, Any] | None = None, off: dict[str, float] | None = None,
           envelope: RoundingEnvelope | None = None) -> Parity:
    """The verdict: within the fixed tolerance; else, where the first losses agree, within the model's
    rounding envelope (`envelope`, or one made now) at every step; else failed."""
    off = off or {}
    tolerance = parity_tolerance(plan)
    if not math.isfinite(diff):
        return Parity(False, math.inf, "a loss is not finite", shape, losses, reference, _mode(off), off)
    if diff <= tolerance:
        return Parity(True, diff, "", shape, losses, reference, _mode(off), off)
    envelope, why_not = _amplified_rounding(plan, losses, reference, envelope)
    over = f"max |loss - reference| {diff:.3g} over tolerance {tolerance:g}"
    if envelope is None:
        return Parity(False, diff, over + why_not, shape, losses, reference, _mode(off), off)
    record = envelope.to_record(tolerance)
    beyond = envelope.steps_beyond(losses, reference, tolerance)
    if not beyond:
        return Parity(True, diff, f"{over}, but within this model's rounding envelope at every step (bound "
                      f"{_figures(record['bound'])}: {envelope.how()}): it amplifies fp32 rounding at lr {plan.lr:g}, "
                      f"and the first losses agree", shape, losses, reference, _mode(off), off, record)
    step = beyond[0]
    return Parity(False, diff, f"{over} and beyond this model's rounding envelope: step {step} is off by "
                  f"{abs(losses[step] - reference[step]):.3g}, bound {record['bound'][step]:.3g} ({envelope.how()})",
                  shape, losses, reference, _mode(off), off, record)


def parity_verdict(plan: Plan, losses: list[float], reference: list[float],
                   envelope: RoundingEnvelope | None = None) -> Parity:
    """winner_parity's verdict on losses already at hand (the families bench judges its layouts this way,
    several layouts against one `envelope`)."""
    return _judge(plan, losses, reference, max_loss_difference(losses, reference), envelope=envelope)


def _figures(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2g}" for v in values) + "]"


def _amplified_rounding(plan: Plan, losses: list[float], reference: list[float],
                        envelope: RoundingEnvelope | None = None) -> tuple[RoundingEnvelope | None, str]:
    """The reference's rounding envelope where the first losses agree (the same model before any
    update: a layout that computes another model never passes this way); None and why where they do
    not, or where the envelope cannot be made (the plan then fails on its difference, as before)."""
    if not first_losses_agree(losses[0], reference[0]):
        return None, f" (and the first losses differ: {losses[0]:.7g} against {reference[0]:.7g}, another model)"
    if envelope is not None:
        return envelope, ""
    try:
        return rounding_envelope(plan, len(losses), reference=reference), ""
    except Exception as err:  # noqa: BLE001 - no envelope: the plain tolerance decides
        return None, f" (the rounding envelope could not be made: {type(err).__name__}: {err})"[:400]


def _mode(off: dict[str, float]) -> str:
    return "deterministic" if off else "as configured"
