"""Search spaces: validation errors, static pruning, valid-only proposals; verdict and export."""

import json

import optuna
import pytest

from paratune.out.export import export_winner
from paratune.config.plan import load_plan, load_plan_dict
from paratune.sweep.space import SpaceError, load_space, space_from_dict
from paratune.sweep.searchers import CandidateTree, all_points
from paratune.sweep.ledger import point_key
from paratune.cluster.trial import TrialResult
from paratune.sweep.verdict import Standing, complexity, decide

SPACE = {
    "name": "unit",
    "fixed": {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2},
    "space": {
        "strategy": {"ddp": {"bucket_cap_mb": [5, 25]}, "fsdp": {"sharding": ["full", "hybrid"]},
                     "zero": {"stage": [2, 3], "offload_param": [False, True]}},
        "micro_batch": [1, 2, 4, 8],
        "env": {"NCCL_ALGO": ["Ring", "Tree"]},
    },
}


def test_shipped_spaces_load():
    for name in ("local_cpu", "llama3_8b_1x8", "llama3_70b_4x8"):
        space = load_space(f"search_spaces/{name}.yaml")
        assert space.candidates and space.spec.name


def test_a_shipped_space_is_named_and_the_checkouts_folder_is_the_packages(tmp_path, monkeypatch):
    """The spaces live in the package (a wheel ships them); search_spaces/ is a link to that folder,
    so `paratune tune search_spaces/local_cpu.yaml` and `paratune tune local_cpu` read one file."""
    from pathlib import Path

    from paratune.sweep.space import SHIPPED_SPACES, resolve_space, shipped_spaces

    root = Path(__file__).resolve().parents[1]
    assert (root / "search_spaces").resolve() == SHIPPED_SPACES.resolve()
    assert set(shipped_spaces()) >= {"local_cpu", "tiny_moe_cpu", "llama3_8b_1x8", "llama3_70b_4x8"}
    monkeypatch.chdir(tmp_path)  # anywhere: no checkout around
    assert resolve_space("local_cpu") == resolve_space("local_cpu.yaml") == SHIPPED_SPACES / "local_cpu.yaml"
    assert load_space("local_cpu").spec.name == "local-cpu"
    (tmp_path / "local_cpu").mkdir()  # a file or folder of that name here is the user's: it is read as given
    assert resolve_space("local_cpu") == Path("local_cpu")
    with pytest.raises(SpaceError) as refused:
        load_space("local_cpus")
    assert str(refused.value).startswith("space: 'local_cpus' is neither a file nor a shipped space; "
                                         "did you mean 'local_cpu'? allowed: deepseek_v3_671b_32x8,")
    with pytest.raises(SpaceError, match="neither a file nor a shipped space"):
        load_space("elsewhere/local_cpu.yaml")  # a path is a path


def test_spaces_lists_the_shipped_ones_and_prints_one(capsys):
    from paratune.cli import main
    from paratune.sweep.space import shipped_spaces

    assert main(["spaces"]) == 0
    listed = capsys.readouterr().out
    assert all(f"│ {name} " in listed for name in shipped_spaces()), listed
    row = next(line for line in listed.splitlines() if "│ local_cpu " in line)
    assert "small-llama" in row and "ddp, fsdp, zero" in row and "deepspeed" in row
    assert main(["spaces", "local_cpu"]) == 0
    assert capsys.readouterr().out == shipped_spaces()["local_cpu"].read_text()
    assert main(["spaces", "nope"]) == 2


def test_static_pruning_counts_and_reasons():
    space = space_from_dict(SPACE)
    # ddp 2 + fsdp 2 + zero 4 = 8 structures x 4 micro-batches = 32 combinations.
    assert space.total_combinations == 32
    # micro_batch 8 breaks the global batch (8 x 2 workers > 8): 8 structures; offload_param
    # without stage 3: 3 more (micro_batch 1, 2, 4); hybrid with 2 workers shards in a group of 2 (valid).
    assert sum(space.removed.values()) == 11 and len(space.candidates) == 21
    report = space.pruning_report()
    assert "32 combinations, 21 valid, 11 removed" in report
    assert "8 x global_batch" in report and "3 x zero.offload_param" in report


@pytest.mark.parametrize("patch, expected", [
    ({"space": {"strategy": {"zero": {"stagee": [1]}}}}, r"space.strategy: .*zero.stagee: unknown knob; allowed: stage, reduce_bucket_size"),
    ({"space": {"strategy": {"megatron": {}}}}, r"unknown strategy 'megatron'; allowed: ddp, fsdp, zero"),
    ({"space": {"micro_batch": []}}, r"micro_batch: empty list; allowed: one or more choices"),
    ({"space": {"env": {"NCCL_PROTO": ["LL256"]}}}, r"space.env.NCCL_PROTO: got 'LL256'; allowed"),
    ({"space": {"env": {"HF_TOKEN": ["x"]}}}, r"space.env.HF_TOKEN: looks like a credential"),
    ({"fixed": {"zero": {"stage": 2}}}, r"fixed: zero: set by the sweep, not fixed; put its choices under space.zero"),
    ({"fixed": {"micro_batch": 2}}, r"micro_batch: both fixed and swept; allowed: fixed.micro_batch or space.micro_batch"),
    ({"fixed": {"sequence": 2}}, r"fixed: sequence: not a plan field; allowed: model, "),
    ({"fixed": {"seq_len": 2}}, r"fixed.seq_len: got 2; Input should be greater than or equal to 8"),
    ({"search": {"algorithm": "bayes"}}, r"search.algorithm: got 'bayes'; Input should be 'calibrated', 'tpe', 'random' or 'grid'"),
])
def test_space_errors_name_the_key_path_and_what_is_allowed(tmp_path, patch, expected):
    import yaml

    data = json.loads(json.dumps(SPACE))
    for section, value in patch.items():
        data[section] = {**data.get(section, {}), **value}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpaceError, match=expected) as err:
        load_space(path)
    assert str(path) in str(err.value)


def test_a_space_with_no_valid_plan_is_rejected():
    data = {**SPACE, "space": {"strategy": {"ddp": {}}, "micro_batch": [3]}}
    with pytest.raises(SpaceError, match="no valid plan among 1 combinations"):
        space_from_dict(data)


def test_the_searcher_can_only_propose_valid_points():
    space = space_from_dict(SPACE)
    tree = CandidateTree(space)
    valid = {point_key(p["choices"], p["env"]) for p in all_points(space)}
    assert len(valid) == 42  # 21 structures x 2 env choices
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    sample = tree.define_by_run()
    seen = set()
    for _ in range(150):
        trial = study.ask()
        key = sample(trial)["point"]
        assert key in valid
        seen.add(key)
        study.tell(trial, 1.0)
    assert len(seen) > 30
    # A known point replays under the same parameters (warm start on resume).
    params, dists = tree.optuna_params(key)
    replay = optuna.create_study()
    replay.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=1.0))
    assert sample(optuna.trial.FixedTrial(params))["point"] == key


def _result(tps: float, spread: float, plan: dict) -> TrialResult:
    return TrialResult(status="ok", plan=plan, world_size=2, tokens_per_s_per_gpu=tps, step_time_spread=spread)


def test_verdict_ties_go_to_the_simpler_plan():
    ddp = load_plan_dict({"strategy": "ddp"}).to_dict()
    zero3 = load_plan_dict({"strategy": "zero", "zero": {"stage": 3}}).to_dict()
    fsdp = load_plan_dict({"strategy": "fsdp"}).to_dict()
    assert complexity(ddp) < complexity(fsdp) < complexity(zero3)
    standings = [Standing("z3", "zero-3", zero3, [_result(1000, 0.04, zero3), _result(1010, 0.04, zero3)]),
                 Standing("ddp", "ddp", ddp, [_result(985, 0.04, ddp), _result(995, 0.04, ddp)]),
                 Standing("fsdp", "fsdp", fsdp, [_result(700, 0.02, fsdp)])]
    verdict = decide(standings)
    assert [s.key for s in verdict.ranked] == ["z3", "ddp", "fsdp"]
    assert {s.key for s in verdict.tied_with_best} == {"z3", "ddp"}
    assert verdict.winner.key == "ddp"  # 1.5% slower, inside the noise, and simpler
    clear = decide([standings[0], Standing("ddp", "ddp", ddp, [_result(800, 0.01, ddp)])])
    assert clear.winner.key == "z3" and len(clear.tied_with_best) == 1


def test_exported_winner_loads_back(tmp_path):
    plan = load_plan_dict({"strategy": "zero", "zero": {"stage": 3, "overlap_comm": True}, "env": {"NCCL_ALGO": "Tree"}})
    written = export_winner(plan, tmp_path / "winner", {"label": "zero-3"})
    names = {p.name for p in written}
    assert {"plan.yaml", "deepspeed.json", "env.sh", "job.sh", "summary.json"} <= names
    assert load_plan(tmp_path / "winner" / "plan.yaml") == plan
    ds = json.loads((tmp_path / "winner" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_batch_size"] == plan.global_batch
    assert ds["gradient_clipping"] == plan.grad_clip
    assert "export NCCL_ALGO=Tree" in (tmp_path / "winner" / "env.sh").read_text()
    assert "ray job submit" in (tmp_path / "winner" / "job.sh").read_text()
    fsdp = export_winner(load_plan_dict({"strategy": "fsdp", "fsdp": {"sharding": "grad_op"}}), tmp_path / "f", {})
    settings = json.loads((tmp_path / "f" / "fsdp.json").read_text())
    assert settings["reshard_after_forward"] is False and any(p.name == "fsdp.json" for p in fsdp)


def test_the_sweep_searcher_never_repeats_and_finishes_when_the_space_is_spent(tmp_path):
    from ray.tune.search import Searcher

    from paratune.sweep.ledger import Ledger
    from paratune.sweep.searchers import optuna_searcher

    space = space_from_dict({**SPACE, "space": {"strategy": {"ddp": {}, "fsdp": {"sharding": ["full"]}},
                                                "micro_batch": [1, 2]}})
    searcher = optuna_searcher(space, "tpe", seed=0, ledger=Ledger(tmp_path / "ledger.jsonl"), budget_gb=None, trials=10)
    seen = []
    for i in range(6):
        config = searcher.suggest(f"t{i}")
        if config == Searcher.FINISHED:
            break
        key = config["point"]
        seen.append(key)
        plan = load_plan_dict({**SPACE["fixed"], **{k: v for k, v in json.loads(key)["choices"].items() if "." not in k}})
        result = TrialResult(status="ok", plan=plan.to_dict(), world_size=2, tokens_per_s_per_gpu=100.0 + i)
        searcher.on_trial_complete(f"t{i}", {"point": key, "trial_result": result.model_dump_json()})
    assert len(seen) == 4 and len(set(seen)) == 4  # 2 strategies x 2 micro-batches, then FINISHED


# ---- integer sizes in value lists (issue 26) ---------------------------------------------------
def test_space_size_choices_take_e_notation_and_hold_the_plan_value(tmp_path):
    path = tmp_path / "sizes.yaml"
    path.write_text("name: sizes\n"
                    "fixed: {model: tiny-llama, seq_len: 32, global_batch: 8, num_workers: 2}\n"
                    "space:\n"
                    "  strategy:\n"
                    "    zero:\n"
                    "      stage: [2]\n"
                    "      reduce_bucket_size: [1e8, 5e8, 500_000_000, 5.0e+8]\n"
                    "      stage3_prefetch_bucket_size: ['5e7']\n"
                    "  micro_batch: [2]\n")
    space = load_space(path)
    # 5e8, 500_000_000 and 5.0e+8 are one value: one candidate each, the choice as the plan holds it.
    assert sorted(c.choices["zero.reduce_bucket_size"] for c in space.candidates) == [100_000_000, 500_000_000]
    assert all(c.plan.zero.stage3_prefetch_bucket_size == 50_000_000 for c in space.candidates)
    assert space.total_combinations == 2


@pytest.mark.parametrize("choice, expected", [
    ("5.5e0", r"space.strategy: .*zero.reduce_bucket_size: got '5.5e0', not a whole number; allowed: an integer"),
    (True, r"space.strategy: .*zero.reduce_bucket_size: got True, a boolean; allowed: an integer"),
    (0, r"space.strategy: .*zero.reduce_bucket_size: got 0; Input should be greater than or equal to 1"),
])
def test_space_size_choices_that_no_plan_can_take_are_refused(choice, expected):
    data = {**SPACE, "space": {"strategy": {"zero": {"reduce_bucket_size": [5e8, choice]}}}}
    with pytest.raises(SpaceError, match=expected):
        space_from_dict(data)


# ---- the fixed part is validated with the values it is swept with (issue 26) ------------------
# Llama-3.1-405B's public shape (no preset ships it).
LLAMA_405B = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False}


def _llama_405b_space(tmp_path, tp: list[int], pp: list[int]):
    import yaml

    config = tmp_path / "llama-3.1-405b" / "config.json"
    config.parent.mkdir(exist_ok=True)
    config.write_text(json.dumps(LLAMA_405B))
    path = tmp_path / f"llama405b_64x8_tp{'-'.join(map(str, tp))}_pp{'-'.join(map(str, pp))}.yaml"
    path.write_text(yaml.safe_dump({
        "name": "llama405b-64x8",
        "fixed": {"model": str(config), "seq_len": 4096, "global_batch": 256, "num_workers": 512,
                  "gpus_per_node": 8, "precision": "bf16", "device": "cuda"},
        "space": {"strategy": {"fsdp": {"sharding": ["full"]}}, "micro_batch": [1], "tp": tp, "pp": pp,
                  "activation_checkpointing": ["full"]},
    }, sort_keys=False))
    return path


def test_fixed_valid_only_with_its_swept_degrees_is_a_space(tmp_path):
    # global batch 256 on 512 GPUs: dp 512 alone cannot split it, dp = 512 / (tp 8 x pp 8) = 8 can.
    space = load_space(_llama_405b_space(tmp_path, tp=[8], pp=[8]))
    assert [(c.plan.tp, c.plan.pp, c.plan.dp_degree, c.plan.grad_accum) for c in space.candidates] == [(8, 8, 8, 32)]
    # With tp/pp 1 swept too, the combinations that cannot split the batch are pruned, by rule.
    space = load_space(_llama_405b_space(tmp_path, tp=[1, 8], pp=[1, 8]))
    assert {(c.plan.tp, c.plan.pp) for c in space.candidates} == {(8, 1), (8, 8)}
    report = space.pruning_report()
    assert "4 combinations, 2 valid, 2 removed" in report and "1 x global_batch" in report
    assert "1 x grad_accum: N micro-batches per step with pp N leaves stages idle" in report  # tp1 pp8: dp 64


def test_paratune_plan_lists_plans_for_the_405b_space(tmp_path, capsys):
    from paratune.cli import main

    out = tmp_path / "plans.json"
    code = main(["plan", str(_llama_405b_space(tmp_path, tp=[8], pp=[8])), "--device", "h100-80gb",
                 "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "1 combinations, 1 valid, 0 removed" in printed and "fsdp:full mb1x32 tp8 pp8:1f1b dp8 ckpt bf16" in printed
    rows = json.loads(out.read_text())
    assert len(rows) == 1 and rows[0]["fits"]
    assert (rows[0]["plan"]["num_workers"], rows[0]["plan"]["tp"], rows[0]["plan"]["pp"]) == (512, 8, 8)
    assert 0 < rows[0]["predicted_peak_memory_gib"] < 80 and rows[0]["predicted_tokens_per_s_per_gpu"] > 0


def test_a_space_with_no_valid_combination_says_which_rules_broke(tmp_path):
    with pytest.raises(SpaceError) as err:
        load_space(_llama_405b_space(tmp_path, tp=[1], pp=[1]))
    msg = str(err.value)
    assert "space: no valid plan among 1 combinations (the fixed part with each choice of strategy, micro_batch [1]" in msg
    assert "1 x global_batch: 256 is not divisible by micro_batch x dp_degree = 1 x 512 = 512" in msg
    assert "allowed: tp x pp x cp in [2, 4, 8, 16, 32, 64, 128, 256, 512]" in msg


def test_fixed_fields_and_env_are_still_checked_alone(tmp_path):
    # What does not depend on the space is reported as the fixed part's, before any plan is built.
    with pytest.raises(SpaceError, match=r"space: fixed.global_batch: got '2.5e0', not a whole number"):
        space_from_dict({**SPACE, "fixed": {**SPACE["fixed"], "global_batch": "2.5e0"}})
    with pytest.raises(SpaceError, match=r"space: fixed.env.HOME: not a communication setting"):
        space_from_dict({**SPACE, "fixed": {**SPACE["fixed"], "env": {"HOME": "/x"}}})
    with pytest.raises(SpaceError, match=r"space: fixed.data: .*data.path: required when data.kind is 'text'"):
        space_from_dict({**SPACE, "fixed": {**SPACE["fixed"], "data": {"kind": "text"}}})


def test_the_data_loader_is_a_knob_a_space_sweeps(tmp_path):
    from paratune.out.tables import strategy_label

    (tmp_path / "c.txt").write_text("paratune " * 400)
    fixed = {"model": "tiny-llama", "num_workers": 2, "global_batch": 8, "data": {"kind": "text", "path": str(tmp_path / "c.txt")}}
    space = space_from_dict({"name": "loader", "fixed": fixed,
                             "space": {"data": {"loader_workers": [0, 2], "prefetch": [2, 4]}}})
    datas = sorted((c.plan.data.loader_workers, c.plan.data.prefetch) for c in space.candidates)
    assert datas == [(0, 2), (2, 2), (2, 4)]  # a prefetch without workers is refused (nothing would keep it)
    assert all(c.plan.data.kind == "text" for c in space.candidates)  # the fixed data kept
    labels = {strategy_label(c.plan.to_dict()) for c in space.candidates}
    assert any(label.endswith("loader2x4") for label in labels) and len(labels) == 3
    with pytest.raises(SpaceError, match="data.workers"):
        space_from_dict({"name": "x", "space": {"data": {"workers": [1]}}})
    with pytest.raises(SpaceError, match="data.prefetch: both fixed and swept"):
        space_from_dict({"name": "x", "fixed": {**fixed, "data": {**fixed["data"], "prefetch": 2}},
                         "space": {"data": {"prefetch": [2, 4]}}})
