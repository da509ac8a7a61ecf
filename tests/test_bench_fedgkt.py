"""bench/fedgkt_ablation.py end to end at a tiny scale, and the recorded FedGKT results
that docs/methods/fedgkt.md and docs/results.md state as conclusions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_bench_baselines import RESULTS, load


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


def _recorded(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: run bench/{name}.py")
    return json.loads(path.read_text())


def test_the_recorded_ablation_shows_the_two_causes() -> None:
    """docs/methods/fedgkt.md names two causes; the recorded runs must show them (IID)."""
    runs = _recorded("fedgkt_ablation")["runs"]
    old, shared = runs["old-iid"], runs["shared-init-iid"]
    # 1. One initialisation for every agent's extractor: the server model's accuracy as reported.
    assert shared["final_accuracy"] >= old["final_accuracy"] + 0.10
    # 2. Each agent's own BatchNorm statistics, same run and model, instead of the global averages.
    last = old["rounds"][-1]
    assert last["accuracy_per_agent_bn"] >= last["accuracy_global_bn"] + 0.10
    # Non-IID, label skew alone separates the agents' statistics: per-agent statistics matter with or without one init.
    for name in ("old-noniid", "shared-init-noniid"):
        last = runs[name]["rounds"][-1]
        assert last["accuracy_per_agent_bn"] >= last["accuracy_global_bn"] + 0.05


def test_the_recorded_fedgkt_runs_meet_the_targets() -> None:
    """IID: the server model ends at least as good as its agents' ResNet-8 and within 2 points
    of FedAvg (ResNet-56) or above, with no drop of more than 5 points after round 2. From the
    single-seed runs of an accuracy.json that predates seeds, or from the means over seeds."""
    data = _recorded("accuracy")
    if data.get("eval_set") is None:
        runs = data["runs"]
        gkt, avg = runs["fedgkt-iid"], runs["fedavg-resnet56-iid"]
        assert gkt["method_config"]["edge_init"] == "shared" and gkt["method_config"]["bn_stats"] == "per_agent"
        final, edge, baseline = gkt["final_accuracy"], gkt["final_edge_accuracy"], avg["final_accuracy"]
        accuracies = [r["accuracy"] for r in gkt["rounds"]]
        assert len(accuracies) == len(avg["rounds"])  # the same rounds
    else:
        gkt, avg = data["cells"]["fedgkt-iid"], data["cells"]["fedavg-resnet56-iid"]
        final, edge, baseline = gkt["final_accuracy"]["mean"], gkt["final_edge_accuracy"]["mean"], avg["final_accuracy"]["mean"]
        accuracies = [r["mean"] for r in gkt["accuracy_by_round"]]
        assert len(accuracies) == len(avg["accuracy_by_round"])  # the same rounds
    assert final >= edge
    assert final >= baseline - 0.02
    assert all(later >= earlier - 0.05 for earlier, later in zip(accuracies[1:], accuracies[2:]))
