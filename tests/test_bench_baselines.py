"""bench/comm_cost.py, bench/accuracy.py and bench/render_results.py: the
formulas, tiny end-to-end runs of both scripts, and that docs/results.md is
exactly what the renderer makes of the recorded JSON files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fedhelpers import ROOT

BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def load(name: str) -> ModuleType:
    # bench/ is not a package; appended (not prepended) to sys.path so that its codecs.py
    # can never shadow the standard library's, while `from _federation import ...` works.
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"edgesplit_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_analytic_formulas_are_eqs_12_and_13() -> None:
    comm = load("comm_cost")
    feature_map = 16 * 32 * 32 * 4
    assert comm.analytic("splitnn", 1000, 10, 4, None)["per_round_bytes"] == (feature_map + feature_map) * 1000
    assert comm.analytic("fedgkt", 1000, 10, 4, None)["per_round_bytes"] == (feature_map + 10 * 4) * 1000
    assert comm.analytic("fedavg", 1000, 10, 4, 591_322)["per_round_bytes"] == 2 * 591_322 * 4 * 4
    check = comm.paper_check()
    # Fig. 5's 249.6 / 125.3 GB are both ~38 passes of CIFAR-10 with these formulas.
    assert 37 < check["implied_sl_epochs_if_gb_is_1e9"] < 39 and 37 < check["implied_fedgkt_rounds_if_gb_is_1e9"] < 39


@pytest.mark.slow
@pytest.mark.broker
def test_comm_cost_runs_end_to_end(tmp_path: Path) -> None:
    comm = load("comm_cost")
    out = tmp_path / "comm.json"
    assert comm.main(["--dataset", "synthetic", "--agents", "2", "--train-samples", "32", "--test-samples", "16", "--rounds", "1",
                      "--batch-size", "16", "--target", "0.01", "--only", "fedgkt-u8-zstd", "splitnn",
                      "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"fedgkt-u8-zstd", "splitnn"}
    sl = data["runs"]["splitnn"]
    # Split learning's measured bytes are the formula's (fp32 maps up, gradients down) plus
    # evaluation uploads and framing: never less than the formula.
    assert sl["measured"]["wire_per_round_bytes"] >= sl["analytic"]["per_round_bytes"]
    assert sl["measured"]["rounds_to_target"] == 1
    assert data["runs"]["fedgkt-u8-zstd"]["analytic"]["measured_over_analytic"] < 1  # u8 maps are ~4x smaller


@pytest.mark.slow
@pytest.mark.broker
def test_accuracy_runs_end_to_end(tmp_path: Path) -> None:
    acc = load("accuracy")
    out = tmp_path / "acc.json"
    assert acc.main(["--train-samples", "64", "--test-samples", "32", "--rounds", "1", "--only", "fedgkt-iid", "centralized-resnet8",
                     "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"fedgkt-iid", "centralized-resnet8"}
    assert data["scale"]["name"] == "custom" and data["scale"]["agents"] == 8
    for run in data["runs"].values():
        assert run["final_accuracy"] is not None and len(run["rounds"]) == 1
    # Each run left its summary; --merge keeps them next to the runs made now (an interrupted
    # benchmark resumes, invocations may run side by side), and only those of the same scale.
    assert acc.main(["--train-samples", "64", "--test-samples", "32", "--rounds", "1", "--only", "centralized-resnet56", "--merge",
                     "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["runs"]) == {"fedgkt-iid", "centralized-resnet8", "centralized-resnet56"}
    assert merged["runs"]["fedgkt-iid"] == data["runs"]["fedgkt-iid"]
    assert merged["scale"]["wall_time_s"] == pytest.approx(sum(r["run_wall_time_s"] for r in merged["runs"].values()))
    assert acc.main(["--train-samples", "96", "--test-samples", "32", "--rounds", "1", "--only", "centralized-resnet8", "--merge",
                     "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"centralized-resnet8"}  # another scale: nothing merged
    # --collect runs nothing and writes the JSON of a scale from what its runs recorded.
    assert acc.main(["--train-samples", "64", "--test-samples", "32", "--rounds", "1", "--collect",
                     "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"fedgkt-iid", "centralized-resnet8", "centralized-resnet56"}


def test_recorded_results_exist_and_docs_are_rendered_from_them() -> None:
    render = load("render_results")
    for name in ("comm_cost", "accuracy", "edge_cost"):
        assert (RESULTS / f"{name}.json").exists(), f"run bench/{name}.py"
    comm = json.loads((RESULTS / "comm_cost.json").read_text())
    assert comm["generated_by"] == "bench/comm_cost.py"
    assert set(comm["runs"]) == {"fedgkt-raw", "fedgkt-fp16-zstd", "fedgkt-u8-zstd", "splitnn", "fedavg-resnet56"}
    accuracy = json.loads((RESULTS / "accuracy.json").read_text())
    assert accuracy["generated_by"].startswith("bench/accuracy.py")
    scale = accuracy["scale"]
    planned = {run.name: table for table, _key, run in load("accuracy").runs(scale["rounds"], "noniid", scale["train_samples"])}
    assert {name: r["table"] for name, r in accuracy["runs"].items()}.items() <= planned.items()
    # A JSON that lacks runs says so (and docs/results.md then says the table is incomplete).
    assert scale["complete"] == (set(accuracy["runs"]) == set(planned))
    assert (ROOT / "docs" / "results.md").read_text() == render.render(RESULTS), "rerun bench/render_results.py"
