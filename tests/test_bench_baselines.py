"""bench/comm_cost.py, bench/accuracy.py and bench/render_results.py: the
formulas, tiny end-to-end runs of both scripts, and that docs/results.md is
exactly what the renderer makes of the recorded JSON files."""

from __future__ import annotations

import dataclasses
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


def _finished_report(run, data) -> dict:  # type: ignore[no-untyped-def]
    """The parts of a run report that comm_cost.reusable reads."""
    per_agent = data.train_samples // data.agents
    return {"status": "finished", "started_at": "2026-11-22T00:00:00Z",
            "config": {"method": run.method, "rounds": run.rounds, "dataset": data.dataset, "seed": data.seed,
                       "expected_agents": data.agents, "eval_every": run.eval_every, "method_config": dict(run.method_config)},
            "agents": {f"agent-{i}": {"num_samples": per_agent} for i in range(data.agents)},
            "rounds": [{"round": r + 1} for r in range(run.rounds)]}


def test_comm_cost_takes_the_accuracy_benchmarks_runs_of_the_same_spec_and_data(tmp_path: Path) -> None:
    comm, acc = load("comm_cost"), load("accuracy")
    full = acc.SCALES["full"]
    data = comm.DataSpec("fashion-mnist", "iid", acc.AGENTS, full.train_samples, full.test_samples)
    specs = {run.name: run for run in comm.runs(full.rounds, acc.BATCH)}
    # comm_cost's FedGKT fp16-zstd and FedAvg runs are the accuracy benchmark's iid runs, spec for spec.
    planned = {run.name: run for _t, _k, run in acc.runs(full.rounds, "noniid", full.train_samples)}
    assert specs["fedgkt-fp16-zstd"].method_config == planned["fedgkt-iid"].method_config
    assert specs["fedavg-resnet56"].method_config == planned["fedavg-resnet56-iid"].method_config
    root = tmp_path / "accuracy"
    scale_dir = root / f"full-{full.train_samples}-{full.test_samples}-{full.rounds}"
    for name, key, spec in (("fedgkt-iid", "iid", specs["fedgkt-fp16-zstd"]), ("fedavg-resnet56-noniid", "noniid", specs["fedavg-resnet56"])):
        (scale_dir / name).mkdir(parents=True)
        (scale_dir / name / "summary.json").write_text(json.dumps({"run": {"partition": key}}))
        (scale_dir / name / "report.json").write_text(json.dumps(_finished_report(spec, data)))
    found = comm.accuracy_bench_report(specs["fedgkt-fp16-zstd"], data, root)
    assert found == scale_dir / "fedgkt-iid" / "report.json"
    assert comm.reusable(found, specs["fedgkt-fp16-zstd"], data) is not None
    # Not for another codec, nor for the FedAvg run that exists only on the other partition,
    # nor for another data subset.
    assert comm.accuracy_bench_report(specs["fedgkt-u8-zstd"], data, root) is None
    assert comm.reusable(found, specs["fedgkt-u8-zstd"], data) is None
    assert comm.accuracy_bench_report(specs["fedavg-resnet56"], data, root) is None
    smaller = comm.DataSpec("fashion-mnist", "iid", acc.AGENTS, full.train_samples // 2, full.test_samples)
    assert comm.accuracy_bench_report(specs["fedgkt-fp16-zstd"], smaller, root) is None
    assert comm.reusable(found, specs["fedgkt-fp16-zstd"], smaller) is None
    # comm_cost's own runs record their data: the same spec on another partition is not reused.
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "report.json").write_text(json.dumps(_finished_report(specs["splitnn"], data)))
    (tmp_path / "own" / "data.json").write_text(json.dumps({**dataclasses.asdict(data), "partition": "dirichlet:0.5"}))
    assert comm.reusable(tmp_path / "own" / "report.json", specs["splitnn"], data) is None
    (tmp_path / "own" / "data.json").write_text(json.dumps(dataclasses.asdict(data)))
    assert comm.reusable(tmp_path / "own" / "report.json", specs["splitnn"], data) is not None


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
    if scale["complete"] and scale["name"] == "full":
        # The budget: the whole script in under 90 minutes on 2 cores, as measured.
        assert scale["within_budget"] is True and scale["wall_time_min"] < 90
    # --quick, "a 10-minute version": every run of the benchmark, as measured.
    quick = json.loads((RESULTS / "accuracy-quick.json").read_text())
    assert quick["generated_by"] == "bench/accuracy.py --quick" and quick["scale"]["name"] == "quick"
    assert quick["scale"]["complete"] and quick["scale"]["within_budget"] is True and quick["scale"]["wall_time_min"] < 10
    # The point of comm_cost's scale: every method reaches the headline target, so "bytes to
    # reach the target" is measured for each of them.
    assert all(r["measured"]["rounds_to_target"] is not None for r in comm["runs"].values())
    assert (ROOT / "docs" / "results.md").read_text() == render.render(RESULTS), "rerun bench/render_results.py"


@pytest.mark.slow
@pytest.mark.broker
def test_gkt_server_epochs_reuses_the_accuracy_run_and_trains_the_others(tmp_path: Path) -> None:
    acc, sweep = load("accuracy"), load("gkt_server_epochs")
    tiny = ["--train-samples", "64", "--test-samples", "32", "--rounds", "1"]
    assert acc.main([*tiny, "--only", "fedgkt-iid", "--out", str(tmp_path / "acc.json"), "--run-dir", str(tmp_path / "acc")]) == 0
    out = tmp_path / "sweep.json"
    assert sweep.main([*tiny, "--epochs", "2", "1", "--out", str(out), "--run-dir", str(tmp_path / "sweep"),
                       "--accuracy-run-dir", str(tmp_path / "acc")]) == 0
    data = json.loads(out.read_text())
    one, two = data["runs"]["1"], data["runs"]["2"]
    assert one["reused_from_accuracy_bench"] and not two["reused_from_accuracy_bench"]
    assert one["server_epochs"] == 1 and two["server_epochs"] == 2
    for run in (one, two):
        assert run["final_accuracy"] is not None and run["server_train_s_total"] > 0
    # Only the server's work changes: the agents train and upload the same.
    assert one["edge_train_flops_total"] == two["edge_train_flops_total"]
    assert not (tmp_path / "sweep" / "custom-64-32-1" / "fedgkt-iid-server-epochs-1").exists()
