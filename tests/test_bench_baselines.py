"""bench/comm_cost.py, bench/accuracy.py and bench/render_results.py: the
formulas, tiny end-to-end runs of both scripts, and that docs/results.md is
exactly what the renderer makes of the recorded JSON files (seeds and spread:
tests/test_bench_seeds.py)."""

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
    planned = {run.name: run for _t, _k, run in acc.runs(full.rounds)}
    assert specs["fedgkt-fp16-zstd"].method_config == planned["fedgkt-iid"].method_config
    assert specs["fedavg-resnet56"].method_config == planned["fedavg-resnet56-iid"].method_config
    root = tmp_path / "accuracy"
    scale_dir = acc.scale_folder(root, acc.scale_key(full))
    for name, key, spec in (("fedgkt-iid", "iid", specs["fedgkt-fp16-zstd"]), ("fedavg-resnet56-noniid", "noniid", specs["fedavg-resnet56"])):
        run_dir = scale_dir / acc.run_key(name, 0)
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"run": {"partition": key}}))
        (run_dir / "report.json").write_text(json.dumps(_finished_report(spec, data)))
    found = comm.accuracy_bench_report(specs["fedgkt-fp16-zstd"], data, root)
    assert found == scale_dir / "fedgkt-iid-seed0" / "report.json"
    assert comm.reusable(found, specs["fedgkt-fp16-zstd"], data) is not None
    # Not for another codec, nor for the FedAvg run that exists only on the other partition,
    # nor for another data subset, nor for another seed.
    assert comm.accuracy_bench_report(specs["fedgkt-u8-zstd"], data, root) is None
    assert comm.reusable(found, specs["fedgkt-u8-zstd"], data) is None
    assert comm.accuracy_bench_report(specs["fedavg-resnet56"], data, root) is None
    smaller = comm.DataSpec("fashion-mnist", "iid", acc.AGENTS, full.train_samples // 2, full.test_samples)
    assert comm.accuracy_bench_report(specs["fedgkt-fp16-zstd"], smaller, root) is None
    assert comm.reusable(found, specs["fedgkt-fp16-zstd"], smaller) is None
    assert comm.accuracy_bench_report(specs["fedgkt-fp16-zstd"], dataclasses.replace(data, seed=1), root) is None
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
    tiny = ["--train-samples", "64", "--test-samples", "32", "--rounds", "1", "--out", str(out), "--run-dir", str(tmp_path / "runs")]
    assert acc.main([*tiny, "--seeds", "0", "--only", "fedgkt-iid", "centralized-resnet8"]) == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"fedgkt-iid-seed0", "centralized-resnet8-seed0"}
    assert data["scale"]["name"] == "custom" and data["scale"]["agents"] == 4 and data["scale"]["seeds"] == [0]
    for run in data["runs"].values():
        assert run["final_accuracy"] is not None and len(run["rounds"]) == 1
    # The evaluation's figures by label, read from the run's real record: FedGKT's headline, its
    # personalised BatchNorm variant (the last round's) and the edges.
    final = data["runs"]["fedgkt-iid-seed0"]["final_evaluation"]
    assert {"model", "personalised_bn", "edge"} <= set(final["global"]) and {"model", "edge"} <= set(final["local"])
    assert data["cells"]["fedgkt-iid"]["n"] == 1 and not data["scale"]["complete"]
    # Each run left its summary; --merge keeps them next to the runs made now (an interrupted
    # benchmark resumes, invocations may run side by side), keyed by name and seed, and only
    # those of the same scale.
    assert acc.main([*tiny, "--seeds", "1", "--only", "fedgkt-iid", "--merge"]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["runs"]) == {"fedgkt-iid-seed0", "fedgkt-iid-seed1", "centralized-resnet8-seed0"}
    assert merged["runs"]["fedgkt-iid-seed0"] == data["runs"]["fedgkt-iid-seed0"]
    assert merged["cells"]["fedgkt-iid"]["n"] == 2 and merged["cells"]["fedgkt-iid"]["final_accuracy"]["sd"] is not None
    assert merged["scale"]["wall_time_s"] == pytest.approx(sum(r["run_wall_time_s"] for r in merged["runs"].values()))
    assert acc.main(["--train-samples", "96", "--test-samples", "32", "--rounds", "1", "--seeds", "0", "--only", "centralized-resnet8",
                     "--merge", "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"centralized-resnet8-seed0"}  # another scale: nothing merged
    # --collect runs nothing and writes the JSON of a scale from what its runs recorded.
    assert acc.main([*tiny, "--collect"]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"fedgkt-iid-seed0", "fedgkt-iid-seed1", "centralized-resnet8-seed0"}


def test_the_recorded_results_are_of_the_benches_schema() -> None:
    # What the files hold, not what they measured: a re-measurement may change any figure.
    for name in ("comm_cost", "accuracy", "edge_cost"):
        assert (RESULTS / f"{name}.json").exists(), f"run bench/{name}.py"
    comm = json.loads((RESULTS / "comm_cost.json").read_text())
    assert comm["generated_by"] == "bench/comm_cost.py"
    assert set(comm["runs"]) == {"fedgkt-raw", "fedgkt-fp16-zstd", "fedgkt-u8-zstd", "splitnn", "fedavg-resnet56"}
    accuracy = json.loads((RESULTS / "accuracy.json").read_text())
    assert accuracy["generated_by"].startswith("bench/accuracy.py")
    if accuracy.get("eval_set") is not None:
        # Table 1 with seeds: every run of every seed, keyed by name and seed.
        acc = load("accuracy")
        scale = accuracy["scale"]
        names = {run.name for _t, _k, run in acc.runs(scale["rounds"])}
        assert {r["name"] for r in accuracy["runs"].values()} <= names
        assert all(key == acc.run_key(r["name"], r["seed"]) for key, r in accuracy["runs"].items())
        # A JSON that lacks runs says so (and docs/results.md then says the table is incomplete).
        every = {acc.run_key(n, s) for n in names for s in scale["seeds"]}
        assert scale["complete"] == (every <= set(accuracy["runs"]) and len(scale["seeds"]) >= len(acc.SEEDS))
        assert isinstance(accuracy["budget"]["within_budget"], bool)
    if (RESULTS / "accuracy-quick.json").exists():
        quick = json.loads((RESULTS / "accuracy-quick.json").read_text())
        if quick.get("eval_set") is not None:
            assert quick["generated_by"] == "bench/accuracy.py --quick" and quick["scale"]["name"] == "quick"


def test_the_results_page_is_rendered_from_the_recorded_results() -> None:
    render = load("render_results")
    assert (ROOT / "docs" / "results.md").read_text() == render.render(RESULTS), "rerun bench/render_results.py"


@pytest.mark.slow
@pytest.mark.broker
def test_gkt_server_epochs_reuses_the_accuracy_run_and_trains_the_others(tmp_path: Path) -> None:
    acc, sweep = load("accuracy"), load("gkt_server_epochs")
    tiny = ["--train-samples", "64", "--test-samples", "32", "--rounds", "1"]
    assert acc.main([*tiny, "--seeds", "0", "--only", "fedgkt-iid", "--out", str(tmp_path / "acc.json"), "--run-dir", str(tmp_path / "acc")]) == 0
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
    assert not (tmp_path / "sweep" / "custom-4x-64-32-1" / "fedgkt-iid-server-epochs-1").exists()
