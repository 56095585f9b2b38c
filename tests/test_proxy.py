"""The winner's loss-parity check: the proxy that stands in for a big model, and checks that cannot run.

Pure: no Ray. The proxy must be a valid plan with the original's degrees for every plan a sweep
can pick, and a check that cannot run must come back as a failed check with its reason (an
exception there, after the last trial, would lose the whole sweep's winner).
"""

from __future__ import annotations

import functools
import io
import json
import math
import time
from pathlib import Path

import pytest
from gloo_harness import one_torch_thread  # noqa: F401 (fixture: in-process references on one thread)

from paratune.model.build import build_config, parameter_counts
from paratune.config.model_config import load_config_dict
from paratune.sweep.parity import PROXY_HEAD_DIM, Parity, parity_proxy, proxy_shape, reference_losses, winner_parity
from paratune.config.plan import Plan, load_plan_dict
from paratune.sweep.space import load_space as _load_space
from paratune.cluster.trial import TrialResult

SPACES = sorted((Path(__file__).resolve().parents[1] / "search_spaces").glob("*.yaml"))
# The proxy may shrink the model and shorten the run; every other field (strategy and its options,
# degrees, batch split, precision, recomputation, data, env, ...) must stay the plan's own.
CHANGED = {"model_overrides", "seq_len", "warmup_steps", "measure_steps"}
PROXY_MAX_PARAMS = 5_000_000  # the reference runs on the driver's CPU


@functools.lru_cache(maxsize=None)
def load_space(path: Path):
    """A shipped space, loaded once for the module's tests (the 70B space's plans take ~20 s)."""
    return _load_space(path)


def _check_proxy(plan: Plan, max_params: int = PROXY_MAX_PARAMS) -> Plan:
    """The proxy validates on its own, keeps the plan's degrees and the family, and is small."""
    proxy = load_plan_dict(parity_proxy(plan).to_dict())
    original, small = plan.to_dict(), proxy.to_dict()
    assert {k: v for k, v in small.items() if k not in CHANGED} == {k: v for k, v in original.items()
                                                                     if k not in CHANGED}
    assert proxy.dp_degree == plan.dp_degree
    config = load_config_dict(proxy.model, proxy.model_overrides)
    assert config["model_type"] == load_config_dict(plan.model, plan.model_overrides)["model_type"]
    built = build_config(proxy.model, proxy.model_overrides)
    assert built.hidden_size == built.num_attention_heads * PROXY_HEAD_DIM
    assert (getattr(built, "head_dim", None) or built.hidden_size // built.num_attention_heads) == PROXY_HEAD_DIM  # None: derived
    assert parameter_counts(built)["total"] <= max_params
    return proxy


@pytest.mark.parametrize("space_file", SPACES, ids=[p.stem for p in SPACES])
def test_every_valid_plan_of_every_shipped_space_has_a_valid_proxy_with_its_degrees(space_file):
    space = load_space(space_file)
    start = time.perf_counter()
    for candidate in space.candidates:
        _check_proxy(candidate.plan)
    assert time.perf_counter() - start < 30, "proxying a space's plans must stay cheap"


def test_shipped_spaces_reach_the_degrees_the_fixed_proxy_broke():
    # The plans that made a 2-layer, 4-head proxy invalid are in the shipped spaces (so the test
    # above covers them): tp 4 and 8, pp 4, interleaved schedules.
    degrees = {(c.plan.tp, c.plan.pp, c.plan.pp_schedule) for f in SPACES for c in load_space(f).candidates}
    assert {(4, 1, "1f1b"), (8, 1, "1f1b"), (1, 4, "1f1b"), (1, 4, "interleaved_1f1b")} <= degrees


BIG = {"seq_len": 4096, "global_batch": 64, "micro_batch": 1, "num_workers": 32, "gpus_per_node": 8,
       "precision": "bf16", "strategy": "fsdp"}


@pytest.mark.parametrize("changes", [
    {"model": "llama3-70b", "tp": 8, "sequence_parallel": True},
    {"model": "llama3-70b", "pp": 4, "pp_schedule": "interleaved_1f1b", "micro_batch": 1},
    {"model": "llama3-70b", "pp": 8, "pp_schedule": "gpipe"},
    {"model": "qwen2.5-7b", "tp": 4, "sequence_parallel": True},  # 28 heads / 4 KV heads, biases on q/k/v
    {"model": "llama3.2-1b", "tp": 8},  # carries an explicit head_dim (64) that the proxy must follow
    {"model": "llama3.2-1b", "pp": 8, "pp_schedule": "interleaved_1f1b"},  # 16 stages over 16 layers
    {"model": "llama3-8b", "tp": 2, "strategy": "ddp", "num_workers": 8},
], ids=["70b-tp8-sp", "70b-pp4-interleaved", "70b-pp8", "qwen-tp4-sp", "1b-head_dim-tp8", "1b-pp8-interleaved",
        "8b-ddp-tp2"])
def test_proxy_is_sized_to_degrees_the_shipped_spaces_do_not_sweep(changes):
    _check_proxy(load_plan_dict({**BIG, **changes}))


def test_proxy_keeps_per_layer_keys_and_a_tokenizer_vocab(tmp_path):
    # A Qwen2 config.json as recent transformers saves it lists every layer's attention type;
    # transformers rejects a proxy whose layer count does not match that list.
    config = {**load_config_dict("qwen2.5-7b"), "layer_types": ["full_attention"] * 28}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = load_plan_dict({**BIG, "model": str(tmp_path / "config.json"), "pp": 2, "pp_schedule": "interleaved_1f1b",
                           "data": {"kind": "text", "path": str(tmp_path / "corpus.txt"),
                                    "tokenizer": str(tmp_path / "tokenizer")}})
    proxy = _check_proxy(plan, max_params=25_000_000)  # 152K x 128 embedding and head dominate
    built = build_config(proxy.model, proxy.model_overrides)
    assert built.num_hidden_layers == 4 and built.layer_types == ["full_attention"] * 4
    assert built.vocab_size == 152064  # a tokenizer's ids can be any of the model's vocab


def test_the_widest_proxy_trains_in_the_cpu_reference():
    # The widest proxy of the 70B space (tp 8 x pp 4: 16 heads, hidden 256, 8 layers) builds and
    # trains in the single-process reference. The fewest sequences the plan allows (one per pipeline
    # stage per dp rank): the space's global batch of 256 costs minutes on a shared 2-core CPU and
    # adds nothing to what this shows.
    plan = max((c.plan for c in load_space(SPACES[0].parent / "llama3_70b_4x8.yaml").candidates),
               key=lambda p: (p.tp, p.pp))
    proxy = parity_proxy(plan)
    assert proxy.tp == 8
    short = proxy.with_changes(global_batch=proxy.micro_batch * proxy.dp_degree * proxy.pp)
    losses = reference_losses(short, steps=1)
    assert len(losses) == 1 and math.isfinite(losses[0])


def _ok_result(plan: Plan, losses: list[float]) -> TrialResult:
    return TrialResult(status="ok", plan=plan.to_dict(), world_size=plan.num_workers, losses=losses)


PHI3_LONGROPE = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                 "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                 "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48}}


def test_proxy_that_cannot_be_built_is_a_failed_check_with_a_reason(tmp_path):
    # Phi-3 with LongRoPE: its rope factor lists have one entry per rotary dim pair (head dim 96 -> 48),
    # so the proxy's small head dim makes transformers reject the config. The model itself (3.8B
    # parameters, over the CPU reference's limit) builds; only its proxy does not.
    (tmp_path / "config.json").write_text(json.dumps(PHI3_LONGROPE))
    plan = load_plan_dict({"model": str(tmp_path / "config.json"), "seq_len": 256, "global_batch": 8, "micro_batch": 2,
                           "num_workers": 2, "strategy": "fsdp", "precision": "bf16"})
    assert parameter_counts(build_config(plan.model))["total"] > 200_000_000
    for given in (plan, plan.to_dict()):  # finish_sweep passes the ledger's plan dict
        check = winner_parity(given, _ok_result(plan, [5.0, 4.9, 4.8]))
        assert isinstance(check, Parity) and not check.passed and check.max_abs_loss_diff == math.inf
        assert "building the proxy" in check.reason and "short_factor" in check.reason
        assert check.proxy == proxy_shape(plan)


def test_plan_that_no_longer_loads_is_a_failed_check_with_a_reason():
    # A resumed sweep's ledger may hold a plan that today's rules reject (tp 3 does not divide 4 heads).
    stale = {"model": "tiny-llama", "num_workers": 3, "tp": 3, "strategy": "fsdp", "global_batch": 6,
             "micro_batch": 6}
    check = winner_parity(stale, TrialResult(status="ok", plan=stale, world_size=3, losses=[6.0]))
    assert not check.passed and check.max_abs_loss_diff == math.inf
    assert "loading the plan" in check.reason and "tp: 3 must divide attention heads" in check.reason


def test_small_model_is_compared_with_the_reference_directly():
    plan = load_plan_dict({"model": "tiny-llama", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
                           "num_workers": 2, "warmup_steps": 1, "measure_steps": 1})
    reference = reference_losses(plan)
    same = winner_parity(plan, _ok_result(plan, reference))
    assert (same.passed, same.max_abs_loss_diff, same.reason, same.proxy) == (True, 0.0, "", None)
    assert same.losses == same.reference_losses == pytest.approx(reference)  # what the sweep report draws
    off = winner_parity(plan, _ok_result(plan, [reference[0], reference[1] + 0.01]))
    assert not off.passed and off.max_abs_loss_diff == pytest.approx(0.01, rel=1e-3)
    assert "over tolerance 0.0001" in off.reason


def test_the_rounding_envelope_bounds_each_step_and_keeps_the_first_loss_exact():
    """The verdict against a rounding envelope, on an envelope of made-up members (no chaotic sample in
    the assertion): within margin x the members' largest deviation at every step passes, saying how the
    bound was made; beyond it at any one step fails, naming the step; a first loss off fails (another
    model) however wide the envelope; a model whose envelope is below the fixed tolerance keeps it."""
    from paratune.sweep.parity import RoundingEnvelope, parity_verdict

    plan = load_plan_dict({"model": "tiny-llama", "seq_len": 16, "global_batch": 4, "micro_batch": 2,
                           "num_workers": 2, "warmup_steps": 1, "measure_steps": 2, "lr": 1e-2})
    envelope = RoundingEnvelope({"weights draw 0": [0.0, 1e-3, 2e-2], "weights draw 1": [2e-6, 5e-4, 5e-2],
                                 "micro-batch 1 instead of 2": [0.0, 0.0, 1e-3]}, margin=4.0)
    assert envelope.spread == [2e-6, 1e-3, 5e-2]
    assert envelope.bound(1e-4) == pytest.approx([1e-4, 4e-3, 0.2])  # the fixed tolerance is its floor
    reference = [25.0, 22.0, 18.0]
    inside = parity_verdict(plan, [25.0, 22.003, 18.19], reference, envelope)
    assert inside.passed and "within this model's rounding envelope at every step" in inside.reason
    assert envelope.how() in inside.reason and "4 x the largest deviation, step by step, of 3 perturbed" in inside.reason
    assert inside.rounding_envelope["bound"] == pytest.approx([1e-4, 4e-3, 0.2])
    assert inside.to_record("x", "k")["rounding_envelope"]["members"] == envelope.members  # parity.json keeps it
    # each step against its own bound: step 1 off by 5e-3 fails though the last step's bound is 0.2
    early = parity_verdict(plan, [25.0, 22.005, 18.0], reference, envelope)
    assert not early.passed and "beyond this model's rounding envelope: step 1 is off by 0.005" in early.reason
    far = parity_verdict(plan, [25.0, 22.0, 18.0 + 10 * 0.2], reference, envelope)
    assert not far.passed and "step 2" in far.reason and "over tolerance 0.0001" in far.reason
    other = parity_verdict(plan, [25.001, 22.0, 18.0], reference, envelope)
    assert not other.passed and "the first losses differ" in other.reason and other.rounding_envelope is None
    quiet = RoundingEnvelope({"weights draw 0": [0.0, 1e-7, 5e-7]})  # Llama-like: the tolerance decides
    assert quiet.bound(1e-4) == [1e-4] * 3
    assert not parity_verdict(plan, [25.0, 22.0, 18.001], reference, quiet).passed


def test_a_model_that_amplifies_rounding_passes_within_its_rounding_envelope(tmp_path):
    """CPM-Ant at lr 1e-2 moves its later losses by 1e-3 and more when its initial weights move by fp32
    rounding: winner_parity makes the model's envelope itself and passes losses inside it, with the
    envelope in its record; the same figures beyond it, or a first loss that differs, fail."""
    from family_zoo import write_config

    from paratune.sweep.parity import ENVELOPE_DRAWS, rounding_envelope

    plan = load_plan_dict({"model": str(write_config("cpmant", tmp_path)), "seq_len": 16, "global_batch": 4,
                           "micro_batch": 2, "num_workers": 2, "warmup_steps": 1, "measure_steps": 2, "lr": 1e-2})
    reference = reference_losses(plan)
    envelope = rounding_envelope(plan, 3, reference=reference)
    assert len(envelope.members) == ENVELOPE_DRAWS + 1  # the draws and another micro-batch split
    assert envelope.spread[0] <= 1e-6 * reference[0]  # the first loss: nothing amplified yet
    assert envelope.spread[2] > 1e-4  # the model amplifies rounding past the fixed tolerance
    bound = envelope.bound(1e-4)
    inside = [reference[0], reference[1] + 0.5 * bound[1], reference[2] - 0.5 * bound[2]]
    check = winner_parity(plan, _ok_result(plan, inside))
    assert check.passed and "amplifies fp32 rounding at lr 0.01, and the first losses agree" in check.reason
    assert check.rounding_envelope["bound"] == bound  # the same ensemble, made again: deterministic
    far = winner_parity(plan, _ok_result(plan, [*reference[:2], reference[2] + 10 * bound[2]]))
    assert not far.passed and "beyond this model's rounding envelope: step 2" in far.reason
    other = winner_parity(plan, _ok_result(plan, [reference[0] + 1e-3, *inside[1:]]))
    assert not other.passed and "first losses differ" in other.reason


# --------------------------------------------------------------------------- finish_sweep, without Ray
@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A real MLflow store (sqlite), shared by the tests of this module: creating one takes seconds."""
    from paratune.out.tracking import SweepTracker

    return SweepTracker(f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


def _finish_space(space_fixed: dict):
    from paratune.sweep.space import space_from_dict

    return space_from_dict({"name": "finish", "fixed": space_fixed, "space": {"micro_batch": [2, 4]},
                            "search": {"algorithm": "grid", "trials": 2, "remeasure_rounds": 0}})


def _finish_with(tmp_path: Path, tracker, space_fixed: dict, measured: list[tuple[dict, float, list[float]]],
                 finishing_tracker=None):
    """Run the sweep's last phase (verdict, parity, export) on a ledger of given measurements.

    No re-measuring (remeasure_rounds 0), so no trial runs and no Ray starts. Returns the report,
    the MLflow parent run and what the console printed. finishing_tracker: the tracker _finish
    gets (default: `tracker`, which started the parent)."""
    from rich.console import Console

    from paratune.sweep.ledger import Ledger, LedgerEntry
    from paratune.sweep.finish import SweepOutcome, finish_sweep

    space = _finish_space(space_fixed)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for number, (plan, tokens_per_s, losses) in enumerate(measured, start=1):
        result = TrialResult(status="ok", plan=plan, world_size=plan["num_workers"], tokens_per_s_per_gpu=tokens_per_s,
                             step_time_spread=0.0, losses=losses)
        ledger.append(LedgerEntry(number, json.dumps({"micro_batch": plan["micro_batch"]}), result, "search"))
    parent = tracker.start_parent("finish", None, params={}, tags={})
    report = SweepOutcome(tmp_path / "sweep", parent, ledger.entries)
    report.out_dir.mkdir()  # run_sweep's folder
    console = Console(file=io.StringIO(), width=400)
    finish_sweep(space, report, ledger, finishing_tracker or tracker, None, console)
    return report, tracker.client.get_run(parent), console.file.getvalue()


def test_finish_without_a_buildable_proxy_ends_with_no_winner_and_the_reasons(tmp_path, tracker):
    # Before: the proxy's exception went through _finish, the sweep died after its last trial.
    model = tmp_path / "phi3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PHI3_LONGROPE))
    fixed = {"model": str(model / "config.json"), "seq_len": 256, "global_batch": 8, "num_workers": 2,
             "precision": "bf16"}
    plans = [load_plan_dict({**fixed, "micro_batch": mb}).to_dict() for mb in (2, 4)]
    report, parent, printed = _finish_with(tmp_path, tracker, fixed, [(plans[0], 900.0, [5.0, 4.9]),
                                                                      (plans[1], 800.0, [5.0, 4.9])])
    assert report.verdict.winner is None and report.winner_dir is None and report.winner_parity is None
    assert [f["label"] for f in report.parity_failures] == ["ddp mb2x2 bf16", "ddp mb4x1 bf16"]
    assert printed.count("fails loss parity (parity check failed while building the proxy") == 2
    assert all("building the proxy" in f["reason"] and "short_factor" in f["reason"] for f in report.parity_failures)
    assert "short_factor" in parent.data.tags["paratune.parity_failures"]
    assert parent.info.status == "FINISHED"


def test_finish_with_mlflow_down_keeps_the_winner_and_a_resume_logs_the_end_once(tmp_path, tracker, monkeypatch):
    """The tracking server is gone when the last trial is done: the winner is still exported and
    the sweep ends saying how to log it; the same _finish with MLflow back (what `--resume` runs)
    logs the trials and the winner, once."""
    import copy

    from mlflow.tracking import MlflowClient
    from procs import free_port
    from rich.console import Console

    from paratune.sweep.ledger import Ledger
    from paratune.sweep.finish import SweepOutcome, finish_sweep

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a refused connection fails at once
    down = copy.copy(tracker)
    down.client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    fixed = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2, "warmup_steps": 1,
             "measure_steps": 2}
    plans = [load_plan_dict({**fixed, "micro_batch": mb}) for mb in (2, 4)]
    report, parent, printed = _finish_with(tmp_path, tracker, fixed, [(p.to_dict(), t, reference_losses(p))
                                                                      for p, t in zip(plans, (900.0, 800.0))],
                                           finishing_tracker=down)
    assert report.verdict.winner.plan["micro_batch"] == 2 and (report.winner_dir / "plan.yaml").is_file()
    assert "MLflow: the sweep's end is not logged" in printed and "with `--resume` logs them" in printed, printed
    assert parent.info.status == "RUNNING" and "paratune.winner" not in parent.data.tags
    assert tracker.child_runs(parent.info.run_id) == []

    for _ in range(2):  # MLflow is back: `--resume` finishes again (a new report, the same ledger); twice: no change
        ledger = Ledger(tmp_path / "ledger.jsonl")
        again = SweepOutcome(report.out_dir, parent.info.run_id, ledger.entries)
        finish_sweep(_finish_space(fixed), again, ledger, tracker, None, Console(file=io.StringIO(), width=400))
    parent = tracker.client.get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["paratune.winner"] == "ddp mb2x2"
    assert sorted(int(r.data.tags["paratune.trial_number"]) for r in tracker.child_runs(parent.info.run_id)) == [1, 2]


def test_finish_falls_back_to_the_next_plan_and_records_why(tmp_path, tracker):
    fixed = {"model": "tiny-llama", "seq_len": 32, "global_batch": 8, "num_workers": 2, "warmup_steps": 1,
             "measure_steps": 2}
    fast, slow = (load_plan_dict({**fixed, "micro_batch": mb}) for mb in (2, 4))
    wrong = [loss + 0.5 for loss in reference_losses(fast)]  # fast, but it trains something else
    report, parent, printed = _finish_with(tmp_path, tracker, fixed, [(fast.to_dict(), 900.0, wrong),
                                                                      (slow.to_dict(), 800.0, reference_losses(slow))])
    assert report.verdict.winner.plan["micro_batch"] == 4 and report.winner_parity == 0.0
    assert [f["label"] for f in report.parity_failures] == ["ddp mb2x2"]
    assert "over tolerance" in report.parity_failures[0]["reason"] and "ddp mb2x2 fails loss parity" in printed
    summary = json.loads((report.winner_dir / "summary.json").read_text())
    assert summary["parity_failed_above"] == report.parity_failures and summary["parity_proxy"] is None
    assert summary["parity_bound"] is None  # the fixed tolerance decided: no rounding envelope
    assert parent.data.tags["paratune.winner"] == "ddp mb4x1"


@pytest.mark.parametrize("model, width", [("tiny-opt", {"ffn_dim": 16384, "hidden_size": 4096}),
                                          ("tiny-gptneox", {"intermediate_size": 16384, "hidden_size": 4096})])
def test_proxy_shrinks_families_that_name_their_widths_otherwise(model, width):
    """OPT keeps its feed-forward width in ffn_dim and neither it nor GPT-NeoX has KV heads: the
    proxy shrinks the width where the family keeps it and adds no key the family lacks."""
    plan = load_plan_dict({"model": model, "model_overrides": width, "num_workers": 2, "global_batch": 8,
                           "micro_batch": 2, "strategy": "ddp"})
    shape = proxy_shape(plan)
    assert "num_key_value_heads" not in shape
    proxy = _check_proxy(plan)
    config = load_config_dict(proxy.model, proxy.model_overrides)
    assert config[next(iter(width))] == 2 * config["hidden_size"]
