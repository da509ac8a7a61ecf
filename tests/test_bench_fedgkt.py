"""bench/fedgkt_ablation.py end to end at a tiny scale, and its step-cost measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_bench_baselines import load


@pytest.mark.slow
@pytest.mark.broker
def test_the_ablation_runs_and_records_both_batchnorm_figures(tmp_path: Path) -> None:
    ablation = load("fedgkt_ablation")
    out = tmp_path / "ablation.json"
    args = ["--dataset", "synthetic", "--train-samples", "32", "--test-samples", "16", "--rounds", "1",
            "--partition", "iid", "--out", str(out), "--run-dir", str(tmp_path / "runs")]
    assert ablation.main([*args, "--only", "old"]) == 0
    assert ablation.main([*args, "--only", "shared-init", "--merge"]) == 0  # kept next to the first
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"old-iid", "shared-init-iid"}
    old, shared = data["runs"]["old-iid"], data["runs"]["shared-init-iid"]
    assert old["method_config"]["edge_init"] == "per_agent" and shared["method_config"]["edge_init"] == "shared"
    for run in (old, shared):
        (record,) = run["rounds"]
        assert 0 <= record["accuracy_global_bn"] <= 1 and 0 <= record["accuracy_per_agent_bn"] <= 1
        assert record["accuracy"] == record["accuracy_global_bn"]
    assert data["variants"]["shared-init"] == {"base": "old", "change": {"edge_init": "shared"},
                                               "tests": ablation.VARIANTS[1][3]}


def test_step_cost_measures_each_batch_size() -> None:
    cost = load("fedgkt_ablation").step_cost(batches=(2, 4), steps=1)
    assert set(cost["by_batch"]) == {"2", "4"}
    assert all(v["ms_per_map"] > 0 and v["step_ms"] > 0 for v in cost["by_batch"].values())
