"""bench/fedkd.py without training: its setting is the baselines' as it was measured, it reads FedKD's figures
from report.json (rounds[*].method), and it compares with the baselines' FedAvg run only on the
same data. The recorded bench/results/fedkd.json has communication and accuracy."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fedhelpers import ROOT

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_baselines import load  # noqa: E402
from test_report import make_report  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return load("fedkd")


def _figures(threshold: float, up: float, down: float, sync: int) -> dict[str, Any]:
    dense, mentor = 86_736, 4_800_208
    return {"threshold": threshold, "agents_used": 2, "up_svd_bytes": up, "down_svd_bytes": down, "fedkd_bytes": up + down,
            "dense_mentee_bytes": dense, "fedavg_mentor_bytes": mentor, "saved_vs_dense_mentee": round(1 - (up + down) / dense, 4),
            "saved_vs_fedavg_mentor": round(1 - (up + down) / mentor, 4), "sync_bytes": sync,
            "ranks": {"conv.weight": {"matrix": "16x144", "max_factored_rank": 14, "down": 15, "down_dense": True,
                                      "up_min": 12, "up_max": 15, "up_mean": 13.5, "up_dense": 1}}}


def test_setting_is_the_baselines(bench) -> None:  # type: ignore[no-untyped-def]
    """The baselines' setting as fedkd.json was measured with it (pinned in bench/fedkd.py since
    Table 1 moved to 4 agents and seeds), with the baselines' batch and partitions (bench/_federation.py)."""
    accuracy = load("_federation")
    runs = bench.plan(quick=False, learning_run=True)
    assert [r.key for r in runs] == ["iid", "noniid", "learning-iid"]
    recorded = json.loads((RESULTS / "fedkd.json").read_text())["runs"]
    for run in runs:
        setting = recorded[run.key]["setting"]
        assert (run.train_samples, run.test_samples, run.rounds, bench.AGENTS) == (
            setting["train_samples"], setting["test_samples"], setting["rounds"], setting["agents"])
    for run in runs[:2]:
        assert (run.train_samples, run.test_samples, run.rounds) == tuple(bench.QUICK.values())
        assert run.mentor == "resnet56" and accuracy.PARTITIONS[run.partition] in ("iid", "dirichlet:0.5")
        assert run.method_config()["batch_size"] == accuracy.BATCH
        assert "schedule_rounds" not in run.method_config()  # Eq. 9 follows the run's rounds
    assert runs[2].train_samples == bench.LEARNING["train_samples"]
    assert [r.key for r in bench.plan(quick=True, learning_run=True)] == ["iid"]


def test_summary_reads_the_method_figures(bench) -> None:  # type: ignore[no-untyped-def]
    report = make_report(rounds=3)  # round 2 failed its quorum
    report["rounds"][0]["method"] = _figures(0.95, 30_000.0, 25_000, 2 * 86_736)
    report["rounds"][2]["method"] = _figures(0.98, 40_000.0, 35_000, 0)
    run = bench.Run("iid", "test", "iid", 1200, 400, 3)
    summary = bench.summarize(run, report, 12.5)
    json.dumps(summary, allow_nan=False)
    ok = [r for r in summary["rounds"] if r["status"] == "ok"]
    assert [r["round"] for r in ok] == [1, 3] and summary["rounds"][1] == {"round": 2, "status": "failed_quorum"}
    assert [r["threshold"] for r in ok] == [0.95, 0.98]
    totals = summary["communication"]["per_agent_all_rounds_bytes"]
    assert totals["fedkd_payload"] == 55_000 + 75_000 and totals["fedavg_mentor_payload"] == 2 * 4_800_208
    assert totals["sync_payload"] == 2 * 86_736 / 8  # per agent: the bench's 8 agents
    saved = summary["communication"]["saved_vs_fedavg_mentor"]
    assert saved["payload"] == pytest.approx(1 - 130_000 / (2 * 4_800_208), abs=1e-4)
    assert summary["communication"]["saved_svd_vs_dense_mentee"] == pytest.approx(1 - 130_000 / (2 * 86_736), abs=1e-4)
    assert ok[0]["ranks"]["conv.weight"]["up_dense"] == 1
    assert ok[0]["matrices_sent_factored"] == {"uploads_mean": 0.5, "aggregate": 0, "of": 1}
    assert ok[1]["wire_bytes_per_agent"] == (report["rounds"][2]["bytes"]["up_wire"] + report["rounds"][2]["bytes"]["down_wire"]) / 8
    assert summary["final_global_mentee_accuracy"] == report["totals"]["final_accuracy"]


def test_fedavg_baseline_only_on_the_same_data(bench, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = bench.Run("learning-iid", "test", "iid", 3200, 800, 4, mentor="resnet20")
    rounds = [{"round": i, "accuracy": 0.1 * i, "wire": 8_000_000 * i} for i in range(1, 11)]
    accuracy_json = {"scale": {"name": "full", "agents": 8, "train_samples": 3200, "test_samples": 800, "batch_size": 32, "rounds": 10},
                     "machine": {"date_utc": "2026-11-22T21:00:00Z"},
                     "runs": {"fedavg-resnet56-iid": {"status": "finished", "final_accuracy": 0.9, "rounds": rounds}}}
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps(accuracy_json))
    baseline = bench.fedavg_baseline(run, path)
    assert baseline["rounds_compared"] == 4 and baseline["accuracy_by_round"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert baseline["wire_bytes_per_agent_round"] == [1_000_000 * i for i in range(1, 5)]
    ours = [{"wire_bytes_per_agent": 100_000.0} for _ in range(4)]
    assert bench.measured_comparison(ours, baseline) == {"rounds": 4, "fedkd_wire_bytes_per_agent": 400_000.0,
                                                         "fedavg_wire_bytes_per_agent": 10_000_000.0, "saved": 0.96}
    other = copy.deepcopy(accuracy_json)
    other["scale"]["train_samples"] = 1200  # another data subset: no comparison
    path.write_text(json.dumps(other))
    assert bench.fedavg_baseline(run, path) is None
    assert bench.fedavg_baseline(run, tmp_path / "missing.json") is None
    assert bench.measured_comparison(ours, None) is None


def test_the_recorded_results_are_of_the_benchs_schema() -> None:
    data = json.loads((RESULTS / "fedkd.json").read_text())
    assert data["benchmark"] == "fedkd"
    for key in ("iid", "noniid"):
        run = data["runs"][key]
        assert run["setting"]["agents"] == 8 and run["setting"]["dataset"] == "fashion-mnist"
        assert run["setting"]["partition"] == {"iid": "iid", "noniid": "dirichlet:0.5"}[key]
        assert run["status"] == "finished" and run["rounds_ok"] == run["setting"]["rounds"]
        assert 0.0 <= run["final_global_mentee_accuracy"] <= 1.0 and 0.0 <= run["final_mentor_accuracy"] <= 1.0
        saved = run["communication"]["saved_vs_fedavg_mentor"]
        assert set(saved) >= {"payload", "frames"}
        for r in run["rounds"]:
            assert set(r["payload_bytes_per_agent"]) >= {"fedkd_bytes", "fedavg_mentor_bytes"}
            assert all(entry["up_min"] >= 1 and entry["down"] >= 1 for entry in r["ranks"].values())
    assert data["runs"]["learning-iid"]["final_mentor_accuracy"] is not None
