"""`paratune init`: a starter space the cost model vouches for, each choice commented, that `plan`
and `tune` read as written."""

from __future__ import annotations

import yaml

from paratune import cli
from paratune.sweep.space import load_space
from paratune.commands.starter import Hardware, find_hardware, starter_space


def test_the_hardware_is_what_was_asked_else_this_machine():
    assert find_hardware("h100-80gb", 16) == Hardware("h100-80gb", 16, 8, "--device h100-80gb --gpus 16")
    assert find_hardware("a100-40gb").workers == 8  # one node of the table's
    assert find_hardware("cpu").device == "cpu"
    assert find_hardware().device == "cpu"  # this machine: no GPU, no Ray cluster


def test_a_preset_on_cpu_gives_a_space_plan_and_tune_read_as_written(tmp_path, capsys):
    text = starter_space("tiny-llama", find_hardware())
    data = yaml.safe_load(text)
    assert data["fixed"]["device"] == "cpu" and data["fixed"]["precision"] == "fp32"
    assert set(data["space"]["strategy"]) == {"ddp", "fsdp", "zero"}
    # ZeRO's buckets scale with the model (hidden 64 squared), not DeepSpeed's 5e8 elements
    assert data["space"]["strategy"]["zero"]["reduce_bucket_size"] == [4096]
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert len(load_space(path).candidates) > 1
    assert cli.main(["plan", str(path), "--formula"]) == 0


def test_what_cannot_fit_is_dropped_with_its_reason(tmp_path, capsys):
    """Llama-3.2-1B on two 24 GB L4s, full fine-tune at seq 2048: micro-batch 8 fits no layout;
    every value left leads to a plan that fits; `init` writes the file and says what comes next."""
    path = tmp_path / "l4.yaml"
    assert cli.main(["init", "llama3.2-1b", "--device", "l4-24gb", "--gpus", "2", "--seq-len", "2048",
                     "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path} for 2 x l4-24gb" in out and f"plan {path}" in out
    text = path.read_text()
    assert "micro_batch: [1, 2, 4]  # 8 dropped: no plan with it fits" in text
    assert "memory_budget_gb: 22.8  # per GPU: 95% of l4-24gb's memory" in text
    assert "gpus_per_node: 2" in text and "tp: [1, 2]" in text
    assert "predicted fastest:" in text.splitlines()[1]


def test_nothing_fits_says_what_would(tmp_path, capsys):
    """The model above on one L4: its weights, gradients and Adam states alone (23.0 GiB) exceed the
    22.8 GiB budget. The same shapes as above, so their activation traces are reused (no tracing)."""
    assert cli.main(["init", "llama3.2-1b", "--device", "l4-24gb", "--gpus", "1", "--seq-len", "2048",
                     "--out", str(tmp_path / "x.yaml")]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "no plan of llama3.2-1b fits 1 x l4-24gb" in out and "allowed: more GPUs (--gpus)" in out
    assert "(weights+grads+optimizer 23.0 GiB alone)" in out
    assert not (tmp_path / "x.yaml").exists()
