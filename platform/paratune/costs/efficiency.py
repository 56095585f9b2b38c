"""Achieved compute rates on a GPU: what a step's matmuls, attention and memory-bound ops cost.

The roofline (paratune.costs.estimate) used to divide all of a plan's FLOPs, the recomputed forward
included, by one share of the dense peak (DESIGN's reference MFU, 0.4). Here each kind of work
goes at the rate a public kernel benchmark measures for it on that GPU, and the step reaches a
stated share of those rates end to end (TRAINING_SHARE, from a public training run outside the
corpus the model is judged on, bench/published/):

- matmuls (every linear, forward and backward, recomputed forwards included): the GPU's maximum
  achievable matmul FLOP/s (MAMF_SHARE: Stas Bekman's ml-engineering "Maximum Achievable Matmul
  FLOPS comparison table", measured with mamf-finder.py); float8's converted linears `f8_speedup`
  times faster (torchao's float8 H100 linear benchmark and its Llama-3-8B training table);
- attention: causal FlashAttention-2 (what torch's SDPA runs on these GPUs) at the TFLOP/s its
  authors measured by sequence length (ATTENTION_TFLOPS: FlashAttention-3 paper, H100 SXM5,
  head dim 128), counting the FLOPs a causal kernel does (half the scores; backward 2.5x forward);
- memory-bound ops (norms, activations, residual adds, rotary, casts, the loss over the vocabulary):
  their bytes at the GPU's HBM bandwidth (datasheets, SUSTAINED_HBM of it): each saved activation
  written and read in forward, its gradient written and read in backward (eager, TRAFFIC_EAGER);
  compiled blocks fuse the chains between matmuls (TRAFFIC_COMPILED).

A device without these figures (the CPU entry, a user's device without `gpu` or
`memory_gbps`) keeps the old roofline: FLOPs over DEFAULT_COMPUTE_EFFICIENCY of its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratune.config.devices import Device
from paratune.config.plan import Plan
from paratune.model.shapes import ModelShape, mlp_width, model_shape

# DESIGN.md's reference MFU (~40%): the roofline's prior where a device has no kernel figures.
DEFAULT_COMPUTE_EFFICIENCY = 0.4

# Maximum achievable matmul FLOP/s (BF16, no sparsity) over the datasheet's dense peak, by GPU
# model: ml-engineering compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison
# table" (mamf-finder.py): A100 SXM 267.9 / 312 (85.9%), GH200 821.0 / 989 (83.0%), H100 SXM
# 792.1 / 989 (80.1%); H200 and H800 share H100 SXM's SMs and clocks; the PCIe/NVL forms are
# taken at H100 SXM's share of their own (lower-clocked) peaks.
MAMF_SHARE: dict[str, float] = {
    "h100-sxm": 792.1 / 989, "h100-pcie": 792.1 / 989, "h100-nvl": 792.1 / 989, "h200": 792.1 / 989,
    "h200-nvl": 792.1 / 989, "h800": 792.1 / 989, "h800-pcie": 792.1 / 989, "gh200": 821.0 / 989,
    "a100": 267.9 / 312, "a800": 267.9 / 312,
}

# HBM bandwidth per GPU model, GB/s (NVIDIA datasheets): what memory-bound ops stream at.
HBM_GBPS: dict[str, float] = {
    "h100-sxm": 3350.0, "h100-pcie": 2000.0, "h100-nvl": 3900.0, "h200": 4800.0, "h200-nvl": 4800.0,
    "h800": 3350.0, "h800-pcie": 2000.0, "gh200": 4000.0, "a100": 2039.0, "a800": 2039.0,
    "b200": 8000.0, "l40s": 864.0, "l40": 864.0, "l4": 300.0, "a10": 600.0, "a10g": 600.0,
}
# A streaming kernel's share of the datasheet bandwidth (STREAM-style copy/triad on an H100 80GB
# HBM3: ~3.0 of 3.35 TB/s).
SUSTAINED_HBM = 0.9

# The architecture a GPU model's kernel figures come from: the attention curve measured on it and
# the training run its share of the kernel rates is read from (REFERENCE_RUNS). A GPU model not
# listed takes Hopper's, scaled by its own peak (said where it is used).
ARCHITECTURE: dict[str, str] = {
    "h100-sxm": "hopper", "h100-pcie": "hopper", "h100-nvl": "hopper", "h200": "hopper", "h200-nvl": "hopper",
    "h800": "hopper", "h800-pcie": "hopper", "gh200": "hopper", "a100": "ampere", "a800": "ampere",
}

# The share of a link's bandwidth a ring collective reaches (NCCL's bus bandwidth over the line
# rate), by architecture: Hopper's NVLink4, "450GB/s is the line rate. With the protocol overhead
# (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (an NCCL maintainer,
# NVIDIA/nccl-tests#212); Ampere's NVLink3, ~230 GB/s all-reduce bus bandwidth of 300 on 8 A100s
# (NVIDIA/nccl-tests#175: 232.54 GB/s). Across nodes NCCL reaches 46-48 of a 400 Gb/s NIC's 50 GB/s
# (NVIDIA/nccl-tests#290), more than NVLink's share: the NVLink figure is the one taken. A device of
# another architecture (and the CPU entry) keeps LINK_SHARE_PRIOR, which a sweep refits.
LINK_SHARE: dict[str, float] = {"hopper": 370.0 / 450.0, "ampere": 232.54 / 300.0}
LINK_SHARE_PRIOR = 0.7  # unmeasured: TimeConstants' old default, kept as a prior that sweeps refit

# Causal FlashAttention-2, head dim 128, BF16, TFLOP/s at sequence lengths 512..16k, FLOPs counted
# as a causal kernel does them (half the scores; backward 2.5x forward). Longer sequences: the 16k
# figure (the kernel has plateaued by 8k); shorter: the 512 one.
# - hopper, H100 80GB SXM5: FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), Figure 5
#   (forward, causal) and Figure 6 (backward), the FlashAttention-2 line;
# - ampere, A100 80GB SXM4: FlashAttention-2 paper (Dao 2023, arXiv:2307.08691), Figure 4(d),
#   "Attention forward + backward speed", causal, head dim 128, the FlashAttention-2 line (the
#   repository's assets/flash2_a100_fwd_bwd_benchmark.png): forward and backward together, so one
#   curve stands for both directions (their FLOPs over it give the measured time).
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TFLOPS: dict[str, dict[str, tuple[float, ...]]] = {
    "hopper": {"fwd": (191.0, 260.0, 298.0, 319.0, 333.0, 335.0),
               "bwd": (214.0, 260.0, 291.0, 310.0, 318.0, 322.0)},
    "ampere": {"fwd": (99.0, 133.0, 155.0, 173.0, 182.0, 189.0),
               "bwd": (99.0, 133.0, 155.0, 173.0, 182.0, 189.0)},
}
# The dense BF16 peak of the GPU each curve was measured on (H100 SXM5, A100 SXM4): a device of
# the same architecture at another peak (H100 PCIe, a 500 W H100) scales the curve by its own.
ATTENTION_PEAK: dict[str, float] = {"hopper": 989.0, "ampere": 312.0}
# FlashAttention's backward does 2.5x the forward's FLOPs (it recomputes the scores: 5 matmuls to 2).
ATTENTION_BACKWARD_FLOPS = 2.5

# Bytes of memory traffic per byte of a block's saved activations: eager, each is written by the
# op that makes it and read by the next in forward, and in backward it is read and its gradient
# written and read again (4); compiled blocks fuse the elementwise chains between matmuls, so
# what is left is the write in forward and the read in backward (2).
TRAFFIC_EAGER = 4.0
TRAFFIC_COMPILED = 2.0
# The loss over the vocabulary, bytes per logit per token (transformers' ForCausalLMLoss: bf16
# logits upcast to fp32, log-softmax, its gradient, cast back): write 2, cast 2 + 4, log-softmax
# 4 + 4, nll 4; backward: 4, log-softmax backward 8 + 4, cast 4 + 2.
LOSS_BYTES_PER_LOGIT = 38.0
# FSDP2's copies around its collectives, bytes per parameter a rank holds (gathered) per
# micro-batch (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): each all-gather's
# output copied out into the parameters (`foreach_all_gather_copy_out`: read 2 + write 2, bf16),
# and the gradients copied into the reduce-scatter input in the reduce dtype (`foreach_reduce`:
# read 2 bf16, write 4 fp32).
FSDP_COPY_OUT_BYTES = 4.0
FSDP_COPY_IN_BYTES = 6.0

# float8 linears (torchao, compiled): forward + backward of a linear against bf16's, casts and
# scales included. Tensorwise: torchao/float8/README.md "Performance" (H100), M, K, N = 1024,
# 2048, 1024: 0.80; 4096, 8192, 16384: 1.39 (interpolated in log(M K N) between them, held
# beyond). Rowwise: from the README's Llama-3-8B training table (8x H100, torchtitan): tensorwise
# +25.0% and rowwise +10.1% end to end; with the tensorwise linears 1.39x faster, linears are
# g = 0.713 of that step (1 / 1.25 = 1 - g + g / 1.39), so rowwise's linears ran 1 / ((1 / 1.101
# - 1 + g) / g) = 1.15x faster; taken as rowwise's large-shape figure, scaled like tensorwise's.
F8_TENSORWISE_POINTS = ((1024 * 2048 * 1024, 0.80), (4096 * 8192 * 16384, 1.39))
F8_ROWWISE_LARGE = 1.15

# The share of the compute-bound kernels' rates (matmuls, attention) an end-to-end training step
# reaches (launch gaps, the optimizer, collectives taking SMs, clocks under a mixed load), per
# architecture, each read from one public training run on that architecture, outside the corpus
# the model is judged on (bench/published/: these runs are replayed there as `reference` rows and
# judge nothing). Memory-bound ops are not divided by it: they are timed at a measured streaming
# rate of their own (SUSTAINED_HBM), as are FSDP2's copies.
# - hopper: torchao/float8/README.md's training table, Llama-3-8B on 8 H100s, torchtitan, FSDP2,
#   compile, per-op SAC (torchtitan's policy, paratune's `selective_op`), bf16, batch 1 x
#   8192: 6,150 tokens/s per GPU. Its H100s are the 96 GB HBM2e kind (the benchmark script's log in
#   pytorch/ao#1802 reads "memory: 40.25GiB(42.37%)": a 95 GiB device), the table's `h100-96gb`.
# - ampere: the FlashAttention-2 paper's (arXiv:2307.08691) Table 1, GPT3-1.3B at 2k context on 8
#   A100 80GB SXM4, FlashAttention-2: 196 TFLOP/s a GPU, its FLOPs 6 N + 12 L h s a token (N with
#   the embeddings: 1,315,723,264 for this GPT-2 config) = 21,533 tokens/s a GPU; the paper's code
#   (training/configs/experiment/pile/gpt3xl-flash.yaml): DDP + ZeRO-1, 8 sequences a GPU, 512 a
#   step, fused dense + GELU and dropout + add + LayerNorm (as a compiled block), no recompute.
# `reference_training_share(architecture)` recomputes each from its run.
REFERENCE_RUNS: dict[str, dict] = {
    "hopper": {"plan": {"model": "llama3-8b", "num_workers": 8, "global_batch": 8, "micro_batch": 1,
                        "seq_len": 8192, "strategy": "fsdp", "fsdp": {"sharding": "full"},
                        "activation_checkpointing": "selective_op", "compile": True, "precision": "bf16",
                        "device": "cuda", "gpus_per_node": 8},
               "device": "h100-96gb", "tokens_per_s": 6150.0},
    "ampere": {"plan": {"model": {"model_type": "gpt2", "n_embd": 2048, "n_head": 16, "n_layer": 24,
                                  "n_positions": 2048, "vocab_size": 50257, "activation_function": "gelu_new",
                                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                  "tie_word_embeddings": True},
                        "num_workers": 8, "global_batch": 512, "micro_batch": 8, "seq_len": 2048,
                        "strategy": "zero", "zero": {"stage": 1}, "compile": True, "precision": "bf16",
                        "device": "cuda", "gpus_per_node": 8},
               "device": "a100-80gb", "tokens_per_s": 196e12 / (6 * 1_315_723_264 + 12 * 24 * 2048 * 2048)},
}
# Each architecture's share as reference_training_share(architecture) computes it (rounded; a test
# holds them equal).
TRAINING_SHARE: dict[str, float] = {"hopper": 0.646, "ampere": 0.776}


@dataclass(frozen=True)
class ComputeParts:
    """Seconds one rank computes per step at the kernels' rates, by kind, and the total the
    step reaches: the compute-bound kernels (matmuls, attention) over `share`, the memory-bound
    ops at their streaming rate."""

    matmul_s: float
    attention_s: float
    memory_s: float
    share: float

    @property
    def kernels_s(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s

    @property
    def seconds(self) -> float:
        return (self.matmul_s + self.attention_s) / self.share + self.memory_s


def hbm_gbps(device: Device) -> float | None:
    """The device's memory bandwidth (GB/s): its table entry's `memory_gbps`, else its GPU model's."""
    return device.memory_gbps or (HBM_GBPS.get(device.gpu) if device.gpu else None)


def has_kernel_rates(device: Device) -> bool:
    """Whether the device has the figures this model needs (a GPU model with a MAMF share and a
    memory bandwidth); else the roofline keeps DEFAULT_COMPUTE_EFFICIENCY of the peak."""
    return bool(device.gpu in MAMF_SHARE and hbm_gbps(device) and device.tflops.get("bf16"))


def architecture(device: Device) -> str:
    """The architecture whose kernel figures the device takes (ARCHITECTURE; Hopper's, scaled by
    the device's own peak, for a GPU model not listed)."""
    return ARCHITECTURE.get(device.gpu or "", "hopper")


def link_share(device: Device) -> float:
    """The share of its links' bandwidth a ring collective reaches on the device (LINK_SHARE by
    architecture; LINK_SHARE_PRIOR for a device without a figure)."""
    return LINK_SHARE.get(ARCHITECTURE.get(device.gpu or "", ""), LINK_SHARE_PRIOR)


def attention_tflops(device: Device, seq: int, direction: str) -> float:
    """Causal FlashAttention-2's TFLOP/s on the device at a sequence length: its architecture's
    measured curve (ATTENTION_TFLOPS) scaled by the device's bf16 peak over the one it was
    measured on, interpolated in log(sequence)."""
    arch = architecture(device)
    curve = ATTENTION_TFLOPS[arch][direction]
    s = min(max(seq, ATTENTION_SEQ[0]), ATTENTION_SEQ[-1])
    x = math.log2(s)
    xs = [math.log2(v) for v in ATTENTION_SEQ]
    i = max(0, min(len(xs) - 2, next((k for k in range(len(xs) - 1) if x <= xs[k + 1]), len(xs) - 2)))
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return (curve[i] + t * (curve[i + 1] - curve[i])) * device.tflops["bf16"] / ATTENTION_PEAK[arch]


def f8_speedup(plan: Plan, shape: ModelShape) -> float:
    """How much faster a float8 linear (forward + backward) runs than bf16, at the plan's largest
    linear on a rank (the MLP's: tokens of a micro-batch x hidden x MLP width / tp)."""
    if plan.float8 == "none":
        return 1.0
    m = plan.micro_batch * plan.seq_len // plan.cp
    size = m * shape.hidden * max(shape.hidden, mlp_width(shape)) / plan.tp
    (s0, v0), (s1, v1) = F8_TENSORWISE_POINTS
    t = min(1.0, max(0.0, (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))))
    tensorwise = v0 + t * (v1 - v0)
    if plan.float8 == "rowwise":
        return max(v0, tensorwise * F8_ROWWISE_LARGE / v1)
    return tensorwise


# Families whose blocks have a plain (ungated) MLP: fc, activation, fc.
PLAIN_MLP_FAMILIES = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "gpt_bigcode", "phi",
                                "codegen", "mpt", "starcoder2"})


def gated_mlp(plan: Plan) -> bool:
    """Whether the plan's model has a gated MLP (gate, up, down: Llama and its kin) rather than a
    plain one (GPT-2's fc, activation, fc), from its config's model_type."""
    import json

    from paratune.model.shapes import model_config_key

    return json.loads(model_config_key(plan)).get("model_type") not in PLAIN_MLP_FAMILIES


def layer_activation_bytes(shape: ModelShape, gated: bool = True) -> float:
    """Bytes (16-bit) a decoder block saves per token without recompute, flash attention (no
    scores kept): the attention half's residual input, norm output, q, k, v and attention output
    (4h + 2 kv), the MLP half's residual input and norm output (2h) and its intermediates: a gated
    MLP's gate, up, activation and product (4 x width), a plain one's hidden and activation (2 x
    width). Korthikanti et al. 2022's 34 s b h (GPT, 4h MLP) counts the same tensors plus
    dropout masks."""
    h = shape.hidden
    kv = (shape.kv_heads or shape.heads) * shape.head_dim
    # the parameters a token goes through in a block (a mixture of experts: its top-k experts')
    active = min(shape.layer, max(0.0, shape.compute - (shape.head or shape.embedding)) / shape.layers)
    attention = 2 * h * h + 2 * h * kv
    if gated:
        mlp = 4 * max(0.0, (active - attention - 2 * h) / (3 * h))
    else:  # a plain MLP's two matrices are 2 h w of the block's parameters (biases aside)
        mlp = 2 * max(0.0, (active - attention) / (2 * h))
    return 2.0 * (4 * h + 2 * kv + 2 * h + mlp)


# --------------------------------------------------------------------------- FLOPs
def recompute_share(plan: Plan, shape: ModelShape | None = None) -> float:
    """FLOPs the checkpointing recomputes, as a share of the model's (forward + backward = 3x
    the forward). full: every block's forward again (1/3); layers: ceil(L/N) of a stage's L
    blocks (`activations._every_nth_block`); selective: only the ops outside SAVED_OPS, counted
    per token and block: 2 RMSNorms (~5h each), SwiGLU's silu and product (~5 x MLP width),
    rotary on q and k (~3 x their width), 2 residual adds (h): no matmul, ~1e-4 of the FLOPs
    (their cost is memory-bound time: `compute_parts` counts their bytes); selective_op
    (torchtitan's op policy, paratune.parallel.recompute) those and every second matmul of a
    block's forward (k, o and up in a Llama block: 2 (h kv + q h + h f) a token; attention kept)."""
    from paratune.costs.measure import flops_per_token

    ac = plan.activation_checkpointing
    if ac == "full":
        return 1 / 3
    shape = shape or model_shape(plan)
    if ac == "layers":
        blocks = math.ceil(shape.layers / plan.pp)
        return math.ceil(blocks / plan.checkpoint_every) / blocks / 3
    if ac in ("selective", "selective_op"):
        h, q = shape.hidden, shape.heads * shape.head_dim
        k = (shape.kv_heads or shape.heads) * shape.head_dim
        f = mlp_width(shape)
        per_block = 10 * h + 5 * f + 3 * (q + k) + 2 * h
        if ac == "selective_op":  # + every second matmul of the block's forward: k, o and up (or fc2)
            per_block += 2 * (h * k + q * h + h * f)
        total = flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)
        return shape.layers * per_block / total
    return 0.0


def float8_flops_share(plan: Plan, shape: ModelShape | None = None) -> float:
    """The share of the model's FLOPs in the matmuls the float8 lever converts: the linears of the
    decoder blocks (torchao's convert_to_float8_training, the LM head filtered out, as torchtitan
    does), 6 FLOPs a parameter a token, less those a per-rank dimension keeps in bf16 (no multiple
    of 16 after the tp split: `converted_linear_share`); the head and attention's scores stay bf16."""
    from paratune.costs.measure import flops_per_token

    if plan.float8 == "none":
        return 0.0
    shape = shape or model_shape(plan)
    head = shape.head or shape.embedding  # the head's matmul (tied: the embedding's weight)
    converted = 6.0 * max(0.0, shape.compute - head - shape.layers * 2 * shape.hidden)  # minus the norms
    converted *= converted_linear_share(plan)
    return converted / flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)


def converted_linear_share(plan: Plan) -> float:
    """The share of the blocks' linear FLOPs torchao converts at the plan's tp, by the workers' own
    rule on the model's meta copy (paratune.parallel.float8.label_share, cached per model and tp);
    1 where the model cannot be built here."""
    from paratune.parallel.float8 import label_share

    share = label_share({"model": plan.model, "model_overrides": plan.model_overrides, "tp": plan.tp, "ep": plan.ep})
    return 1.0 if share is None else share


def step_flops(plan: Plan, shape: ModelShape | None = None, imbalance: float | None = None) -> tuple[float, float]:
    """(model FLOPs one rank computes per step, the recomputed ones included; the attention
    scores' part of them): 6N + 12 L H Q T a token (paratune.costs.measure.flops_per_token) over the
    rank's share of the step's tokens, x (1 + `recompute_share`). LoRA: no weight-gradient
    matmuls for the frozen base (2N of 6N), the adapters' 6N. Under ep the busiest rank's
    experts compute `imbalance` x the mean tokens (paratune.costs.moe.expert_flops_share)."""
    from paratune.model.adapters import adapter_counts
    from paratune.costs.measure import flops_per_token
    from paratune.costs.moe import DEFAULT_IMBALANCE, expert_flops_share

    shape = shape or model_shape(plan)
    flops = flops_per_token(shape.compute, shape.layers, shape.heads, shape.head_dim, plan.seq_len)
    attention = 12.0 * shape.layers * shape.heads * shape.head_dim * plan.seq_len
    if plan.peft is not None:
        counts = adapter_counts(plan)
        flops += -2.0 * shape.compute + 6.0 * (counts.per_block * shape.layers + counts.root)
    scale = plan.tokens_per_step / plan.num_workers * (1 + recompute_share(plan, shape))
    total = flops * scale
    if plan.ep > 1:
        total *= 1 + expert_flops_share(plan) * max(0.0, (DEFAULT_IMBALANCE if imbalance is None else imbalance) - 1.0)
    return total, attention * scale


# --------------------------------------------------------------------------- a step at the kernels' rates
def compute_parts(plan: Plan, device: Device, shape: ModelShape | None = None,
                  flops: tuple[float, float] | None = None, again: float | None = None,
                  imbalance: float | None = None) -> ComputeParts:
    """A rank's step at the kernels' rates (the device must have them: `has_kernel_rates`).
    `flops`: `step_flops`' (all FLOPs with the recomputed ones, their attention part); `again`:
    forward passes computed again (full: 1; `layers`: the recomputed blocks' share; else 0)."""
    from paratune.levers import loss_form

    shape = shape or model_shape(plan)
    total, attention = flops if flops is not None else step_flops(plan, shape, imbalance)
    ac = plan.activation_checkpointing
    if again is None:
        again = 3 * recompute_share(plan, shape) if ac in ("full", "layers") else 0.0
    rate = device.tflops["bf16"] * 1e12 * MAMF_SHARE[device.gpu]
    matmul = max(0.0, total - attention)
    matmul_s = matmul / rate
    if plan.float8 != "none" and "fp8" in device.tflops:
        converted = min(matmul, float8_flops_share(plan, shape) * total)
        matmul_s -= converted / rate * (1 - 1 / f8_speedup(plan, shape))
    # attention: from the MFU count (12 L H Q T a token: forward 4, backward 8, non-causal) to a
    # causal kernel's work: a forward is half of 4 L H Q T, the backward 2.5x that
    forward = attention / (3 + again) / 2
    seq = max(1, plan.seq_len // plan.cp)
    attention_s = (forward * (1 + again) / (attention_tflops(device, seq, "fwd") * 1e12)
                   + ATTENTION_BACKWARD_FLOPS * forward / (attention_tflops(device, seq, "bwd") * 1e12))
    # memory-bound: a rank's tokens (its cp part of its dp group's sequences, all of them on each
    # tp rank) through its stage's blocks (their activations / tp: sequence-parallel or sharded
    # widths) and the loss; recompute (full, selective, layers) runs the forward's ops again
    tokens = plan.tokens_per_step * plan.tp * plan.pp / plan.num_workers
    traffic = TRAFFIC_COMPILED if plan.compile else TRAFFIC_EAGER
    forward_again = again if ac in ("full", "layers") else 1.0 if ac in ("selective", "selective_op") else 0.0
    blocks = (layer_activation_bytes(shape, gated_mlp(plan)) * math.ceil(shape.layers / plan.pp) / plan.tp
              * traffic * (1 + forward_again / 2))
    vocab = shape.vocab / plan.tp if loss_form(plan) == "vocab_parallel" else shape.vocab
    loss = LOSS_BYTES_PER_LOGIT * vocab / plan.pp  # the last stage's, over the stages
    memory_s = tokens * (blocks + loss) / (hbm_gbps(device) * 1e9 * SUSTAINED_HBM)
    return ComputeParts(matmul_s, attention_s, memory_s, TRAINING_SHARE[architecture(device)])


def fsdp_copy_seconds(plan: Plan, device: Device, shape: ModelShape | None = None) -> float:
    """Seconds a step spends on FSDP2's copies around its collectives (`fsdp_copy_bytes` a
    micro-batch at the HBM's streaming rate), on the compute stream: not hidden by prefetch. 0 on
    a device without kernel figures (its roofline has no memory bandwidth)."""
    if not has_kernel_rates(device) or plan.precision != "bf16":
        return 0.0
    shape = shape or model_shape(plan)
    return plan.grad_accum * fsdp_copy_bytes(plan, shape) / (hbm_gbps(device) * 1e9 * SUSTAINED_HBM)


def fsdp_copy_seconds_per_micro_batch(plan: Plan, device_name: str, shape: ModelShape | None = None) -> float:
    """FSDP2's copies of one micro-batch on a GPU known by its torch name (a profile's
    `device_name`, for paratune.costs.timemodel.compose): `fsdp_copy_bytes` at its model's HBM bandwidth
    (HBM_GBPS, SUSTAINED_HBM of it); 0 on a CPU, a GPU the table does not know, or a non-bf16 plan."""
    from paratune.config.devices import gpu_model

    model = gpu_model(device_name)
    gbps = HBM_GBPS.get(model.key) if model else None
    if not gbps or plan.precision != "bf16":
        return 0.0
    return fsdp_copy_bytes(plan, shape or model_shape(plan)) / (gbps * 1e9 * SUSTAINED_HBM)


def fsdp_copy_bytes(plan: Plan, shape: ModelShape) -> float:
    """HBM bytes FSDP2 moves per micro-batch around its collectives on a sharded plan: every
    gather's copy-out of the rank's (tp/pp-sliced) parameters, and their gradients' copy-in to
    the reduce-scatter; 0 without sharding (DDP's gradients are views of its buckets)."""
    from paratune.model.shapes import fsdp_shard_degree, local_params

    if plan.strategy != "fsdp" or plan.fsdp is None or fsdp_shard_degree(plan) <= 1:
        return 0.0
    gathers = 2 if plan.fsdp.reshards_after_forward else 1  # as paratune.costs.estimate.data_parallel_comm counts them
    held, _ = local_params(plan, shape)
    return held * (FSDP_COPY_OUT_BYTES * gathers + FSDP_COPY_IN_BYTES)


def reference_training_share(arch: str = "hopper") -> float:
    """An architecture's TRAINING_SHARE from its reference run (REFERENCE_RUNS): the compute-bound
    kernels' time at their rates over what is left of the published step once the memory-bound
    ops and FSDP2's copies (timed at their own rates) are taken out."""
    from paratune.config.devices import get_device
    from paratune.config.plan import Plan as _Plan

    run = REFERENCE_RUNS[arch]
    plan_dict = dict(run["plan"])
    if isinstance(plan_dict["model"], dict):  # a transformers config written where a plan can read it
        plan_dict["model"] = _config_file(plan_dict["model"])
    plan = _Plan.model_validate(plan_dict)
    shape = model_shape(plan)
    device = get_device(run["device"])
    parts = compute_parts(plan, device, shape)
    step = plan.tokens_per_step / plan.num_workers / run["tokens_per_s"]
    return (parts.matmul_s + parts.attention_s) / (step - parts.memory_s - fsdp_copy_seconds(plan, device, shape))


def _config_file(config: dict) -> str:
    """A config dict as a config.json under paratune's home (a plan's `model` is a name or a path)."""
    import hashlib
    import json

    from paratune.config.home import paratune_home

    text = json.dumps(config, sort_keys=True)
    path = paratune_home() / "reference_models" / f"{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(path)
