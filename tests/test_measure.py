"""The arithmetic of tokens/s/GPU, step-time spread, FLOPs per token and MFU."""

import pytest

from paratune.config import devices
from paratune.costs import measure
from paratune.model.build import build_config, parameter_counts, parameter_layout
from paratune.config.plan import load_plan_dict
from paratune.cluster.trial import summarize


def test_tokens_per_second_per_gpu_from_a_known_window():
    # 4 steps of 8 x 128 tokens in 2.0 s total on 2 workers: 4096 tokens / 2 s / 2 GPUs.
    assert measure.tokens_per_second_per_gpu(8 * 128, [0.4, 0.6, 0.5, 0.5], 2) == pytest.approx(1024.0)


def test_step_stats_median_and_spread():
    stats = measure.step_stats([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats.median == 3.0 and stats.p10 == pytest.approx(1.4) and stats.p90 == pytest.approx(4.6)
    assert stats.spread == pytest.approx((4.6 - 1.4) / 3.0)
    with pytest.raises(ValueError, match="step_times: empty"):
        measure.step_stats([])


def test_summarize_uses_only_measured_steps_and_every_worker():
    plan = load_plan_dict({"global_batch": 8, "micro_batch": 2, "seq_len": 64, "num_workers": 2})
    raw = {"losses": [5.0, 4.9, 4.8], "step_times_s": [0.25, 0.25, 0.5], "device": "NVIDIA H100 80GB HBM3",
           "peak_memory_bytes": [10, 12]}
    result = summarize(plan, raw, flops_tok=1e9)
    assert result.tokens_per_s_per_gpu == pytest.approx(3 * 8 * 64 / (1.0 * 2))
    assert result.step_time_median_s == 0.25
    assert result.mfu == pytest.approx(result.tokens_per_s_per_gpu * 1e9 / 67e12)  # fp32 peak of an H100
    assert result.data_wait_share is None  # not measured: not invented
    waited = summarize(plan, {**raw, "data_wait_s": [0.05, 0.05, 0.25]}, flops_tok=1e9)
    assert waited.data_wait_s == 0.05 and waited.data_wait_share == pytest.approx(0.35 / 1.0)


def test_parameter_counts_match_published_sizes():
    assert parameter_counts(build_config("llama3-8b"))["total"] == 8_030_261_248
    assert parameter_counts(build_config("llama3-70b"))["total"] == 70_553_706_496
    qwen = parameter_counts(build_config("qwen2.5-7b"))
    assert qwen["total"] == 7_615_616_512
    tied = parameter_counts(build_config("llama3.2-1b"))  # tied head: stored once, computed anyway
    assert tied["compute"] == tied["total"]


def test_flops_per_token_by_hand_for_llama3_8b():
    # Hand count, GQA and SwiGLU included: per layer q,o = 2*4096*4096, k,v = 2*4096*1024,
    # MLP = 3*4096*14336, norms 2*4096; plus final norm 4096 and the untied head 4096*128256.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    n = 32 * per_layer + 4096 + 4096 * 128256
    expected = 6 * n + 12 * 32 * 32 * 128 * 8192
    assert measure.model_flops_per_token(build_config("llama3-8b"), 8192) == expected


# ---- mixture of experts: N in 6N counts what a token goes through, memory counts everything ----
def _config(tmp_path, name: str, **fields) -> str:
    """A config.json from public shapes (never the hub), as a user points paratune at one."""
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder / "config.json")  # a folder is a pretrained model (weights required): the file


def test_mixtral_8x7b_counts_the_top2_experts_for_flops_and_all_8_for_memory(tmp_path):
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads / 8 KV heads (head_dim
    # 128), intermediate 14336, vocab 32000, untied, 8 local experts, top-2. Published: 46.7B, 12.9B active.
    path = _config(tmp_path, "mixtral", model_type="mixtral", hidden_size=4096, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                   num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    h, kv, inter, vocab = 4096, 8 * 128, 14336, 32000
    attention = 2 * h * h + 2 * h * kv  # q, o; k, v (no biases)
    expert = 3 * h * inter  # gate, up, down
    norms, router = 2 * h, 8 * h
    embedding = vocab * h
    total = 32 * (attention + norms + router + 8 * expert) + h + 2 * embedding
    active = 32 * (attention + norms + router + 2 * expert) + h + 2 * embedding
    counts = parameter_counts(build_config(path))
    assert (counts["total"], counts["active"]) == (total, active)
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
    assert counts["compute"] == active - embedding  # the head is a matmul, the embedding a lookup
    # MFU was overstated by (total - embedding) / (active - embedding) on the 6N term:
    assert (total - embedding) / counts["compute"] == pytest.approx(3.65, abs=0.01)
    expected = 6 * (active - embedding) + 12 * 32 * 32 * 128 * 4096
    assert measure.model_flops_per_token(build_config(path), 4096) == expected


def test_qwen3_moe_counts_8_of_128_experts(tmp_path):
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 heads / 4 KV heads, head_dim 128, per-head
    # q/k norms, moe_intermediate 768, 128 experts, top-8, vocab 151936, untied. Published: 30.5B, 3.3B active.
    path = _config(tmp_path, "qwen3_moe", model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                   moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                   tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    h, q, kv = 2048, 32 * 128, 4 * 128
    attention = 2 * h * q + 2 * h * kv + 2 * 128  # q, o; k, v; q_norm, k_norm over head_dim
    expert, router, norms = 3 * h * 768, 128 * h, 2 * h
    embedding = 151936 * h
    total = 48 * (attention + norms + router + 128 * expert) + h + 2 * embedding
    active = 48 * (attention + norms + router + 8 * expert) + h + 2 * embedding
    counts = parameter_counts(build_config(path))
    assert (counts["total"], counts["active"], counts["compute"]) == (total, active, active - embedding)
    assert round(total / 1e9, 1) == 30.5 and round((total - 2 * embedding) / 1e9, 1) == 29.9  # non-embedding
    assert round(active / 1e9, 2) == 3.35  # "A3B" (the model card: 3.3B activated)


def test_deepseek_v3_counts_shared_experts_and_its_dense_first_layers(tmp_path):
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers of which the first 3 dense (intermediate
    # 18432), then 256 routed experts (moe_intermediate 2048, top-8) + 1 shared expert; MLA attention (q_lora
    # 1536, kv_lora 512, 128 heads, nope/rope/v head dims 128/64/128); vocab 129280, untied. Published:
    # 671B parameters, 37B activated (the multi-token-prediction module, which transformers does not build,
    # excluded).
    path = _config(tmp_path, "deepseek_v3", model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61,
                   num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                   moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                   first_k_dense_replace=3, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                   tie_word_embeddings=False)
    h, heads = 7168, 128
    attention = (h * 1536 + 1536 + 1536 * heads * (128 + 64)  # q_a, its norm, q_b
                 + h * (512 + 64) + 512 + 512 * heads * (128 + 128)  # kv_a (+ rope key), its norm, kv_b
                 + heads * 128 * h)  # o
    norms, expert = 2 * h, 3 * h * 2048
    dense_layer = attention + norms + 3 * h * 18432
    moe_total = attention + norms + 256 * h + 256 * expert + expert  # router, routed, shared
    moe_active = attention + norms + 256 * h + 8 * expert + expert
    embedding = 129280 * h
    total = 3 * dense_layer + 58 * moe_total + h + 2 * embedding
    active = 3 * dense_layer + 58 * moe_active + h + 2 * embedding
    config = build_config(path)
    counts = parameter_counts(config)
    assert (counts["total"], counts["active"], counts["compute"]) == (total, active, active - embedding)
    assert round(total / 1e9) == 671 and round(active / 1e9, 1) == 37.6
    # the blocks differ (dense, MoE): one "layer" is their mean, so layer x layers is what they hold
    layout = parameter_layout(config)
    assert layout["largest_layer"] == moe_total and layout["layers"] == 61
    assert 0 <= layout["layer"] * 61 - (3 * dense_layer + 58 * moe_total) < 61


def test_dbrx_flattened_experts_count_4_of_16(tmp_path):
    # databricks/dbrx-base config.json: d_model 6144, 40 layers, 48 heads / 8 KV heads (head_dim 128, one
    # fused Wqkv), 16 experts of ffn_hidden_size 10752, top-4, vocab 100352, untied, LayerNorms without bias.
    # Published: 132B total, 36B active. transformers keeps the experts flattened ([16 x 10752, 6144] per
    # matrix) in DbrxExperts' child: no per-expert axis to read, the module's count is used.
    path = _config(tmp_path, "dbrx", model_type="dbrx", d_model=6144, n_layers=40, n_heads=48, vocab_size=100352,
                   max_seq_len=32768, tie_word_embeddings=False,
                   attn_config={"kv_n_heads": 8, "rope_theta": 500000, "clip_qkv": 8},
                   ffn_config={"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4})
    d = 6144
    fixed = (d + 2 * 8 * 128) * d + d * d + 2 * d + 16 * d  # Wqkv, out_proj, 2 norms, router
    expert = 3 * 10752 * d
    embedding = 100352 * d
    counts = parameter_counts(build_config(path))
    assert counts["total"] == 40 * (fixed + 16 * expert) + d + 2 * embedding
    assert counts["active"] == 40 * (fixed + 4 * expert) + d + 2 * embedding
    assert round(counts["total"] / 1e9) == 132 and round(counts["active"] / 1e9) == 36


def test_qwen2_moe_shared_expert_and_its_gate_are_always_active(tmp_path):
    # Qwen1.5-MoE-shaped at hidden 64: 8 experts (moe_intermediate 32), top-2, one shared expert
    # (shared_expert_intermediate 128) behind a sigmoid gate (1 x hidden), untied, vocab 512, 2 layers.
    path = _config(tmp_path, "qwen2_moe", model_type="qwen2_moe", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                   shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, vocab_size=512,
                   tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    h = 64
    attention = 4 * h * h + 3 * h  # q, k, v, o; q/k/v biases (Qwen2)
    routed, shared = 3 * h * 32, 3 * h * 128 + h  # one expert; the shared expert and its gate
    fixed = attention + 2 * h + 8 * h + shared  # + norms, router
    embedding = 512 * h
    counts = parameter_counts(build_config(path))
    assert counts["total"] == 2 * (fixed + 8 * routed) + h + 2 * embedding
    assert counts["active"] == 2 * (fixed + 2 * routed) + h + 2 * embedding


def test_dense_models_have_every_parameter_active():
    for name in ("llama3-8b", "qwen2.5-7b", "tiny-phi3", "tiny-gemma2"):
        counts = parameter_counts(build_config(name))
        assert counts["active"] == counts["total"]


def test_mfu_against_the_dense_peak():
    peak = devices.device_peak_flops("NVIDIA H200", "bf16")
    assert peak == 989e12  # dense, never the sparsity figure
    assert measure.mfu(5000.0, 6e10, peak) == pytest.approx(5000 * 6e10 / 989e12)
    assert devices.device_peak_flops("cpu", "bf16") is None
    assert measure.mfu(5000.0, 6e10, None) is None
    assert devices.device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12


# --------------------------------------------------------------------------- device names
import json  # noqa: E402
from pathlib import Path  # noqa: E402

GPU_DATA = Path(__file__).parent / "data" / "gpu"
DEVICE_NAMES = json.loads((GPU_DATA / "device_names.json").read_text())["devices"]


@pytest.mark.parametrize("entry", DEVICE_NAMES, ids=lambda e: e["name"])
def test_device_names_match_exactly(entry):
    model = devices.gpu_model(entry["name"])
    if entry["model"] is None:  # unknown: no model and no peak, never a near match
        assert model is None and devices.device_peak_flops(entry["name"], "bf16") is None
        return
    assert model == devices.GpuModel(entry["model"], entry["memory_gb"])
    peaks = devices.GPU_PEAK_TFLOPS[entry["model"]]
    assert devices.device_peak_flops(entry["name"], "fp32") == peaks["fp32"] * 1e12


def test_an_l40_is_not_an_l4_and_a100_sizes_share_one_peak():
    # Substring matching took "NVIDIA L40" for the L4 entry: MFU ~1.5x too high.
    assert devices.device_peak_flops("NVIDIA L40", "bf16") == 181e12  # L40 datasheet: 181.05 dense (362.1 sparse)
    assert devices.device_peak_flops("NVIDIA L40", "fp32") == 90.5e12
    assert devices.device_peak_flops("NVIDIA L4", "bf16") == 121e12
    assert devices.device_peak_flops("NVIDIA L40S", "bf16") == 362e12
    assert devices.device_peak_flops("NVIDIA A10", "bf16") == 125e12  # not the A10G, not the A100
    for name in ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"):
        assert devices.device_peak_flops(name, "bf16") == 312e12
    assert devices.device_peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert devices.device_peak_flops("NVIDIA H100 80GB HBM3", "fp8") is None  # a precision without a peak


# --------------------------------------------------------------------------- communication share
# One FSDP2 step as a CUDA profile lists it (names exactly as CUPTI/Kineto write them), on a 10 ms
# step. Host side: c10d's labels, record_param_comms, FSDP's copy-in, the launches (they return
# immediately, their kernels run later). Device side: NCCL >= 2.19 kernels (ncclDevKernel_*), an
# older NCCL's (ncclKernel_*), compute and copy kernels, and the GPU-row copy of a c10d label.
STEP_US = 10_000.0
CUDA_STEP = [
    ("FSDP::all_gather_copy_in", 800.0, 950.0, False),
    ("nccl:_all_gather_base", 900.0, 1100.0, False),
    ("c10d::_allgather_base_", 905.0, 1095.0, False),
    ("record_param_comms", 0.0, 9900.0, False),
    ("cudaLaunchKernelExC", 950.0, 960.0, False),
    ("aten::mm", 1200.0, 1300.0, False),
    ("nccl:_all_gather_base", 1000.0, 5000.0, True),  # GPU user annotation: spans launches, not a kernel
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)"
     "::OpaqueType<4u>, unsigned int, 1, 128, 1>(...)", 820.0, 940.0, True),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1000.0, 3000.0, True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", 1500.0, 6000.0, True),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2500.0, 4000.0, True),
    ("Memcpy DtoD (Device -> Device)", 4100.0, 4200.0, True),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 6000.0, 6500.0, True),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 8000.0, 9000.0, True),
]


def test_cuda_comm_share_counts_device_nccl_kernels_only():
    # NCCL kernels: [1000, 3000] and [2500, 4000] overlap (two streams) -> 3000 us once;
    # SendRecv 500 us; the old-NCCL all-reduce 1000 us. 4500 us of a 10 ms step.
    assert measure.comm_share_from_events(CUDA_STEP, STEP_US / 1e6, "cuda") == pytest.approx(0.45)
    # Host-side launch spans alone are no communication on CUDA.
    host_only = [e for e in CUDA_STEP if not e[3]]
    assert measure.comm_share_from_events(host_only, STEP_US / 1e6, "cuda") == 0.0


def test_async_tps_symmetric_memory_transfers_count_as_communication():
    """Async TP moves its tp traffic with torch's symmetric memory, not NCCL: peer copies of the
    copy engine and kernels of c10d::symmetric_memory, overlapping the fused matmuls. They count
    (their union with NCCL's); the matmuls they overlap do not. Names from torch's sources and
    CUPTI's naming of peer copies: not yet seen in a real async-TP profile."""
    step = [("Memcpy PtoP (Device -> Device)", 0.0, 300.0, True),
            ("void c10d::symmetric_memory::barrier_kernel<(c10d::symmetric_memory::...)>", 250.0, 400.0, True),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0.0, 900.0, True),
            ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 900.0, 1000.0, True),
            ("symm_mem::fused_all_gather_matmul", 0.0, 950.0, False)]  # the host op: a launch span
    assert measure.comm_share_from_events(step, 0.002, "cuda") == pytest.approx(0.25)  # [0, 400] + [900, 1000]


def test_overlapping_kernels_are_counted_once_and_the_share_is_capped():
    same = [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0.0, 600.0, True),
            ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 100.0, 500.0, True),
            ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 600.0, 1000.0, True)]
    assert measure.comm_share_from_events(same, 0.002, "cuda") == pytest.approx(0.5)  # [0, 1000] of 2 ms
    assert measure.comm_share_from_events(same, 0.0005, "cuda") == 1.0
    assert measure.comm_share_from_events(same, 0.0, "cuda") == 0.0


def test_cpu_comm_share_keeps_the_gloo_host_spans():
    gloo_step = [measure.ProfileEvent("c10d::allreduce_", 90.0, 610.0, False),
                 measure.ProfileEvent("gloo:all_reduce", 100.0, 600.0, False),
                 measure.ProfileEvent("record_param_comms", 95.0, 605.0, False),
                 measure.ProfileEvent("aten::mm", 700.0, 900.0, False)]
    assert measure.comm_share_from_events(gloo_step, 0.001, "cpu") == pytest.approx(0.52)  # [90, 610]
    # The CUDA step read as gloo: its host spans (record_param_comms covers 0-9900 us).
    assert measure.comm_share_from_events(CUDA_STEP, STEP_US / 1e6, "cpu") == pytest.approx(0.99)
    with pytest.raises(ValueError, match="device_type: got 'xpu'; allowed: 'cpu', 'cuda'"):
        measure.comm_share_from_events(gloo_step, 0.001, "xpu")


def test_comm_share_from_a_real_profile():
    """A torch.profiler profile on CPU: a host span labelled as gloo's collective counts on 'cpu'
    and is no communication on 'cuda' (it is not a device kernel)."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        with record_function("gloo:all_reduce"):
            time.sleep(0.05)
        time.sleep(0.05)
        seconds = time.perf_counter() - t0
    events = measure.profile_events(prof)
    assert any(e.name == "gloo:all_reduce" and not e.on_device for e in events)
    assert measure.comm_share_from_profile(prof, seconds, "cpu") == pytest.approx(0.5, abs=0.15)
    assert measure.comm_share_from_profile(prof, seconds, "cuda") == 0.0


def test_stop_rule_waits_for_its_steps_then_stops_only_outside_both_noise_bands():
    from paratune.costs.measure import TrialStopRule

    # 1,000 tokens per step on 2 GPUs: a 1 s step is 500 tokens/s/GPU.
    # The incumbent's band is half its spread (as the verdict's), here 15%: its floor is 850.
    rule = TrialStopRule(incumbent_tokens_per_s_per_gpu=1000.0, incumbent_spread=0.30, min_steps=2)
    assert not rule.cannot_reach(1000, [2.0], 2)  # one step is not evidence
    assert rule.cannot_reach(1000, [1.0, 1.0], 2)  # 500 x 1.05 < 850
    # Within the bands: 0.62 s -> 806 tokens/s/GPU, raised by 5% (847)... just below: stops;
    # 0.6 s -> 833, raised by 5% (875) > 850: it runs on.
    assert rule.cannot_reach(1000, [0.62, 0.62], 2)
    assert not rule.cannot_reach(1000, [0.6, 0.6], 2)
    # Its own spread widens its band (half its range): a fast step among slow ones keeps it alive.
    assert not rule.cannot_reach(1000, [0.7, 1.2], 2)
    assert rule.upper_bound(1000, [0.7, 1.2], 2) == pytest.approx(1000 / (0.7 * 2) * (1 + (1.2 - 0.7) / 0.95 / 2))
    # The bands never go under the 5% floor: a quiet incumbent's floor is 950.
    assert TrialStopRule(1000.0, 0.02).incumbent_floor() == pytest.approx(950)
    text = rule.explain(1000, [1.0, 1.0], 2, planned=5)
    assert "after 2 of 5 measured steps" in text and "850" in text
