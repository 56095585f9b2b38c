"""What a plan reads from disk, checked by `validate` (and `plan`, and a sweep before Ray starts):
each mistake a newcomer makes is reported with the field, the value and what is allowed, and
relative paths are read from the plan file's folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from newcomer import make_pretrained, make_tokenizer, write_jsonl
from paratune import cli


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A user's folder: their pretrained model (with tokenizer), their data, a plan beside them."""
    root = tmp_path_factory.mktemp("user")
    make_pretrained(root / "my-model")
    write_jsonl(root / "notes.jsonl", field="body")
    make_tokenizer(root / "big-tokenizer", vocab_size=600)  # more ids than the model's 512
    return root


def _plan(home: Path, **changes) -> Path:
    plan = {"model": "my-model", "seq_len": 32, "global_batch": 4, "micro_batch": 2, "num_workers": 2,
            "data": {"kind": "jsonl", "path": "notes.jsonl", "text_field": "body", "tokenizer": "my-model"}}
    for key, value in changes.items():
        if key.startswith("data."):
            plan["data"][key.removeprefix("data.")] = value
        else:
            plan[key] = value
    path = home / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def _validate(path: Path, capsys, monkeypatch, cwd: Path) -> tuple[int, str]:
    monkeypatch.chdir(cwd)  # anywhere but the plan's folder: its relative paths are the plan's
    code = cli.main(["validate", str(path)])
    out = capsys.readouterr().out
    return code, " ".join(out.split())


def test_a_plan_with_relative_paths_is_read_from_its_own_folder(home, tmp_path, capsys, monkeypatch):
    code, out = _validate(_plan(home), capsys, monkeypatch, tmp_path)
    assert code == 0, out
    assert f"model: {home / 'my-model'}" in out and f"path: {home / 'notes.jsonl'}" in out


@pytest.mark.parametrize("changes, says", [
    ({"model": "./no-such-model"}, "model: got '{home}/no-such-model', neither a preset, a model folder nor a "
                                   "config.json path"),
    ({"model": "tiny-lama"}, "did you mean 'tiny-llama'?"),
    ({"data.path": "missing.jsonl"}, "data.path: '{home}/missing.jsonl': no such file"),
    ({"data.text_field": "text"}, "data.text_field: 'text': the first record of {home}/notes.jsonl has no field "
                                  "'text'; allowed: body"),
    ({"data.text_field": "bdy"}, "did you mean 'body'?"),
    ({"data.tokenizer": "no-tokenizer"}, "data.tokenizer: '{home}/no-tokenizer': no such folder"),
    ({"data.tokenizer": "big-tokenizer"}, "has 600 token ids, more than the model's vocab_size 512"),
    ({"micro_batchs": 2}, "micro_batchs: unknown field (value 2); did you mean 'micro_batch'?"),
])
def test_each_newcomer_mistake_is_named_by_validate(home, tmp_path, capsys, monkeypatch, changes, says):
    code, out = _validate(_plan(home, **changes), capsys, monkeypatch, tmp_path)
    assert code == 2 and says.format(home=home) in out, out


def test_plan_and_tune_stop_on_the_same_mistakes_before_ray_starts(home, tmp_path, capsys, monkeypatch):
    """A space with a missing data file: `plan` and `tune` refuse it at once (tune would otherwise
    start Ray, ~40 s here, before a trial found it)."""
    space = {"name": "notes", "fixed": {**yaml.safe_load(_plan(home, **{"data.path": "gone.jsonl"}).read_text())},
             "space": {"strategy": {"ddp": {}}}}
    path = home / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    monkeypatch.chdir(tmp_path)
    for argv in (["plan", str(path), "--device", "cpu"], ["tune", str(path), "--out", str(tmp_path / "out")]):
        assert cli.main(argv) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert f"data.path: '{home}/gone.jsonl': no such file" in out, out
    assert not (tmp_path / "out").exists()
