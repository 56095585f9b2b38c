"""The cost model: model-state accounting against DeepSpeed's own estimators and figures worked by
hand from docs/DESIGN.md, the traced activations, the time model's fit, and `paratune plan`."""

import pytest

from paratune.estimate import (
    GiB,
    TimeConstants,
    _time_terms,
    activation_coefficients,
    estimate,
    estimate_memory,
    fit_time_constants,
    get_device,
    model_shape,
    model_states,
)
from paratune.plan import load_plan_dict

P_8B = 8_030_261_248  # Llama-3-8B, counted from the architecture (test_measure checks it)


def _plan(**kw):
    base = {"model": "llama3-8b", "seq_len": 4096, "global_batch": 64, "micro_batch": 1, "num_workers": 8,
            "precision": "bf16", "device": "cuda"}
    return load_plan_dict({**base, **kw})


def _at_step(states) -> float:
    return states.weights + states.gradients + states.step_gradients + states.optimizer


@pytest.mark.parametrize("gpus", [8, 64])
def test_zero2_model_states_match_deepspeeds_estimator(gpus):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    plan = _plan(num_workers=gpus, global_batch=gpus, strategy="zero", zero={"stage": 2})
    assert model_shape(plan).total == P_8B
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P_8B, num_gpus_per_node=8, num_nodes=gpus // 8,
                                                      cpu_offload=False)
    # Same accounting: bf16 weights 2P, and per partition 2 (bf16 grads) + 4 (fp32 grads at the
    # step) + 4 (fp32 master) + 8 (moments) = 18P/N. The bucket buffers are paratune's extra.
    assert _at_step(model_states(plan)) == pytest.approx(ds_gpu, abs=8)


@pytest.mark.parametrize("gpus", [8, 32])
def test_zero3_model_states_match_deepspeeds_estimator_but_for_the_live_parameters(gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    plan = _plan(num_workers=gpus, global_batch=gpus, strategy="zero", zero={"stage": 3})
    shape = model_shape(plan)
    largest = max(shape.layer, shape.embedding, shape.head)  # the embedding (128256 x 4096)
    assert largest == shape.embedding == 525_336_576
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(P_8B, largest, num_gpus_per_node=8, num_nodes=gpus // 8,
                                                         cpu_offload=False, cpu_offload_params=False, zero_init=True)
    # Both: 18P/N (bf16 weights 2, fp32 gradients 4, fp32 master 4, moments 8). DeepSpeed's
    # estimator then adds 4 bytes x its largest layer in flight; paratune the bf16 parameters the
    # runtime keeps gathered (up to stage3_max_live_parameters = 1e9, plus the module in use).
    live = min(P_8B, 1_000_000_000 + largest)
    assert _at_step(model_states(plan)) == pytest.approx(ds_gpu - 4 * largest + 2 * live, abs=8)


def test_model_states_worked_by_hand_from_the_design():
    """DESIGN.md: mixed precision with AdamW is 16P; ZeRO-1 shards the 12P of optimizer state;
    FSDP full shard holds 16P/dp plus the layers in flight."""
    ddp = model_states(_plan(strategy="ddp"))  # autocast: fp32 weights 4P + fp32 grads 4P + moments 8P
    assert ddp.weights + ddp.gradients + ddp.optimizer == 16 * P_8B
    z1 = model_states(_plan(strategy="zero", zero={"stage": 1}))  # 2P + 2P + 12P/8 (ga = 8 > 1)
    assert z1.weights + z1.gradients + z1.optimizer == pytest.approx(2 * P_8B + 2 * P_8B + 12 * P_8B / 8)
    fsdp = model_states(_plan(strategy="fsdp", fsdp={"sharding": "full", "prefetch": 1}))
    shape = model_shape(_plan())
    gathered = 2 * (2 * shape.layer + shape.embedding + shape.head + shape.rest)  # bf16: block + prefetched + root
    assert fsdp.weights + fsdp.gradients + fsdp.optimizer == pytest.approx(16 * P_8B / 8 + gathered)
    # 16P = 128 GB: DDP of an 8B model cannot fit an 80 GB GPU, whatever the batch.
    e = estimate(_plan(strategy="ddp", activation_checkpointing="full"), get_device("h100-80gb"))
    assert not e.fits and "weights+grads+optimizer 119.7 GiB alone" in e.overflow


def test_traced_activations_match_what_checkpointing_keeps():
    """With full recompute a block keeps only its input: hidden x 4 bytes per token in fp32
    (DESIGN's 2·s·b·h at 16 bits); without it, far more (every matmul input, SwiGLU, attention)."""
    plan = load_plan_dict({"model": "small-llama", "seq_len": 128, "global_batch": 4, "micro_batch": 4,
                           "num_workers": 1, "activation_checkpointing": "full"})
    hidden = model_shape(plan).hidden
    assert activation_coefficients(plan).per_layer == 4 * hidden
    no_ckpt = activation_coefficients(plan.with_changes(activation_checkpointing="none"))
    assert no_ckpt.per_layer > 15 * hidden
    # Activations grow with micro-batch tokens, model states do not.
    small, big = estimate_memory(plan), estimate_memory(plan.with_changes(micro_batch=2, global_batch=2))
    assert small.activations == pytest.approx(2 * big.activations, rel=0.02)
    assert small.weights == big.weights and small.optimizer == big.optimizer


def test_the_formula_and_the_trace_agree_roughly():
    plan = _plan(strategy="fsdp", fsdp={"sharding": "full"}, activation_checkpointing="full")
    traced = estimate_memory(plan).activations
    formula = estimate_memory(plan, "formula").activations
    assert 0.5 < formula / traced < 2.0


def test_time_constants_are_recovered_from_measurements():
    device = get_device("h100-80gb")
    truth = TimeConstants(compute_efficiency=0.35, comm_efficiency=0.5, overhead_s=0.2, micro_batch_overhead_s=0.01)
    plans = [_plan(strategy=s, micro_batch=mb, num_workers=n, global_batch=n * per_gpu, seq_len=seq, **extra)
             for s, extra in (("ddp", {}), ("fsdp", {"fsdp": {"sharding": "full"}}), ("zero", {"zero": {"stage": 2}}))
             for n in (8, 16) for per_gpu, seq in ((2, 2048), (8, 4096)) for mb in (1, 2)]
    samples = []
    for plan in plans:
        compute, dp_s, mp_s, bubble = _time_terms(plan, device)
        samples.append((plan, compute / (1 - bubble) / 0.35 + (dp_s + mp_s) / 0.5 + 0.2 + 0.01 * plan.grad_accum))
    fitted = fit_time_constants(samples, device)
    assert fitted.compute_efficiency == pytest.approx(truth.compute_efficiency, rel=1e-6)
    assert fitted.comm_efficiency == pytest.approx(truth.comm_efficiency, rel=1e-6)
    assert fitted.overhead_s == pytest.approx(truth.overhead_s, abs=1e-9)
    assert fitted.micro_batch_overhead_s == pytest.approx(truth.micro_batch_overhead_s, abs=1e-9)
    assert fit_time_constants(samples[:1], device).fitted_on == 1  # one trial: only compute is fitted


def test_paratune_plan_ranks_the_70b_space_and_rejects_ddp(tmp_path, capsys):
    import json

    from paratune.cli import main

    out = tmp_path / "estimates.json"
    code = main(["plan", "search_spaces/llama3_70b_4x8.yaml", "--device", "h100-80gb", "--nodes", "4",
                 "--gpus-per-node", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "fastest first" in printed and "plans estimated in" in printed
    rows = json.loads(out.read_text())
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["predicted_peak_memory_gib"] <= 76 for r in fitting)
    speeds = [r["predicted_tokens_per_s_per_gpu"] for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    ddp = [r for r in rows if r["plan"]["strategy"] == "ddp"]
    assert ddp and not any(r["fits"] for r in ddp)
    assert all("weights+grads+optimizer" in r["overflow"] for r in ddp)
    assert "ddp" in printed and "weights+grads+optimizer" in printed
    assert all(r["predicted_weights_gib"] * GiB > 0 for r in rows)


def test_unknown_device_is_a_clear_error(capsys):
    from paratune.cli import main

    assert main(["plan", "search_spaces/llama3_70b_4x8.yaml", "--device", "tpu-v9"]) == 2
    assert "device: got 'tpu-v9'; allowed: a100-40gb" in capsys.readouterr().out


def test_offload_trades_memory_for_time():
    device = get_device("h100-80gb")
    plain = estimate(_plan(strategy="zero", zero={"stage": 3}), device)
    offloaded = estimate(_plan(strategy="zero", zero={"stage": 3, "offload_optimizer": True}), device)
    assert offloaded.memory.optimizer == 0 and offloaded.memory.total < plain.memory.total
    # fp32 gradient partition down and bf16 parameters up over PCIe, every step, not overlapped.
    extra = (4 + 2) * P_8B / 8 / (device.host_link_gbps * 1e9) / TimeConstants().comm_efficiency
    assert offloaded.time.step_s - plain.time.step_s == pytest.approx(extra, rel=1e-6)
