"""bench/accuracy.py and bench/render_results.py: a tiny end-to-end run of the
script, and that docs/results.md is exactly what the renderer makes of the
recorded JSON files (seeds and spread: tests/test_bench_seeds.py)."""

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
    for name in ("accuracy", "edge_cost"):
        assert (RESULTS / f"{name}.json").exists(), f"run bench/{name}.py"
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
