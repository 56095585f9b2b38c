"""The cost model of the levers (issue 28): checkpointing modes, the loss's form, float8, compile,
async TP, in memory (paratune.costs.activations/memory) and in the roofline (paratune.costs.estimate), the
device table's FP8 peaks and the device refusals; torchtitan's published plans predicted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import traced_as_real

from paratune.costs.activations import _traced_coefficients, _with_vocab, activation_coefficients
from paratune.config.devices import GPU_FP8_TFLOPS, get_device, gpu_model, has_fp8
from paratune.costs.efficiency import float8_flops_share, recompute_share
from paratune.costs.estimate import compute_seconds, estimate
from paratune.costs.memory import estimate_memory, memory_moments
from paratune.model.build import build_config, config_key
from paratune.config.plan import load_plan_dict
from paratune.model.shapes import HeldParams, float8_cast_bytes, model_shape

ROOT = Path(__file__).resolve().parents[1]


def _tiny(**kw):
    base = {"model": "tiny-llama", "seq_len": 64, "global_batch": 2, "micro_batch": 2, "num_workers": 1,
            "device": "cpu"}
    return load_plan_dict({**base, **kw})


def _gpu(**kw):
    base = {"model": "llama3-8b", "seq_len": 8192, "global_batch": 16, "micro_batch": 2, "num_workers": 8,
            "gpus_per_node": 8, "strategy": "fsdp", "fsdp": {"sharding": "full"}, "precision": "bf16",
            "device": "cuda", "warmup_steps": 2}
    return load_plan_dict({**base, **kw})


# --------------------------------------------------------------------------- memory
def test_selective_trace_is_what_a_real_micro_batch_holds_and_lies_between_none_and_full():
    """Selective checkpointing is traced with the runtime's policy (SAVED_OPS through
    create_selective_checkpoint_contexts) on fake tensors: equal to the same micro-batch on real
    tensors at every phase, and it saves less than none and more than full."""
    key = config_key(build_config("tiny-llama"))
    traced = traced_as_real("selective")
    none, full = (_traced_coefficients(key, mode, "fp32", 2, 64) for mode in ("none", "full"))
    assert full.per_layer < traced.per_layer < none.per_layer
    # It keeps at least the matmuls' outputs (q, o, down: h; k, v: the kv width; gate, up: the MLP's) in fp32.
    shape = model_shape(_tiny())
    kv = shape.kv_heads * shape.head_dim
    assert traced.per_layer >= 4 * (3 * shape.hidden + 2 * kv)


def test_checkpointing_savings_match_the_cpu_probes_memtracker():
    """bench/results/levers_cpu_probe.md (its script, bench/probes/levers/sac_check.py, is in git at df094a6): a Llama of hidden 256,
    4 layers, 4 x 256 tokens, fp32, one process, PyTorch's MemTracker peak per mode: none 157.6,
    selective 124.1, every 2nd block 118.1 MiB. What each mode saves against none, predicted:
    the same to 0.1 MiB (the totals differ by DDP's buckets, which the probe did not have)."""
    over = {"vocab_size": 2000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
            "tie_word_embeddings": False}
    plan = dict(model_overrides=over, seq_len=256, global_batch=4, micro_batch=4, precision="fp32")
    peak = {m: estimate_memory(_tiny(activation_checkpointing=m, **plan)).total / 2**20
            for m in ("none", "selective", "layers")}
    assert peak["none"] - peak["selective"] == pytest.approx(157.6 - 124.1, abs=0.15)
    assert peak["none"] - peak["layers"] == pytest.approx(157.6 - 118.1, abs=0.15)


def test_every_nth_block_mixes_the_none_and_full_traces_by_the_recomputed_share():
    """layers with checkpoint_every N: transformers recomputes blocks 0, N, 2N...: ceil(L/N) of L.
    With 4 blocks and N 2, block 0 (the fit's per-token part) and 1 of the other 3."""
    over = {"num_hidden_layers": 4}
    layers = activation_coefficients(_tiny(activation_checkpointing="layers", model_overrides=over))
    none, full = (activation_coefficients(_tiny(activation_checkpointing=m, model_overrides=over)) for m in ("none", "full"))
    assert layers.per_layer == pytest.approx(full.per_layer / 3 + none.per_layer * 2 / 3)
    assert layers.phases["loss"].per_token == full.phases["loss"].per_token
    totals = [estimate_memory(_tiny(activation_checkpointing=m, model_overrides=over)).activations
              for m in ("none", "layers", "full")]
    assert totals[0] > totals[1] > totals[2]
    every4 = activation_coefficients(_tiny(activation_checkpointing="layers", checkpoint_every=4, model_overrides=over))
    assert every4.per_layer == pytest.approx(none.per_layer)  # only block 0 recomputed


def test_logits_bytes_are_linear_in_the_vocabulary_and_the_same_for_every_checkpointing():
    """What `_logits_sharded` relies on: the bytes per token per vocabulary entry, from traces at
    V and 2V, are whole numbers of buffers, equal at 3V (linear), and the same whatever the
    checkpointing (one wider trace serves every mode)."""
    key = config_key(build_config("tiny-llama"))
    v = build_config("tiny-llama").vocab_size
    base = {m: _traced_coefficients(key, m, "fp32", 2, 64) for m in ("none", "selective", "full")}

    def slopes(mode: str, times: int) -> dict[str, float]:
        wide = _traced_coefficients(_with_vocab(key, times * v), mode, "fp32", 2, 64, (1,))
        return {p: (wide.phases[p].per_token - base[mode].phases[p].per_token) / ((times - 1) * v) for p in wide.phases}

    s2 = slopes("full", 2)
    assert s2 == pytest.approx(slopes("full", 3), abs=1e-6)
    assert s2["loss"] == pytest.approx(12.0) and s2["blocks"] == 0.0  # fp32 logits, log-probs, their gradient
    for mode in ("none", "selective"):
        assert slopes(mode, 2) == pytest.approx(s2, abs=1e-6)


def test_vocab_parallel_and_chunked_losses_hold_a_share_of_the_logits():
    v = model_shape(_tiny()).vocab
    tp = dict(num_workers=2, tp=2, strategy="fsdp", fsdp={"sharding": "full"})
    standard, sharded = (activation_coefficients(_tiny(loss=form, **tp)) for form in ("standard", "auto"))
    # 12 bytes per token and vocabulary entry at the loss's start (fp32): 1/tp of them under vocab_parallel.
    assert standard.phases["loss"].per_token - sharded.phases["loss"].per_token == pytest.approx(12.0 * v / 2)
    assert standard.per_layer == sharded.per_layer
    from paratune.levers.loss import chunk_tokens

    shape = model_shape(_tiny())
    tokens = _tiny().micro_batch * _tiny().seq_len
    chunk = chunk_tokens(tokens, shape.vocab, shape.hidden)  # the runtime's chunk size
    assert chunk < tokens, (chunk, tokens)
    whole, chunked = (activation_coefficients(_tiny(loss=form)) for form in ("standard", "chunked"))
    assert whole.phases["loss"].per_token - chunked.phases["loss"].per_token == pytest.approx(
        12.0 * v * (1 - chunk / tokens))


def test_the_70b_tp8_default_loss_keeps_the_logits_sharded():
    """Llama-3-70B, TP 8 + SP, micro-batch 16 of 8192 tokens: the standard loss gathers the
    fp32 logits (16 x 8192 x 128256) on every rank; the default (auto: vocab_parallel) holds 1/8.
    (The formula model here: the same logits terms, no trace.)"""
    plan = dict(model="llama3-70b", seq_len=8192, global_batch=512, micro_batch=16, num_workers=256, gpus_per_node=8,
                tp=8, sequence_parallel=True, strategy="fsdp", fsdp={"sharding": "full"}, precision="bf16",
                device="cuda", activation_checkpointing="full")
    standard, auto = (estimate_memory(load_plan_dict({**plan, "loss": form}), "formula") for form in ("standard", "auto"))
    logits = 16 * 8192 * 128256 * 4
    assert standard.total - auto.total >= 7 / 8 * logits  # at least one fp32 buffer of them, 7/8 gone


def test_float8_casts_and_the_float8_all_gather():
    """torchao 0.18 saves the bf16 input and weight for backward (float8_linear.py:45), so float8
    adds one linear's casts at a time; FSDP2's float8 all-gather gathers the blocks in 1 byte."""
    fsdp = dict(num_workers=2, global_batch=4, strategy="fsdp", fsdp={"sharding": "full"}, precision="bf16")
    plain, f8, f8_ag = (_tiny(**fsdp, **kw) for kw in ({}, {"float8": "tensorwise"},
                                                       {"float8": "tensorwise", "float8_all_gather": True}))
    shape = model_shape(plain)
    assert float8_cast_bytes(plain, shape) == 0.0 < float8_cast_bytes(f8_ag, shape) < float8_cast_bytes(f8, shape)
    m0, m1, m2 = (memory_moments(p) for p in (plain, f8, f8_ag))
    assert m1["loss"].activations - m0["loss"].activations == pytest.approx(float8_cast_bytes(f8, shape))
    block = HeldParams.of(plain, shape).layer
    assert m1["gather"].weights - m2["gather"].weights == pytest.approx(block)  # 2 -> 1 byte a gathered parameter
    assert m1["loss"].weights - m2["loss"].weights == pytest.approx(block)  # the prefetched last block


# --------------------------------------------------------------------------- roofline
def test_the_roofline_counts_recompute_float8_compile_and_async_tp():
    h100 = get_device("h100-80gb")
    none = compute_seconds(_gpu(), h100)
    assert compute_seconds(_gpu(activation_checkpointing="full"), h100) == pytest.approx(none * 4 / 3)
    assert compute_seconds(_gpu(activation_checkpointing="layers"), h100) == pytest.approx(none * (1 + 16 / 32 / 3))
    assert 0 < recompute_share(_gpu(activation_checkpointing="selective")) < 1e-3  # no matmul recomputed
    f8 = float8_flops_share(_gpu(float8="tensorwise"))
    assert 0.65 < f8 < 0.8  # every block linear; the head (6%) and attention at 8k tokens (21%) stay bf16
    assert compute_seconds(_gpu(float8="tensorwise"), h100) == pytest.approx(none * ((1 - f8) + f8 * 989 / 1979))
    assert compute_seconds(_gpu(compile=True), h100) == pytest.approx(none * 0.9)
    tp = dict(num_workers=16, global_batch=32, tp=8, sequence_parallel=True, compile=True)
    sync, fused = (estimate(_gpu(**tp, async_tp=a), h100) for a in (False, True))
    assert fused.time.exposed_comm_s < sync.time.exposed_comm_s
    e = estimate(_gpu(float8="tensorwise"), h100)
    flops = e.mfu_vs_bf16_peak * 989e12 / e.time.tokens_per_s_per_gpu
    assert e.summary()["predicted_mfu_vs_bf16_peak"] == e.mfu_vs_bf16_peak and flops == pytest.approx(
        6 * model_shape(e.plan).compute + 12 * 32 * 32 * 128 * 8192, rel=1e-6)


def test_fp8_peaks_and_device_refusals():
    for name, peak in (("h100-80gb", 1979), ("h200-141gb", 1979), ("b200-180gb", 4500), ("l40s-48gb", 733),
                       ("l4-24gb", 242)):
        assert get_device(name).tflops["fp8"] == peak and has_fp8(get_device(name))
    for name in ("a100-80gb", "a10g-24gb", "cpu"):
        assert not has_fp8(get_device(name))
    assert gpu_model("AMD Instinct MI300X").key == "mi300x" and GPU_FP8_TFLOPS["mi300x"] == 2615
    a100 = estimate(_gpu(float8="tensorwise"), get_device("a100-80gb"))
    assert not a100.fits and "sm_89" in a100.refusal and a100.overflow.startswith("refused on a100-80gb")
    assert estimate(_gpu(float8="tensorwise"), get_device("h100-80gb")).refusal is None
    cpu_cluster = load_plan_dict({"model": "tiny-llama", "seq_len": 64, "global_batch": 2, "micro_batch": 1,
                                  "num_workers": 2, "tp": 2, "sequence_parallel": True, "compile": True,
                                  "async_tp": True, "warmup_steps": 1})  # device auto
    refused = estimate(cpu_cluster, get_device("cpu"))
    assert not refused.fits and "async_tp" in refused.refusal


# --------------------------------------------------------------------------- torchtitan's plans
TORCHTITAN = {"llama3_8b_fsdp8.yaml": 8532, "llama3_70b_fsdp32_tp8.yaml": 876, "llama3_405b_fsdp8_tp8_pp8.yaml": 128}


@pytest.mark.parametrize("name", sorted(TORCHTITAN))
def test_torchtitans_published_plans_are_predicted_by_paratune_plan(name, tmp_path, capsys):
    """Each of plans/torchtitan/ through `paratune plan` on their H100s (96 GB): it fits, with a
    speed; the figure torchtitan published is in the plan's comment (the report compares them)."""
    from paratune.cli import main

    out = tmp_path / "plan.json"
    path = ROOT / "plans" / "torchtitan" / name
    code = main(["plan", str(path), "--device", "h100-96gb-grand-teton", "--devices",
                 str(ROOT / "plans" / "torchtitan" / "devices.yaml"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (row,) = json.loads(out.read_text())
    assert row["fits"] and 0 < row["predicted_peak_memory_gib"] < 96
    assert row["predicted_tokens_per_s_per_gpu"] > 0 and "compiled" in printed and "levers:" in printed
    assert f"{TORCHTITAN[name]:,}" in path.read_text()
    print(f"{name}: predicted {row['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
          f"{row['predicted_peak_memory_gib']:.1f} GiB; torchtitan {TORCHTITAN[name]:,}")
    assert math.isfinite(row["predicted_mfu_vs_bf16_peak"])
