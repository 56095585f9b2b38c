"""The step-time model: composition from a profile, refit, error band, nearest profile, cache keys.

Pure unit tests on hand-made profiles (no workers): each checks a property the composition or the
refit must have, with numbers derived here from the profile, so a wrong composition fails."""

from __future__ import annotations

import math

import pytest

from paratune.config.plan import load_plan_dict
from paratune.costs.profile import (
    BlockShape,
    BlockTime,
    Curve,
    GroupSpec,
    HeadShape,
    HeadTime,
    LinearFit,
    Profile,
    ProfileRequest,
    ProfileStore,
    config_digest,
    profile_requests_for,
)
from paratune.cluster.profiling import fit_latency_bandwidth
from paratune.costs.timemodel import (
    FEATURES,
    PRIOR,
    PRIOR_BAND,
    StepTimeModel,
    compose,
    families,
    fit_coefficients,
    module_sizes,
)

BASE = {"model": "small-llama", "seq_len": 128, "global_batch": 16, "num_workers": 2}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def make_profile(env: dict | None = None, block_per_token: float = 2e-6, latency: float = 1e-3,
                 seconds_per_byte: float = 1e-9, precision: str = "fp32") -> Profile:
    """Block time proportional to tokens/tp (x4/3 with recompute), linear collective curves."""
    blocks = []
    for tp in (1, 2):
        for ckpt in ("none", "full"):
            for mb in (1, 2, 4, 8):
                base = block_per_token * mb * 128 / tp * (4 / 3 if ckpt == "full" else 1)
                blocks.append(BlockTime(shape=BlockShape(micro_batch=mb, seq_len=128, tp=tp, checkpointing=ckpt),
                                        block_s=base, embed_s=0.1 * base, head_s=2 * base))
    curves = [Curve(op=op, size=2, stride=1, latency_s=latency, seconds_per_byte=seconds_per_byte) for op in OPS]
    return Profile(model="small-llama", config_digest=config_digest("small-llama"), precision=precision,
                   device_type="cpu", device_name="cpu", world_size=2, env=env or {}, blocks=blocks,
                   collectives=curves, optimizer=LinearFit(a=2e-3, b=1e-9))


def plan(**kw):
    return load_plan_dict({**BASE, **kw})


ZERO = {"reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000}


def test_strategies_at_the_same_micro_batch_differ_as_their_communication_does():
    """The roofline predicted these four identically; composed from curves they must differ, in the
    order of the bytes they move per step (ZeRO-3 and FSDP full gather every micro-batch)."""
    profile = make_profile()
    model = StepTimeModel([profile])
    s = {name: model.predict(plan(micro_batch=2, **kw)).step_s for name, kw in {
        "ddp": {"strategy": "ddp"},
        "zero2": {"strategy": "zero", "zero": {"stage": 2, **ZERO}},
        "zero3": {"strategy": "zero", "zero": {"stage": 3, **ZERO}},
        "fsdp_full": {"strategy": "fsdp", "fsdp": {"sharding": "full"}},
        "fsdp_grad_op": {"strategy": "fsdp", "fsdp": {"sharding": "grad_op"}},
    }.items()}
    assert len({round(v, 9) for v in s.values()}) == 5, s
    assert s["fsdp_full"] > s["fsdp_grad_op"]  # a second gather of every block per micro-batch
    assert s["zero3"] > s["zero2"]
    # Compute is the same for all: the differences are communication and the optimizer's share.
    terms = {k: compose(plan(micro_batch=2, **kw), profile) for k, kw in
             {"ddp": {"strategy": "ddp"}, "zero3": {"strategy": "zero", "zero": {"stage": 3, **ZERO}}}.items()}
    assert terms["ddp"]["compute"] == pytest.approx(terms["zero3"]["compute"])
    assert terms["zero3"]["optimizer"] < terms["ddp"]["optimizer"]  # ZeRO steps its partition only


def test_compute_is_layers_times_block_plus_ends_per_micro_batch():
    profile = make_profile()
    p = plan(micro_batch=4)  # dp 2, grad_accum 2
    bt = profile.block(4, 128, 1, "none")
    assert compose(p, profile)["compute"] == pytest.approx(2 * (4 * bt.block_s + bt.embed_s + bt.head_s))


def test_pipeline_compute_has_its_bubble_and_the_heavier_stage():
    """pp 2 with m micro-batches: (m + pp - 1) slots of the slowest stage (the one with the head);
    interleaving halves the fill and drain."""
    profile = make_profile()
    p = plan(micro_batch=2, pp=2)  # dp 1, grad_accum 8, 2 layers per stage
    bt = profile.block(2, 128, 1, "none")
    stage = 2 * bt.block_s + bt.head_s
    assert compose(p, profile)["compute"] == pytest.approx((8 + 1) * stage)
    inter = plan(micro_batch=2, pp=2, pp_schedule="interleaved_1f1b")  # 1 layer per stage, 2 stages each
    ranks = [2 * bt.block_s + bt.embed_s, 2 * bt.block_s + bt.head_s]
    assert compose(inter, profile)["compute"] == pytest.approx((8 + 0.5) * max(ranks))
    assert compose(p, profile)["pp_comm"] > 0


def test_tensor_parallel_all_reduces_per_layer_and_recompute_adds_two():
    """tp 2: 4 all-reduces per layer per micro-batch (6 with full recompute), at the curve's cost."""
    latency = 1e-3
    profile = make_profile(latency=latency, seconds_per_byte=0.0)
    base = compose(plan(micro_batch=2, tp=2), profile)["tp_comm"]
    ckpt = compose(plan(micro_batch=2, tp=2, activation_checkpointing="full"), profile)["tp_comm"]
    m, layers = 8, 4
    assert ckpt - base == pytest.approx(m * layers * 2 * latency)
    # + embedding, head input grad and 3 all-reduces of loss_parallel (auto under tp: vocab_parallel)
    assert base == pytest.approx(m * (layers * 4 + 5) * latency)
    standard = compose(plan(micro_batch=2, tp=2, loss="standard"), profile)["tp_comm"]
    assert standard == pytest.approx(m * (layers * 4 + 3) * latency)  # the logits gathered instead
    every_2nd = compose(plan(micro_batch=2, tp=2, activation_checkpointing="layers"), profile)["tp_comm"]
    assert every_2nd - base == pytest.approx(m * (layers // 2) * 2 * latency)  # blocks 0 and 2 recompute
    selective = compose(plan(micro_batch=2, tp=2, activation_checkpointing="selective"), profile)["tp_comm"]
    assert selective == pytest.approx(base)  # the policy keeps the collectives' outputs
    assert compose(plan(micro_batch=2), profile)["tp_comm"] == 0.0


def test_ddp_buckets_and_bandwidth():
    """DDP all-reduces fp32 gradients once per step in buckets: 1 MiB first, then bucket_cap_mb."""
    from paratune.model.shapes import local_params as _local_params
    from paratune.model.shapes import model_shape

    spb, latency = 1e-9, 1e-3
    profile = make_profile(latency=latency, seconds_per_byte=spb)
    p = plan(micro_batch=2, ddp={"bucket_cap_mb": 4})
    local, _ = _local_params(p, model_shape(p))
    nbytes = 4 * local
    buckets = 1 + math.ceil((nbytes - 2**20) / (4 * 2**20))
    assert compose(p, profile)["dp_comm"] == pytest.approx(buckets * latency + nbytes * spb)
    # More micro-batches do not add DDP communication (no_sync between them).
    assert compose(plan(micro_batch=1, ddp={"bucket_cap_mb": 4}), profile)["dp_comm"] == pytest.approx(
        compose(p, profile)["dp_comm"])


def test_zero3_gathers_grow_with_micro_batches_and_skip_persistent_modules():
    profile = make_profile(latency=0.0, seconds_per_byte=1e-9)
    z3 = lambda mb: compose(plan(micro_batch=mb, strategy="zero", zero={"stage": 3, **ZERO}), profile)["dp_comm"]  # noqa: E731
    assert z3(1) == pytest.approx(2 * z3(2)) and z3(2) == pytest.approx(2 * z3(4))
    block, rest = module_sizes(plan())
    assert any(s <= 100_000 for s in block)  # small-llama's norms and attention projections persist


def test_families_follow_what_runs():
    assert families(plan(micro_batch=2)) == ["ddp"]
    assert families(plan(micro_batch=2, tp=2)) == ["dtensor_tp"]  # dp 1: no dp wrapper on the nd path
    assert families(plan(micro_batch=2, pp=2, strategy="fsdp")) == ["pipeline"]
    assert families(plan(micro_batch=2, strategy="zero", zero={"stage": 3})) == ["deepspeed", "zero3"]
    assert families(plan(micro_batch=2, tp=2, strategy="zero", zero={"stage": 2})) == ["deepspeed", "autotp"]


def _truth(p, profile) -> float:
    """A made-up 'measured' time: compute 30% slower, DP comm half hidden, 40 ms per DeepSpeed
    micro-batch, 15 ms per pipeline micro-batch, 5 ms per step."""
    t = compose(p, profile)
    fam = families(p)
    return (1.3 * t["compute"] + 0.5 * t["dp_comm"] + t["tp_comm"] + t["pp_comm"] + t["optimizer"] + 0.005
            + p.grad_accum * (0.04 * ("deepspeed" in fam) + 0.015 * ("pipeline" in fam)))


def _grid() -> list:
    out = []
    for mb in (2, 4, 8):
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            for kw in ({"strategy": "ddp"}, {"strategy": "fsdp"}, {"strategy": "zero", "zero": {"stage": 2, **ZERO}},
                       {"strategy": "zero", "zero": {"stage": 3, **ZERO}}):
                if kw["strategy"] == "zero" and pp > 1:
                    continue
                out.append(plan(micro_batch=mb, tp=tp, pp=pp, **kw))
    return out


def test_refit_learns_framework_overheads_and_predicts_out_of_sample():
    profile = make_profile()
    plans = _grid()
    test = [p for p in plans if p.micro_batch == 4]  # every (strategy, tp, pp) is trained at mb 2 and 8
    train = [p for p in plans if p.micro_batch != 4]
    model = StepTimeModel([profile])
    for p in train:
        model.observe(p, _truth(p, profile))
    errors = [abs(model.predict(p).step_s / _truth(p, profile) - 1) for p in test]
    assert max(errors) < 0.08, errors  # the prior holds the coefficients a little short of the truth
    # The profile alone is further off (it cannot see the frameworks' costs).
    alone = StepTimeModel([profile])
    alone_errors = [abs(alone.predict(p).step_s / _truth(p, profile) - 1) for p in test]
    assert max(alone_errors) > 3 * max(errors)


def test_observe_returns_the_prediction_made_before_the_refit():
    profile = make_profile()
    model = StepTimeModel([profile])
    p = plan(micro_batch=4, strategy="zero", zero={"stage": 2, **ZERO})
    before = model.predict(p).step_s
    out = model.observe(p, 2 * before)
    assert out["predicted_step_time_s"] == pytest.approx(before)
    assert out["step_time_prediction_error"] == pytest.approx(-0.5)
    assert model.predict(p).step_s > before  # refit moved toward the measurement


def test_few_trials_cannot_wreck_the_model():
    """One wildly off trial (x3) moves its own plan toward it, the other plans far less."""
    profile = make_profile()
    model = StepTimeModel([profile])
    others = [plan(micro_batch=mb, tp=tp, **kw) for mb in (2, 8) for tp in (1, 2)
              for kw in ({"strategy": "ddp"}, {"strategy": "zero", "zero": {"stage": 2, **ZERO}})]
    before = [model.predict(p).step_s for p in others]
    odd = plan(micro_batch=4, strategy="fsdp")
    odd_before = model.predict(odd).step_s
    model.observe(odd, 3 * odd_before)
    odd_moved = model.predict(odd).step_s / odd_before
    moved = [a / b for a, b in zip((model.predict(p).step_s for p in others), before)]
    assert odd_moved > 1.5
    assert all(0.8 < r < 1.6 and r - 1 < (odd_moved - 1) / 2 for r in moved), (odd_moved, moved)


def test_fit_coefficients_is_the_prior_without_data_and_non_negative():
    assert fit_coefficients([], []) == PRIOR
    rows = [[1.0] + [0.0] * (len(FEATURES) - 1)] * 3
    coef = fit_coefficients(rows, [-0.0 + 1e-9] * 3)  # measured far below: pushes toward 0, never below
    assert all(c >= 0 for c in coef)


def test_error_band_prior_then_leave_one_out():
    profile = make_profile()
    model = StepTimeModel([profile])
    assert model.error_band() == PRIOR_BAND
    p = plan(micro_batch=2)
    model.observe(p, model.predict(p).step_s * 1.4)
    assert model.error_band() == pytest.approx(0.4 / 1.4, rel=1e-6)  # the largest pre-refit error so far
    for q in _grid():
        model.observe(q, _truth(q, profile))
    band = model.error_band()
    assert 0.0 < band < 0.2
    loo = model.loo_errors()
    assert len(loo) == len(model.samples)
    assert model.summary()["time_model_error_band"] == pytest.approx(band)


def test_nearest_profile_when_the_env_has_none():
    one, two = make_profile(env={"OMP_NUM_THREADS": "1"}), make_profile(env={"OMP_NUM_THREADS": "2"}, block_per_token=4e-6)
    model = StepTimeModel([one, two])
    p1, p2 = plan(micro_batch=2, env={"OMP_NUM_THREADS": "1"}), plan(micro_batch=2, env={"OMP_NUM_THREADS": "2"})
    a, b = model.predict(p1), model.predict(p2)
    assert a.note is None and b.note is None and b.step_s > a.step_s
    c = model.predict(plan(micro_batch=2, env={"OMP_NUM_THREADS": "4"}))
    assert c.note and "nearest" in c.note and "OMP_NUM_THREADS" in c.note
    with pytest.raises(ValueError, match="profiles"):
        StepTimeModel([])
    with pytest.raises(ValueError, match="measured_step_s"):
        model.observe(p1, -1.0)


def test_block_lookup_interpolates_in_tokens():
    profile = make_profile()
    bt = profile.block(3, 128, 1, "none")  # not measured: between mb 2 and 4
    assert bt.block_s == pytest.approx(2e-6 * 3 * 128, rel=1e-6)
    assert profile.block(2, 128, 4, "none").block_s == pytest.approx(profile.block(2, 128, 2, "none").block_s / 2)


def test_fit_latency_bandwidth_recovers_a_line():
    latency, spb = 5e-5, 2e-10
    pts = [(n, latency + n * spb) for n in (4096, 262144, 4 << 20, 16 << 20)]
    a, b = fit_latency_bandwidth(pts)
    assert a == pytest.approx(latency, rel=1e-3) and b == pytest.approx(spb, rel=1e-3)


def test_requests_one_per_env_with_the_shapes_and_groups_plans_need():
    plans = [plan(micro_batch=mb, tp=tp, env={"OMP_NUM_THREADS": env}) for mb in (2, 4) for tp in (1, 2)
             for env in ("1", "2")]
    plans.append(plan(micro_batch=2, pp=2, env={"OMP_NUM_THREADS": "1"}))
    requests = profile_requests_for(plans)
    assert sorted(r.env["OMP_NUM_THREADS"] for r in requests) == ["1", "2"]
    one = next(r for r in requests if r.env["OMP_NUM_THREADS"] == "1")
    assert {(b.micro_batch, b.tp) for b in one.blocks} == {(2, 1), (4, 1), (2, 2), (4, 2)}
    assert GroupSpec(size=2, stride=1) in one.groups and all(g.size == 2 for g in one.groups)
    assert 1 <= len(one.local_params) <= 3


def test_group_spec_layouts_and_bad_input():
    assert GroupSpec(size=2, stride=1).groups(4) == [[0, 1], [2, 3]]
    assert GroupSpec(size=2, stride=2).groups(4) == [[0, 2], [1, 3]]
    assert GroupSpec(size=2, stride=2).layout == "strided"
    with pytest.raises(ValueError, match="size 4 x stride 2"):
        GroupSpec(size=4, stride=2).groups(4)
    with pytest.raises(ValueError, match="blocks"):
        ProfileRequest(model="small-llama", blocks=[], world_size=2)


def test_store_keys_separate_what_changes_speed(tmp_path):
    store = ProfileStore(tmp_path)
    base = make_profile(env={"OMP_NUM_THREADS": "1"})
    keys = {store.key_for_profile(base),
            store.key_for_profile(base.model_copy(update={"env": {"OMP_NUM_THREADS": "2"}})),
            store.key_for_profile(base.model_copy(update={"precision": "bf16"})),
            store.key_for_profile(base.model_copy(update={"device_name": "NVIDIA H100 80GB HBM3"})),
            store.key_for_profile(base.model_copy(update={"world_size": 4})),
            store.key_for_profile(base.model_copy(update={"gpus_per_node": 8})),
            store.key_for_profile(base.model_copy(update={"config_digest": config_digest("small-llama", {"hidden_size": 128})}))}
    assert len(keys) == 7
    store.put(base)
    request = ProfileRequest(model="small-llama", blocks=[BlockShape(micro_batch=2, seq_len=128)],
                             groups=[GroupSpec(size=2)], env={"OMP_NUM_THREADS": "1"}, world_size=2)
    got = store.get(request, "cpu")
    assert got is not None and got.blocks == base.blocks
    assert store.get(request, "NVIDIA H100 80GB HBM3") is None
    assert store.get(request.model_copy(update={"env": {"OMP_NUM_THREADS": "2"}}), "cpu") is None
    wider = request.model_copy(update={"blocks": [BlockShape(micro_batch=16, seq_len=128)]})
    assert store.get(wider, "cpu") is None  # not measured at that shape: not reused
    assert store.get(wider, "cpu", require_cover=False) is not None


def test_each_env_gets_its_own_compute_multiplier():
    # The env-2 profile overstates compute by 2x (as a profile taken with oversubscribed threads
    # can); the truth is the env-1 profile's compute in both envs. Trials in both envs teach
    # each its own multiplier, so both come out right, where one shared multiplier cannot.
    one, two = make_profile(env={"OMP_NUM_THREADS": "1"}), make_profile(env={"OMP_NUM_THREADS": "2"}, block_per_token=4e-6)
    model = StepTimeModel([one, two])
    assert len(model.features) == len(FEATURES) + 2
    plans = [plan(micro_batch=mb, env={"OMP_NUM_THREADS": env}) for mb in (1, 2, 4) for env in ("1", "2")]
    for p in plans * 2:
        model.observe(p, _truth(p.with_changes(env={"OMP_NUM_THREADS": "1"}), one))
    for p in plans:
        truth = _truth(p.with_changes(env={"OMP_NUM_THREADS": "1"}), one)
        assert model.predict(p).step_s == pytest.approx(truth, rel=0.08), p.env


def test_on_gpus_data_parallel_communication_hides_under_compute_and_on_cpu_it_does_not():
    # The same measured curves and blocks: on CUDA (comm kernels on their own stream) DDP's
    # buckets but the last and FSDP2's prefetched gathers hide under compute; on CPU gloo and
    # compute share the cores, so all of it counts (the refit then learns how much is exposed).
    cpu = make_profile(seconds_per_byte=2e-10)
    gpu = cpu.model_copy(update={"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"})
    for p in (plan(strategy="ddp", micro_batch=4), plan(strategy="fsdp", fsdp={"sharding": "full"}, micro_batch=4)):
        on_cpu, on_gpu = compose(p, cpu), compose(p, gpu)
        assert on_gpu["compute"] == pytest.approx(on_cpu["compute"])
        assert 0 < on_gpu["dp_comm"] < on_cpu["dp_comm"], p.strategy
    # Communication far slower than backward cannot hide: what exceeds it stays exposed.
    slow_cpu = make_profile(seconds_per_byte=1e-6)
    slow_gpu = slow_cpu.model_copy(update={"device_type": "cuda"})
    ddp = plan(strategy="ddp", micro_batch=4)
    assert compose(ddp, slow_gpu)["dp_comm"] >= compose(ddp, slow_cpu)["dp_comm"] - compose(ddp, slow_cpu)["compute"]


# --------------------------------------------------------------------------- the levers
LEVER_SPACE = {"name": "levers", "fixed": {"model": "small-llama", "seq_len": 128, "global_batch": 16,
                                           "num_workers": 2, "precision": "bf16"},
               "space": {"strategy": {"ddp": {}, "fsdp": {}}, "micro_batch": [1, 2],
                         "activation_checkpointing": ["none", "selective", "layers", "full"],
                         "compile": [False, True], "float8": ["none", "tensorwise", "rowwise"]}}


def test_a_space_sweeping_compile_float8_and_checkpointing_asks_for_each_combination_once():
    """Every (micro-batch, checkpointing, compile, float8) the space has, once (two strategies and
    `layers`, which is made of `none` and `full` blocks, add none); no head beyond the standard."""
    from itertools import product

    from paratune.sweep.space import space_from_dict

    plans = [c.plan for c in space_from_dict(LEVER_SPACE).candidates]
    assert {(p.activation_checkpointing, p.compile, p.float8) for p in plans} == set(
        product(("none", "selective", "layers", "full"), (False, True), ("none", "tensorwise", "rowwise")))
    [request] = profile_requests_for(plans)
    keys = [(b.micro_batch, b.checkpointing, b.compile, b.float8) for b in request.blocks]
    assert len(keys) == len(set(keys)) == 2 * 3 * 2 * 3
    assert set(keys) == set(product((1, 2), ("none", "selective", "full"), (False, True),
                                    ("none", "tensorwise", "rowwise")))
    assert {(b.seq_len, b.tp) for b in request.blocks} == {(128, 1)} and request.heads == []
    # The loss form is the head's key: vocab_parallel under tp (auto), chunked at tp 1.
    [heads] = profile_requests_for([plan(micro_batch=2, tp=2), plan(micro_batch=2, tp=2, loss="standard"),
                                    plan(micro_batch=2, loss="chunked"), plan(micro_batch=2)])
    assert [(h.micro_batch, h.seq_len, h.tp, h.loss) for h in heads.heads] == [
        (2, 128, 1, "chunked"), (2, 128, 2, "vocab_parallel")]
    with pytest.raises(ValueError, match="checkpointing: 'layers' is no block shape"):
        BlockShape(micro_batch=1, seq_len=128, checkpointing="layers")


def lever_profile() -> Profile:
    """make_profile's blocks (bf16) plus, at micro-batch 2 and tp 1, each lever measured on its own
    with a distinct time, a compiled block's compile time, and a chunked head."""
    base = make_profile(precision="bf16")
    eager = base.block(2, 128, 1, "none")
    extra = [BlockTime(shape=BlockShape(micro_batch=2, seq_len=128, checkpointing=ckpt, compile=comp, float8=f8),
                       block_s=eager.block_s * factor, embed_s=eager.embed_s, head_s=eager.head_s, compile_s=cs)
             for ckpt, comp, f8, factor, cs in (("selective", False, "none", 1.1, None),
                                                ("none", True, "none", 0.7, 20.0),
                                                ("none", False, "tensorwise", 0.6, None))]
    heads = [HeadTime(shape=HeadShape(micro_batch=2, seq_len=128, loss="chunked"), head_s=0.5 * eager.head_s)]
    return base.model_copy(update={"blocks": base.blocks + extra, "heads": heads})


def test_the_time_model_picks_the_profiled_entry_for_the_plans_levers():
    profile = lever_profile()
    model = StepTimeModel([profile])
    eager = profile.block(2, 128, 1, "none")
    full = profile.block(2, 128, 1, "full")
    bf16 = {"micro_batch": 2, "precision": "bf16"}
    m = plan(**bf16).grad_accum

    def compute(block_s: float, head_s: float = eager.head_s, ends: BlockTime = eager) -> float:
        return m * (4 * block_s + ends.embed_s + head_s)  # 4 layers, the embedding, the head

    for kw, expected in (({}, compute(eager.block_s)),
                         ({"activation_checkpointing": "selective"}, compute(1.1 * eager.block_s)),
                         ({"compile": True}, compute(0.7 * eager.block_s)),
                         ({"float8": "tensorwise"}, compute(0.6 * eager.block_s)),
                         ({"activation_checkpointing": "full"}, compute(full.block_s, full.head_s, full))):
        p = plan(**bf16, **kw)
        assert compose(p, profile)["compute"] == pytest.approx(expected), kw
        assert model.predict(p).note is None, kw  # measured: nothing derived
    # `layers`, every 2nd of 4 blocks: blocks 0 and 2 at the full block's time, 1 and 3 at none's.
    layers = plan(**bf16, activation_checkpointing="layers")
    assert compose(layers, profile)["compute"] == pytest.approx(m * (2 * full.block_s + 2 * eager.block_s
                                                                      + eager.embed_s + eager.head_s))
    every_3rd = plan(**bf16, activation_checkpointing="layers", checkpoint_every=3)  # blocks 0 and 3
    assert compose(every_3rd, profile)["compute"] == pytest.approx(compose(layers, profile)["compute"])
    # The chunked head was measured: the plan's head is it.
    assert compose(plan(**bf16, loss="chunked"), profile)["compute"] == pytest.approx(
        compute(eager.block_s, 0.5 * eager.head_s))
    # The compiled plan's first step: the profile's cold compile (a later shape paid only a
    # dynamic-shape recompile); an eager plan has none.
    assert model.compile_seconds(plan(**bf16, compile=True)) == 20.0
    recompiled = BlockTime(shape=BlockShape(micro_batch=4, seq_len=128, compile=True), block_s=1.0, embed_s=0.1,
                           head_s=0.1, compile_s=0.5)
    later = StepTimeModel([profile.model_copy(update={"blocks": profile.blocks + [recompiled]})])
    assert later.compile_seconds(plan(precision="bf16", micro_batch=4, compile=True)) == 20.0
    assert model.compile_seconds(plan(**bf16)) is None


def test_levers_the_profile_did_not_measure_are_derived_and_said_so():
    profile = lever_profile()
    model = StepTimeModel([profile])
    eager = profile.block(2, 128, 1, "none")
    # compile + selective was never measured together: selective's block x compile's measured ratio.
    both = profile.block(2, 128, 1, "selective", compile=True)
    assert both.block_s == pytest.approx(1.1 * 0.7 * eager.block_s)
    assert "not profiled" in both.derived and "(measured on 1 shape(s))" in both.derived
    prediction = model.predict(plan(micro_batch=2, precision="bf16", activation_checkpointing="selective",
                                    compile=True))
    assert "not profiled" in prediction.note
    # Another micro-batch with a measured lever: the lever's own entries fitted in tokens (one
    # point: proportional), no note.
    assert profile.block(4, 128, 1, "none", compile=True).block_s == pytest.approx(2 * 0.7 * eager.block_s)
    # rowwise never measured, nor any pair for it: the prior (neutral), said so.
    rowwise = profile.block(2, 128, 1, "none", float8="rowwise")
    assert rowwise.block_s == pytest.approx(eager.block_s) and "prior" in rowwise.derived
    # A vocab_parallel head never measured: the standard head's time, with a note.
    assert profile.head(2, 128, 2, "vocab_parallel") == (profile.block(2, 128, 2).head_s, pytest.approx(
        "head with loss 'vocab_parallel' at tp 2 not profiled: the standard head's time"))
    assert "vocab_parallel" in model.predict(plan(micro_batch=2, tp=2, precision="bf16")).note
    assert model.predict(plan(micro_batch=2, tp=2, precision="bf16", loss="standard")).note is None
    with pytest.raises(ValueError, match="'layers' has no block of its own"):
        profile.block(2, 128, 1, "layers")


def test_a_lora_plan_times_the_frozen_base_block_it_runs():
    """A LoRA plan's block is its own lever (the frozen base's backward has no weight gradients):
    measured, the time model takes it; never measured, the prior (4/6 of the full block), said so."""
    profile = lever_profile()
    eager = profile.block(2, 128, 1, "none")
    lora = plan(micro_batch=2, precision="bf16", peft={"r": 8, "alpha": 16})
    prior = profile.block(2, 128, 1, "none", peft=lora.peft.model_dump_json())
    assert prior.block_s == pytest.approx(4 / 6 * eager.block_s) and "prior" in prior.derived
    assert "not profiled" in StepTimeModel([profile]).predict(lora).note
    measured = BlockTime(shape=BlockShape(micro_batch=2, seq_len=128, peft=lora.peft.model_dump_json()),
                         block_s=0.8 * eager.block_s, embed_s=eager.embed_s, head_s=eager.head_s)
    with_lora = profile.model_copy(update={"blocks": profile.blocks + [measured]})
    m = lora.grad_accum
    assert compose(lora, with_lora)["compute"] == pytest.approx(m * (4 * 0.8 * eager.block_s + eager.embed_s + eager.head_s))
    assert StepTimeModel([with_lora]).predict(lora).note is None
    # the profile a LoRA sweep asks for has the frozen-base block beside the full one's
    from paratune.costs.profile import profile_requests_for

    (request,) = profile_requests_for([lora, plan(micro_batch=2, precision="bf16")])
    assert sorted(b.peft != "" for b in request.blocks) == [False, True]
