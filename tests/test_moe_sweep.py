"""`paratune tune search_spaces/tiny_moe_cpu.yaml` end to end: a real Ray Tune sweep of tiny-mixtral
on 2 gloo workers (the session's in-process Ray, `ray_local`), its ledger, MLflow runs and report
carrying every trial's routing balance and all-to-all share."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rich.console import Console

from paratune.sweep.space import load_space
from paratune.sweep.ledger import Ledger
from paratune.sweep.driver import run_sweep
from paratune.sweep.folder import read_sweep
from paratune.sweep.page import _experts_html
from paratune.out.tables import results_table

# `e2e` (make test-e2e): `make test` keeps expert parallelism's parity and routing figures on gloo
# (test_expert_parallel, test_moe_measure) and a sweep on Ray (test_sweep).
pytestmark = [pytest.mark.integration, pytest.mark.e2e]

SPACE = Path(__file__).resolve().parents[1] / "search_spaces" / "tiny_moe_cpu.yaml"


def _ddp_only(tmp_path: Path) -> Path:
    """The shipped space with its strategies cut to ddp: ep 1 against ep 2, two trials (the suite's
    time; fsdp with ep trains like the reference in test_expert_parallel)."""
    import yaml

    data = yaml.safe_load(SPACE.read_text())
    data["space"]["strategy"] = {"ddp": {}}
    data["search"]["trials"] = 2
    path = tmp_path / "tiny_moe_cpu_ddp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_tiny_moe_sweep_records_routing_balance_and_all_to_all_share(ray_local, tmp_path, mlflow_uri):
    out = tmp_path / "sweep"
    # What `paratune tune` calls; the page's plots skipped (a minute here), its experts table read below.
    report = run_sweep(load_space(_ddp_only(tmp_path)), out, tracking_uri=mlflow_uri, report_page=False)
    results = [e.result for e in Ledger(out / "ledger.jsonl").entries if e.phase == "search"]
    layouts = {(r.plan["strategy"], r.plan.get("ep", 1)) for r in results if r.ok}
    assert layouts == {("ddp", 1), ("ddp", 2)}, [(r.status, r.message) for r in results]
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
    assert len(ep2) >= 1
    for run in ep2:
        assert run.data.metrics["all_to_all_share"] > 0
        assert run.data.metrics["routing_balance"] >= 1.0
        assert {"routing_balance_moe_layer_0", "routing_balance_moe_layer_1"} <= set(run.data.metrics)
    page = _experts_html(read_sweep(out))
    assert page.startswith("<h2>Experts</h2>") and page.count("<tr>") == 1 + len(results) and page.count("ep2") >= 1
    console = Console(width=250, record=True)
    console.print(results_table([(f"t{i}", r, None) for i, r in enumerate(results)]))
    text = console.export_text()
    assert "routing max/mean" in text and f"{results[0].routing_balance:.2f}" in text
