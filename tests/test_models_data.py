"""Models from configs (never the hub) and deterministic per-rank data."""

import json

import pytest
import torch

from paratune.config.data import DataError, TokenBatches, pack_rows, step_loader
from paratune.config.model_config import ModelError, preset_names
from paratune.model.build import build_config, build_model, parameter_counts
from paratune.config.plan import DataSpec


def test_presets_include_cpu_and_real_shapes():
    assert {"tiny-llama", "llama3-8b", "llama3-70b", "qwen2.5-7b"} <= set(preset_names())
    cfg = build_config("qwen2.5-7b")
    assert cfg.model_type == "qwen2" and cfg.num_key_value_heads == 4


def test_llama_3_1_405b_has_its_published_size():
    """By hand from the public shape: per layer q and o 16384^2 each, k and v 16384 x 8 x 128 each,
    the SwiGLU MLP 3 x 16384 x 53248, two norms; 126 layers, untied embedding and head 128256 x 16384."""
    layer = 2 * 16384**2 + 2 * 16384 * 8 * 128 + 3 * 16384 * 53248 + 2 * 16384
    embedding = 128256 * 16384
    counts = parameter_counts(build_config("llama3.1-405b"))
    assert counts["total"] == 126 * layer + 16384 + 2 * embedding == 405_853_388_800


def test_every_listed_preset_builds():
    """`paratune models` builds every listed preset: the device table beside them is not one."""
    names = preset_names()
    assert "devices" not in names and "prediction_bands" not in names
    for name in names:
        assert build_config(name).num_hidden_layers >= 1
    with pytest.raises(ModelError, match="neither a preset"):
        build_config("devices")


def test_same_seed_same_weights_different_seed_different():
    cfg = build_config("tiny-llama")
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_local_config_path_and_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}))
    cfg = build_config(str(tmp_path / "config.json"), {"num_hidden_layers": 2})
    assert cfg.model_type == "mistral" and cfg.num_hidden_layers == 2
    assert build_model(cfg, seed=0)(torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 300)


def test_unknown_model_and_encoder_decoder_are_rejected(tmp_path):
    with pytest.raises(ModelError, match="model: got 'gpt-17', neither a preset, a model folder nor a config.json path .*; allowed: .*a preset: .*tiny-llama"):
        build_config("gpt-17")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ModelError, match="t5"):
        build_config(str(tmp_path / "config.json"))


def test_ranks_get_disjoint_deterministic_slices_of_the_global_batch():
    data = TokenBatches(DataSpec(), vocab_size=512, seq_len=16, global_batch=8, seed=1)
    r0 = data.micro_batches(step=0, dp_rank=0, dp_degree=2, micro_batch=2)
    r1 = data.micro_batches(step=0, dp_rank=1, dp_degree=2, micro_batch=2)
    assert len(r0) == 2 and r0[0].shape == (2, 16)
    assert torch.equal(torch.cat(r0 + r1), data.global_batch(0))
    assert not torch.equal(r0[0], r1[0])
    again = TokenBatches(DataSpec(), 512, 16, 8, seed=1).global_batch(0)
    assert torch.equal(again, data.global_batch(0))
    assert not torch.equal(data.global_batch(1), data.global_batch(0))
    assert int(data.global_batch(3).max()) < 512


def test_text_file_byte_level_packing(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello paratune " * 20)
    data = TokenBatches(DataSpec(kind="text", path=path), vocab_size=512, seq_len=16, global_batch=4, seed=0)
    batch = data.global_batch(0)
    assert batch.shape == (4, 16)
    assert set(batch.flatten().tolist()) <= set(b"helo paratune") | {256}
    # Every row comes from the packed stream; epochs continue past the end deterministically.
    assert torch.equal(data.global_batch(7), TokenBatches(DataSpec(kind="text", path=path), 512, 16, 4, 0).global_batch(7))


def test_jsonl_file_and_its_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a b c d e f g h"}\n{"text": "ijklmnopqrstuvwxyz"}\n')
    data = TokenBatches(DataSpec(kind="jsonl", path=path), vocab_size=300, seq_len=8, global_batch=2, seed=0)
    assert data.global_batch(0).shape == (2, 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="no string field 'text'"):
        TokenBatches(DataSpec(kind="jsonl", path=bad), 300, 8, 2, 0)
    with pytest.raises(DataError, match="byte-level tokens need vocab_size >= 257"):
        TokenBatches(DataSpec(kind="text", path=path), 128, 8, 2, 0)
    with pytest.raises(DataError, match="fewer than one row"):
        pack_rows(torch.arange(5), 8)


def test_parquet_column_packs_like_the_same_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["a b c d e f g h", "ijklmnopqrstuvwxyz", "paratune " * 5]
    pq.write_table(pa.table({"id": [1, 2, 3], "body": docs}), tmp_path / "docs.parquet")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    parquet = TokenBatches(DataSpec(kind="parquet", path=tmp_path / "docs.parquet", text_field="body"), 300, 8, 2, 0)
    jsonl = TokenBatches(DataSpec(kind="jsonl", path=tmp_path / "docs.jsonl", text_field="body"), 300, 8, 2, 0)
    assert torch.equal(parquet.global_batch(3), jsonl.global_batch(3))
    with pytest.raises(DataError, match="'text' is not a column .* columns: id, body"):
        TokenBatches(DataSpec(kind="parquet", path=tmp_path / "docs.parquet"), 300, 8, 2, 0)
    with pytest.raises(DataError, match="row 0 of column 'id' is int"):
        TokenBatches(DataSpec(kind="parquet", path=tmp_path / "docs.parquet", text_field="id"), 300, 8, 2, 0)
    with pytest.raises(DataError, match="not a Parquet file"):
        TokenBatches(DataSpec(kind="parquet", path=tmp_path / "docs.jsonl", text_field="body"), 300, 8, 2, 0)


def test_the_loader_with_workers_gives_each_rank_its_steps_in_order(tmp_path):
    """loader_workers: steps built in a spawned worker process equal the in-process slices (the
    reference's), in step order, for a file source too."""
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog " * 40)
    spec = DataSpec(kind="text", path=tmp_path / "c.txt", loader_workers=1, prefetch=3)
    data = TokenBatches(spec, vocab_size=300, seq_len=16, global_batch=8, seed=3)
    got = list(step_loader(data, 2, 4, dp_rank=1, dp_degree=2, micro_batch=2))
    assert len(got) == 4
    for i, micro in enumerate(got):
        want = data.micro_batches(2 + i, 1, 2, 2)
        assert len(micro) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(micro, want))
    in_process = TokenBatches(DataSpec(), 300, 16, 8, 3)
    assert [m.shape for m in next(step_loader(in_process, 0, 1, 0, 2, 2))] == [(2, 16), (2, 16)]


def test_a_frozen_models_blocks_are_found_once_and_an_unfrozen_ones_every_time():
    """The pre-launch checks walk one shared meta model per config for every plan of a space: a model
    marked read-only keeps block_stacks' answer; a model a layout may still change never does."""
    from paratune.model.build import block_stacks, freeze_structure
    from paratune.model.materialize import build_meta

    config = build_config("tiny-llama")
    live = build_meta(config)
    assert block_stacks(live) is not block_stacks(live)  # walked again each time
    frozen = freeze_structure(build_meta(config))
    first = block_stacks(frozen)
    assert block_stacks(frozen) is first
    assert [(name, len(stack)) for name, stack in first] == [(name, len(stack)) for name, stack in block_stacks(live)]


def test_a_frozen_models_tp_and_float8_answers_are_kept_per_degree_and_equal_the_walked_ones():
    """The checks' answers per tp degree (float8's skipped linears, tp's plan entries) are kept on a
    frozen model, one per degree, and equal what a walk of a live model gives at that degree."""
    from paratune.config.plan import load_plan_dict
    from paratune.model.build import freeze_structure, remembered
    from paratune.model.materialize import build_meta
    from paratune.parallel.float8 import skipped_linears

    config = build_config("tiny-llama")
    live, frozen = build_meta(config), freeze_structure(build_meta(config))
    calls = []
    assert remembered(frozen, "k", lambda: calls.append(1) or len(calls)) == 1
    assert remembered(frozen, "k", lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    assert remembered(live, "k", lambda: calls.append(1) or len(calls)) == 2
    assert remembered(live, "k", lambda: calls.append(1) or len(calls)) == 3
    plans = {tp: load_plan_dict({"model": "tiny-llama", "num_workers": tp, "tp": tp, "strategy": "fsdp",
                                 "float8": "tensorwise", "precision": "bf16", "seq_len": 32, "global_batch": 4,
                                 "micro_batch": 1})
             for tp in (1, 2)}
    kept = {tp: skipped_linears(frozen, plan) for tp, plan in plans.items()}
    assert skipped_linears(frozen, plans[2]) is kept[2] and kept[1] is not kept[2]
    for tp, plan in plans.items():
        assert kept[tp] == skipped_linears(live, plan)
    assert kept[1] != kept[2]  # tiny-llama's widths: a tp split below 16 per rank stays bf16
