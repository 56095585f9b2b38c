"""float8 says what it converts: before any worker starts, `validate` and `plan` name the linears a
float8 plan leaves in bf16 and why, and a plan converting under half of its linear FLOPs is
labelled partial. The prediction is the workers' own rule (paratune.parallel.float8.skipped_linears)
on the checks' meta model; the runtime conversion of a fresh meta model must record the same set.

small-llama (hidden 256, MLP 688, 4 blocks): 688 is a multiple of 16 whole, 344 a rank at tp 2,
so tp 2 leaves the 12 MLP linears in bf16; the attention (q/o 256, k/v 128 wide) converts at both.
"""

import pytest
import yaml
from conftest import BASE_PLAN
from torch import nn

from paratune.config.plan import load_plan_dict
from paratune.model.build import build_config
from paratune.model.materialize import build_meta
from paratune.out.tables import strategy_label
from paratune.parallel.float8 import (HEAD_REASON, PARTIAL_SHARE, SKIPPED_ATTR, Float8Coverage, coverage_notice,
                                      plan_float8_coverage)

SMALL = {**BASE_PLAN, "model": "small-llama", "precision": "bf16", "float8": "tensorwise", "strategy": "fsdp",
         "seq_len": 128, "global_batch": 8}
MLP = {f"model.layers.{i}.mlp.{p}_proj" for i in range(4) for p in ("gate", "up", "down")}
# Per block: attention q 256x256 + k, v 256x128 + o 256x256 = 196,608; MLP 3 x 256 x 688 = 528,384.
ATTENTION_SHARE = 196_608 / (196_608 + 528_384)  # 27.1%: what tp 2 converts
# head_dim 24, 2 KV heads and MLP 704 at tp 2: k and v are 48 wide, 24 a rank (bf16); q, o and the
# MLP (352 a rank) convert: 96% of the FLOPs
KV_BF16 = {"head_dim": 24, "num_key_value_heads": 2, "intermediate_size": 704}


def _plan(**fields):
    return load_plan_dict({**SMALL, **fields})


def test_tp2_small_llama_names_its_bf16_mlp_with_the_per_rank_reason_and_its_converted_share():
    plan = _plan(tp=2)
    coverage = plan_float8_coverage(plan)
    assert set(coverage.skipped) == MLP | {"lm_head"} and coverage.linears == 29
    assert coverage.skipped["model.layers.2.mlp.up_proj"].startswith("out_features 688 / tp 2 = 344 per rank not a "
                                                                     "multiple of 16")
    assert coverage.skipped["model.layers.0.mlp.down_proj"].startswith("in_features 688 / tp 2 = 344 per rank")
    assert coverage.share == pytest.approx(ATTENTION_SHARE) and coverage.partial
    notice = coverage_notice(plan)
    assert notice[0] == ("float8: 'tensorwise' at tp 2 leaves 13 of 29 linears of 'small-llama' in bf16 and converts "
                         "27% of the linear FLOPs (the LM head aside):")
    # grouped over the blocks: one line a projection, each with its reason; the head once
    assert "  model.layers.*.mlp.gate_proj (x4): out_features 688 / tp 2 = 344 per rank not a multiple of 16 " \
           "(CUDA's _scaled_mm)" in notice
    assert any(line.startswith("  model.layers.*.mlp.down_proj (x4): in_features 688 / tp 2 = 344") for line in notice)
    assert sum("lm_head" in line for line in notice) == 1
    assert not any("self_attn" in line for line in notice)


def test_a_plan_where_every_block_linear_converts_names_nothing():
    for plan in (_plan(), _plan(tp=2, model_overrides={"intermediate_size": 704})):  # 704 / 2 = 352 = 16 x 22
        coverage = plan_float8_coverage(plan)
        assert coverage.skipped == {"lm_head": HEAD_REASON} and coverage.share == 1.0
        assert coverage_notice(plan) == []
        assert strategy_label(plan.to_dict()).endswith(" fp8:tensorwise")
    assert plan_float8_coverage(_plan(float8="none")) is None and coverage_notice(_plan(float8="none")) == []


def test_the_label_says_partial_only_under_half_of_the_linear_flops():
    assert strategy_label(_plan(tp=2).to_dict()) == "fsdp:full mb2x4 tp2 dp1 bf16 fp8:tensorwise(partial 27%)"
    assert strategy_label(_plan(tp=2, float8_all_gather=True).to_dict()).endswith("fp8:tensorwise+ag(partial 27%)")
    mostly = _plan(tp=2, model_overrides=KV_BF16)
    coverage = plan_float8_coverage(mostly)
    assert set(coverage.beyond_head()) == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "kv"}
    assert 0.9 < coverage.share < 1 and not coverage.partial
    assert strategy_label(mostly.to_dict()).endswith(" fp8:tensorwise")  # named by validate/plan, not the label
    notice = "\n".join(coverage_notice(mostly))
    assert "model.layers.*.self_attn.k_proj (x4): out_features 48 / tp 2 = 24 per rank" in notice
    assert Float8Coverage(3, {}, PARTIAL_SHARE).partial is False and Float8Coverage(3, {}, 0.49).partial
    # a plan dict whose model cannot be built here (a stored trial's) keeps its plain label
    stored = {**_plan(tp=2).to_dict(), "model": "/nowhere/config.json"}
    assert strategy_label(stored).endswith(" fp8:tensorwise")


@pytest.mark.parametrize("fields", [{"tp": 2}, {"tp": 2, "model_overrides": KV_BF16}, {}])
def test_the_runtime_conversion_skips_exactly_the_predicted_linears(fields):
    """convert_to_float8 (the workers' before_layout step) on a fresh meta model records in
    SKIPPED_ATTR the same linears the prediction named, and converts every other one."""
    pytest.importorskip("torchao.float8")
    from paratune.parallel.float8 import convert_to_float8, converted_linears

    plan = _plan(**fields)
    predicted = plan_float8_coverage(plan).skipped
    model = build_meta(build_config(plan.model, plan.model_overrides))
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    convert_to_float8(model, plan)
    assert getattr(model, SKIPPED_ATTR) == predicted
    assert converted_linears(model) == [name for name in linears if name not in predicted]


def test_validate_and_plan_print_the_bf16_linears_before_any_worker_starts(tmp_path, capsys):
    from paratune.cli import main

    partial, whole = tmp_path / "tp2.yaml", tmp_path / "tp1.yaml"
    partial.write_text(yaml.safe_dump({**SMALL, "tp": 2}))
    whole.write_text(yaml.safe_dump(SMALL))
    assert main(["validate", str(partial)]) == 0
    said = capsys.readouterr().out
    assert "# float8: 'tensorwise' at tp 2 leaves 13 of 29 linears of 'small-llama' in bf16" in said
    assert "#   model.layers.*.mlp.up_proj (x4): out_features 688 / tp 2 = 344 per rank" in said
    assert yaml.safe_load(said)["tp"] == 2  # the notice is comments: the output is still a plan file
    assert main(["validate", str(whole)]) == 0
    assert "float8:" not in capsys.readouterr().out.replace("float8: tensorwise", "")
    assert main(["plan", str(partial), "--device", "h100-80gb"]) == 0
    said = capsys.readouterr().out
    assert "leaves 13 of 29 linears of 'small-llama' in bf16" in said and "mlp.down_proj (x4): in_features 688" in said
