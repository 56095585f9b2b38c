"""Plan validation: the global-batch rule and errors that name field, value and what is allowed."""

import pytest

from paratune.config.plan import Plan, PlanError, load_plan, load_plan_dict


def test_grad_accum_is_derived_from_the_global_batch():
    plan = load_plan_dict({"global_batch": 32, "micro_batch": 4, "num_workers": 2})
    assert plan.grad_accum == 4
    assert plan.micro_batch * plan.grad_accum * plan.dp_degree == plan.global_batch


def test_global_batch_rule_names_values_and_allowed_micro_batches():
    with pytest.raises(PlanError) as err:
        load_plan_dict({"global_batch": 32, "micro_batch": 4, "grad_accum": 2, "num_workers": 2})
    msg = str(err.value)
    assert "grad_accum" in msg and "4 x 2 x 2 = 16 != 32" in msg
    assert "allowed micro_batch: [1, 2, 4, 8, 16]" in msg


def test_indivisible_global_batch_is_rejected():
    with pytest.raises(PlanError, match=r"global_batch: 10 is not divisible by micro_batch x dp_degree = 4 x 2"):
        load_plan_dict({"global_batch": 10, "micro_batch": 4, "num_workers": 2})


@pytest.mark.parametrize(
    "data, field, value, allowed",
    [
        ({"strategy": "zero3"}, "strategy", "'zero3'", "'ddp', 'fsdp' or 'zero'"),
        ({"strategy": "fsdp", "fsdp": {"sharding": "half"}}, "fsdp.sharding", "'half'", "'full', 'grad_op', 'hybrid' or 'no_shard'"),
        ({"strategy": "zero", "zero": {"stage": 4}}, "zero.stage", "4", "0, 1, 2 or 3"),
        ({"precision": "fp8"}, "precision", "'fp8'", "'fp32' or 'bf16'"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing", "'some'", "'none', 'selective', 'selective_op', 'layers' or 'full'"),
        ({"micro_batch": 0}, "micro_batch", "0", "greater than or equal to 1"),
        ({"peft": {"method": "ia3"}}, "peft.method", "'ia3'", "'lora'"),
        ({"peft": {"r": 0}}, "peft.r", "0", "greater than or equal to 1"),
        ({"peft": {"dropout": 1.5}}, "peft.dropout", "1.5", "less than 1"),
        ({"peft": {"alpha": True}}, "peft.alpha", "True", "a boolean"),
        ({"peft": {"target_modules": []}}, "peft.target_modules", "[]", "'all-linear', or none"),
    ],
)
def test_errors_name_field_value_and_allowed(data, field, value, allowed):
    with pytest.raises(PlanError) as err:
        load_plan_dict(data)
    msg = str(err.value)
    assert f"plan: {field}: got {value}" in msg and allowed in msg


def test_options_of_another_strategy_are_rejected():
    with pytest.raises(PlanError, match="zero: options for strategy 'zero' given, but strategy is 'ddp'"):
        load_plan_dict({"strategy": "ddp", "zero": {"stage": 2}})


def test_unknown_fields_are_rejected():
    with pytest.raises(PlanError, match=r"ddp.bucket_mb: unknown field"):
        load_plan_dict({"strategy": "ddp", "ddp": {"bucket_mb": 25}})


def test_env_allows_communication_settings_only():
    plan = load_plan_dict({"env": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_CTAS": "4"}})
    assert plan.env["NCCL_ALGO"] == "Ring"
    with pytest.raises(PlanError, match=r"env.HOME: not a communication setting; allowed prefixes: NCCL_"):
        load_plan_dict({"env": {"HOME": "/x"}})
    with pytest.raises(PlanError, match=r"env.AWS_SECRET_ACCESS_KEY: looks like a credential"):
        load_plan_dict({"env": {"AWS_SECRET_ACCESS_KEY": "x"}})
    with pytest.raises(PlanError, match=r"env.NCCL_PROTO: got 'LL256'; allowed: \['LL', 'LL128', 'Simple'\]"):
        load_plan_dict({"env": {"NCCL_PROTO": "LL256"}})


def test_hybrid_shard_group_rules():
    with pytest.raises(PlanError, match=r"fsdp.shard_group_size: 3 does not divide the dp degree 4; allowed: \[1, 2, 4\]"):
        load_plan_dict({"strategy": "fsdp", "num_workers": 4, "global_batch": 8, "micro_batch": 1,
                        "fsdp": {"sharding": "hybrid", "shard_group_size": 3}})
    # A shard group of one rank would be pure replication, where HSDP skipped gradient sync.
    with pytest.raises(PlanError, match="shard_group_size: 1 makes 'hybrid' pure replication"):
        load_plan_dict({"strategy": "fsdp", "fsdp": {"sharding": "hybrid", "shard_group_size": 1}})


def test_zero_rules():
    with pytest.raises(PlanError, match="zero.offload_param: true needs zero.stage 3, got stage 2"):
        load_plan_dict({"strategy": "zero", "zero": {"stage": 2, "offload_param": True}})
    with pytest.raises(PlanError, match="zero.stage: 0 with precision 'bf16'"):
        load_plan_dict({"strategy": "zero", "precision": "bf16", "zero": {"stage": 0}})


def test_yaml_round_trip_and_file_errors(tmp_path):
    plan = load_plan_dict({"strategy": "fsdp", "fsdp": {"sharding": "grad_op"}, "global_batch": 16})
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    assert load_plan(path) == plan
    bad = tmp_path / "bad.yaml"
    bad.write_text("strategy: ddp\nmicro_batch: -1\n")
    with pytest.raises(PlanError, match=rf"{bad}: micro_batch: got -1"):
        load_plan(bad)
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")


def test_with_changes_rederives_grad_accum():
    plan = load_plan_dict({"global_batch": 16, "micro_batch": 2, "num_workers": 2})
    assert plan.grad_accum == 4
    changed = plan.with_changes(micro_batch=4)
    assert changed.grad_accum == 2
    assert plan.with_changes(strategy="zero").zero.stage == 2


def test_flat_params_cover_strategy_knobs():
    flat = load_plan_dict({"strategy": "zero", "zero": {"stage": 3}}).flat()
    assert flat["zero.stage"] == 3 and flat["strategy"] == "zero" and flat["grad_accum"] == 2
    assert isinstance(Plan().flat()["ddp.bucket_cap_mb"], float)


def test_parallel_degrees_rules():
    plan = load_plan_dict({"num_workers": 8, "tp": 2, "strategy": "fsdp", "global_batch": 16, "micro_batch": 2})
    assert plan.dp_degree == 4 and plan.grad_accum == 2
    with pytest.raises(PlanError, match=r"num_workers: 4 is not divisible by tp x pp = 3 x 1; allowed: dp4 x tp1 x pp1"):
        load_plan_dict({"num_workers": 4, "tp": 3})
    with pytest.raises(PlanError, match=r"tp: 4 must divide attention heads \(4\) and KV heads \(2\); allowed: \[1, 2\]"):
        load_plan_dict({"num_workers": 4, "tp": 4, "global_batch": 8, "micro_batch": 1})
    with pytest.raises(PlanError, match=r"tp: 8 crosses node boundaries \(gpus_per_node 4\); allowed: \[1, 2, 4\]"):
        load_plan_dict({"model": "llama3-8b", "num_workers": 8, "tp": 8, "gpus_per_node": 4, "global_batch": 8,
                        "micro_batch": 1})
    with pytest.raises(PlanError, match=r"pp: 4 with schedule '1f1b' needs >= 4 layers, model has 2"):
        load_plan_dict({"num_workers": 4, "pp": 4, "global_batch": 8, "micro_batch": 1})
    with pytest.raises(PlanError, match=r"grad_accum: 1 micro-batches per step with pp 2 leaves stages idle"):
        load_plan_dict({"num_workers": 2, "pp": 2, "global_batch": 8, "micro_batch": 8})
    assert load_plan_dict({"num_workers": 2, "tp": 2, "strategy": "zero"}).dp_degree == 1  # DeepSpeed AutoTP
    with pytest.raises(PlanError, match=r"pp: 2 with strategy 'zero'; allowed: pp 1 \(DeepSpeed 0.19.8 pipelines"):
        load_plan_dict({"num_workers": 2, "pp": 2, "strategy": "zero"})
    # 3-D: tp x pp x dp, with every data-parallel flavour on the dp axis.
    three_d = {"num_workers": 8, "tp": 2, "pp": 2, "global_batch": 8, "micro_batch": 2}
    assert load_plan_dict({**three_d, "strategy": "ddp"}).dp_degree == 2  # DDP semantics via FSDP2's replicate
    assert load_plan_dict({**three_d, "strategy": "fsdp", "fsdp": {"sharding": "no_shard"}}).grad_accum == 2
    hybrid = {**three_d, "num_workers": 16, "global_batch": 16, "strategy": "fsdp", "gpus_per_node": 4}
    assert load_plan_dict({**hybrid, "fsdp": {"sharding": "hybrid"}}).dp_degree == 4  # shards over 4 / tp 2 = 2
    with pytest.raises(PlanError, match=r"fsdp.sharding: 'hybrid' shards over the dp ranks of a node, 2 GPUs / tp 2 = 1"):
        load_plan_dict({**hybrid, "gpus_per_node": 2, "fsdp": {"sharding": "hybrid"}})
    with pytest.raises(PlanError, match=r"fsdp.shard_group_size: 3 does not divide the dp degree 4"):
        load_plan_dict({**hybrid, "fsdp": {"sharding": "hybrid", "shard_group_size": 3}})
    with pytest.raises(PlanError, match="sequence_parallel: true needs tp > 1"):
        load_plan_dict({"sequence_parallel": True})
    # A pipeline of 2 over 4 workers leaves dp 2: the global batch is split over dp only.
    assert load_plan_dict({"num_workers": 4, "pp": 2, "strategy": "fsdp", "global_batch": 8,
                           "micro_batch": 2}).grad_accum == 2


def test_context_parallel_rules():
    cp = {"num_workers": 8, "cp": 2, "seq_len": 64, "global_batch": 8, "micro_batch": 2, "strategy": "fsdp"}
    plan = load_plan_dict(cp)
    assert (plan.dp_degree, plan.grad_accum) == (4, 1)  # the cp ranks of a dp rank share its sequences
    with pytest.raises(PlanError, match=r"cp: 4 needs seq_len divisible by 2 x cp = 8 .* got seq_len 36; allowed cp: \[1, 2, 3, 6, 9, 18\]"):
        load_plan_dict({**cp, "cp": 4, "seq_len": 36, "global_batch": 4, "micro_batch": 2})
    with pytest.raises(PlanError, match=r"cp: 2 with device 'cpu': torch 2.13's context parallel rings only CUDA's SDPA"):
        load_plan_dict({**cp, "device": "cpu"})
    with pytest.raises(PlanError, match=r"cp: 2 with strategy 'zero'"):
        load_plan_dict({**cp, "strategy": "zero"})
    with pytest.raises(PlanError, match=r"cp: 2 together with pp 2 is not wired"):
        load_plan_dict({**cp, "pp": 2, "global_batch": 4, "micro_batch": 1})
    with pytest.raises(PlanError, match=r"num_workers: 8 is not divisible by tp x pp x cp = 1 x 1 x 3; allowed cp: \[1, 2, 4, 8\]"):
        load_plan_dict({**cp, "cp": 3, "seq_len": 66})


# ---- integer sizes as DeepSpeed users write them (issue 26) ----------------------------------
ZERO_SIZES = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


@pytest.mark.parametrize("written", [5e8, 5.0e8, "5e8", "5.0e8", "5.0e+8", "5E8", 500_000_000, "500_000_000",
                                     "500000000"])
@pytest.mark.parametrize("field", ZERO_SIZES)
def test_zero_sizes_take_e_notation(field, written):
    plan = load_plan_dict({"strategy": "zero", "zero": {field: written}})
    value = getattr(plan.zero, field)
    assert value == 500_000_000 and type(value) is int
    assert plan.to_dict()["zero"][field] == 500_000_000  # exported (deepspeed.json, plan.yaml) as an integer


def test_the_readme_zero_line_loads_from_yaml(tmp_path):
    # README "A plan", verbatim: PyYAML reads 5e8 and 5e7 as strings (YAML 1.1 floats need a dot
    # and a signed exponent), which the integer fields refused before.
    path = tmp_path / "zero.yaml"
    path.write_text("strategy: zero\n"
                    "zero: {stage: 2, reduce_bucket_size: 5e8, allgather_bucket_size: 5.0e+8, "
                    "stage3_prefetch_bucket_size: 5e7,\n"
                    "       overlap_comm: false, offload_optimizer: false, offload_param: false}\n"
                    "seq_len: 1.28e2\nglobal_batch: 8\n")
    plan = load_plan(path)
    assert (plan.zero.reduce_bucket_size, plan.zero.allgather_bucket_size,
            plan.zero.stage3_prefetch_bucket_size, plan.seq_len) == (500_000_000, 500_000_000, 50_000_000, 128)
    again = tmp_path / "again.yaml"
    again.write_text(plan.to_yaml())
    assert "reduce_bucket_size: 500000000" in again.read_text() and load_plan(again) == plan


@pytest.mark.parametrize("written, why", [
    ("5.5e0", r"got '5.5e0', not a whole number"),
    (5.5, r"got 5.5, not a whole number"),
    ("1e-3", r"got '1e-3', not a whole number"),
    (1e-3, r"got 0.001, not a whole number"),
    (True, r"got True, a boolean"),
    ("5e8 bytes", r"got '5e8 bytes', not a number"),
    ("5__0", r"got '5__0', not a number"),
    (float("inf"), r"got inf, not a whole number"),
])
def test_zero_sizes_refuse_what_is_not_a_whole_number(written, why):
    with pytest.raises(PlanError, match=rf"plan: zero.reduce_bucket_size: {why}; allowed: an integer, written "
                                        r"500000000, 500_000_000, 5e8 or 5.0e\+8"):
        load_plan_dict({"strategy": "zero", "zero": {"reduce_bucket_size": written}})


def test_size_bounds_still_apply_after_e_notation():
    with pytest.raises(PlanError, match=r"zero.reduce_bucket_size: got 0; Input should be greater than or equal to 1"):
        load_plan_dict({"strategy": "zero", "zero": {"reduce_bucket_size": "0e0"}})
    with pytest.raises(PlanError, match=r"seq_len: got 2000000; Input should be less than or equal to 1048576"):
        load_plan_dict({"seq_len": "2e6"})


def test_ddp_bucket_takes_numbers_not_bools():
    assert load_plan_dict({"ddp": {"bucket_cap_mb": "2.5e1"}}).ddp.bucket_cap_mb == 25.0
    with pytest.raises(PlanError, match=r"ddp.bucket_cap_mb: got True, a boolean; allowed: a number"):
        load_plan_dict({"ddp": {"bucket_cap_mb": True}})


def test_an_indivisible_batch_says_which_degrees_would_split_it():
    # dp 512 does not divide 256: no micro-batch helps; the message says what does instead.
    with pytest.raises(PlanError) as err:
        load_plan_dict({"model": "llama3-70b", "num_workers": 512, "global_batch": 256, "micro_batch": 1})
    msg = str(err.value)
    assert "global_batch: 256 is not divisible by micro_batch x dp_degree = 1 x 512 = 512" in msg
    assert "dp_degree = num_workers / (tp x pp x cp) = 512 / 1 = 512 does not divide global_batch 256" in msg
    assert "allowed: tp x pp x cp in [2, 4, 8, 16, 32, 64, 128, 256, 512]" in msg and "[]" not in msg


def test_a_plan_files_local_paths_become_absolute(tmp_path, monkeypatch):
    """Trials run in Ray's processes, whose working directory is not the user's: the model folder
    and data files a plan file names relative to its own folder are made absolute (where the
    command runs, only a file that exists there alone: files written before the rule)."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    (home / "my-model").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (home / "my-model" / "config.json").write_text("{}")
    (home / "corpus.txt").write_text("x")
    (home / "tiny-llama").mkdir()  # a folder named like a preset: the preset still wins
    (home / "p.yaml").write_text("model: ./my-model\ndata: {kind: text, path: corpus.txt}\n")
    plan = load_plan(home / "p.yaml")
    assert plan.model == str(home / "my-model") and plan.data.path == home / "corpus.txt"
    (home / "q.yaml").write_text("model: tiny-llama\ndata: {kind: text, path: missing.txt}\n")
    plan = load_plan(home / "q.yaml")
    assert plan.model == "tiny-llama" and plan.data.path == home / "missing.txt"  # the file's folder, named
    (elsewhere / "old.txt").write_text("x")  # only where the command runs: found there
    (home / "r.yaml").write_text("model: tiny-llama\ndata: {kind: text, path: old.txt}\n")
    assert load_plan(home / "r.yaml").data.path == elsewhere / "old.txt"
