"""`paratune tune search_spaces/tiny_moe_cpu.yaml` end to end: a real Ray Tune sweep of tiny-mixtral
on 2 gloo workers (the session's in-process Ray, `ray_local`), its ledger, MLflow runs and report
carrying every trial's routing balance and all-to-all share."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from paratune.space import load_space
from paratune.sweep import Ledger, run_sweep

pytestmark = pytest.mark.integration

SPACE = Path(__file__).resolve().parents[1] / "search_spaces" / "tiny_moe_cpu.yaml"


def test_tiny_moe_sweep_records_routing_balance_and_all_to_all_share(ray_local, tmp_path, mlflow_uri):
    out = tmp_path / "sweep"
    report = run_sweep(load_space(SPACE), out, tracking_uri=mlflow_uri)  # what `paratune tune` calls
    results = [e.result for e in Ledger(out / "ledger.jsonl").entries if e.phase == "search"]
    layouts = {(r.plan["strategy"], r.plan.get("ep", 1)) for r in results if r.ok}
    assert layouts == {("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)}, [(r.status, r.message) for r in results]
    for r in results:
        assert r.routing_balance is not None and len(r.routing_balance_per_layer) == 2, r.plan
        assert r.routing_balance == max(r.routing_balance_per_layer) >= 1.0
        pairs = r.tokens_per_step * r.plan["measure_steps"] * 2  # top-2: every token to 2 experts
        assert [sum(layer) for layer in r.expert_tokens] == [pairs, pairs]
        if r.plan.get("ep", 1) == 2:
            assert 0.0 < r.all_to_all_share <= r.comm_share, r.plan
        else:
            assert r.all_to_all_share == 0.0
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_run(report.parent_run_id).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{report.parent_run_id}'")
    ep2 = [run for run in runs if run.data.params.get("ep") == "2"]
    assert len(ep2) >= 2
    for run in ep2:
        assert run.data.metrics["all_to_all_share"] > 0
        assert run.data.metrics["routing_balance"] >= 1.0
        assert {"routing_balance_moe_layer_0", "routing_balance_moe_layer_1"} <= set(run.data.metrics)
    page = (out / "report" / "report.html").read_text()
    assert '<table id="experts">' in page and page.count("ep2") >= 2
