"""A newcomer's first fine-tune, as the README's quick start tells it: their own pretrained folder
(saved with `save_pretrained`, with its tokenizer) and JSON-lines data; `init`, `plan`, `tune`,
then `train` with the command the sweep printed, then the folder loaded by AutoModelForCausalLM,
AutoTokenizer and pipeline; full fine-tune, then LoRA. No error, no third-party line before
paratune's own, and the commands printed are the ones that fit a local run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from newcomer import make_pretrained, write_jsonl
from paratune import cli

# `e2e` (make test-e2e): `make test` keeps each step's own tests: init (test_starter), plan (test_estimate),
# a sweep on Ray (test_sweep), LoRA on every strategy (test_adapters), the HF export (test_hf_export).
pytestmark = [pytest.mark.integration, pytest.mark.e2e]
PARATUNE = str(Path(sys.executable).parent / "paratune")


def _command(home: Path, *args: str) -> str:
    """A command as the user types it (a process of its own, in their folder): its whole output."""
    proc = subprocess.run([PARATUNE, *args], cwd=home, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip() == "", proc.stderr[:2000]  # nothing from a library
    return proc.stdout


def _in_process(capsys, *args: str) -> tuple[int, str]:
    """A Ray-using command in this process (it joins the session's Ray instead of starting one)."""
    code = cli.main(list(args))
    return code, capsys.readouterr().out


# The full fine-tune is `matrix` (make test-matrix; tests/tiers.py): the LoRA case runs the same commands
# (init, plan, tune, train --hf-out, from_pretrained and pipeline) with the adapters on top; init
# without --lora is test_starter's, `paratune train --hf-out` of a full fine-tune through Ray is
# test_cluster_jobs' training job (resumed after a killed worker, every tensor compared).
@pytest.mark.parametrize("lora", [pytest.param(False, id="full", marks=pytest.mark.matrix),
                                  pytest.param(True, id="lora")])
def test_a_first_fine_tune_from_the_readme(ray_local, tmp_path, capsys, monkeypatch, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    home = tmp_path
    make_pretrained(home / "my-model")
    write_jsonl(home / "notes.jsonl", field="body")
    monkeypatch.chdir(home)
    monkeypatch.setenv("PARATUNE_HOME", str(home / "paratune_runs"))

    out = _command(home, "init", "./my-model", "--data", "notes.jsonl", *(["--lora"] if lora else []))
    assert out.startswith("wrote my-model") and f"next:  {PARATUNE} plan" in out, out
    space = home / re.search(r"wrote (\S+\.yaml)", out).group(1)
    text = space.read_text()
    assert f"model: {home / 'my-model'}" in text and "text_field: body" in text and "tokenizer:" in text
    assert ("peft:" in text) is lora

    out = _command(home, "plan", space.name)
    assert out.startswith("device: cpu (the space's device"), out[:300]

    code, out = _in_process(capsys, "tune", space.name, "--trials", "2", "--tracking-uri",
                            f"sqlite:///{home / 'mlflow.db'}")
    assert code == 0, out[-3000:]
    assert "no profile" not in out, out  # the calibrated search got its profile (LoRA's included)
    train_line = next(line for line in out.splitlines() if line.startswith("train with it:"))
    command = shlex.split(train_line.removeprefix("train with it:"))
    assert command[:2] == [PARATUNE, "train"] and "ray job submit" not in train_line
    assert f"compare the trials in MLflow:  {PARATUNE} ui" in out

    steps = command.index("--steps")
    command[steps + 1] = "2"
    command[command.index("--checkpoint-every") + 1] = "1"
    code, out = _in_process(capsys, *command[1:], "--hf-out", "trained-model")
    assert code == 0, out[-3000:]

    folder = home / "trained-model"
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 300 and tokenizer.eos_token == "<eos>"
    generated = pipeline("text-generation", model=model, tokenizer=tokenizer)("note 7:", max_new_tokens=4)
    assert generated[0]["generated_text"].startswith("note 7:")
