"""bench/_runs.py: the resumable grid loop of bench/robustness.py, bench/update_directions.py and
bench/defence_scores.py, with a stand-in run (no federation): what runs under --resume and
--only, what is kept, that the JSON is on disk after every run, and the error for an unknown name."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from test_bench_baselines import load

RUNS = load("_runs")  # once: its error type is the one the tests catch
MACHINE = {"cpu_model": "test", "date_utc": "2026-01-01T00:00:00Z"}
SCALE = {"rounds": 2, "dataset": "synthetic"}


@dataclasses.dataclass(frozen=True)
class Run:
    name: str


GRID = [Run("a"), Run("b"), Run("c")]


class Recorder:
    """A stand-in ``run_one``: records what ran, reads the JSON as it stands when each run starts,
    and can fail on a chosen run (an interrupted bench)."""

    def __init__(self, out: Path, fail_on: str | None = None, value: int = 1) -> None:
        self.out, self.fail_on, self.value = out, fail_on, value
        self.ran: list[str] = []
        self.on_disk_at_start: list[list[str] | None] = []

    def __call__(self, run: Run, work: Path) -> dict[str, Any]:
        self.on_disk_at_start.append([r.get("name") for r in json.loads(self.out.read_text())["runs"]]
                                     if self.out.exists() else None)
        if run.name == self.fail_on:
            raise RuntimeError(f"interrupted at {run.name}")
        (work / run.name).mkdir()
        (work / run.name / "scratch").write_text("x")
        self.ran.append(run.name)
        return {"name": run.name, "value": self.value}


def _head(started: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"benchmark": "test", "machine": started, **SCALE, "runs_so_far": len(runs)}


def _grid(out: Path, recorder: Recorder, **kw: Any) -> list[dict[str, Any]]:
    runs = RUNS
    options: dict[str, Any] = {"resume": False, "only": None, "machine_now": lambda: dict(MACHINE)}
    options.update(kw)
    return runs.run_grid(GRID, recorder, out, dict(SCALE), _head, **options)  # type: ignore[no-any-return]


def test_every_run_in_grid_order_the_json_written_after_each(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    recorder = Recorder(out)
    kept = _grid(out, recorder, summary=lambda runs: {"total": sum(r["value"] for r in runs)})
    assert recorder.ran == ["a", "b", "c"]
    # Before the first run there is no file; before each later one, the runs finished so far.
    assert recorder.on_disk_at_start == [None, ["a"], ["a", "b"]]
    data = json.loads(out.read_text())
    assert list(data) == ["benchmark", "machine", "rounds", "dataset", "runs_so_far", "complete", "missing", "summary", "runs"]
    assert data["complete"] and data["missing"] == [] and data["summary"] == {"total": 3} and data["runs_so_far"] == 3
    assert [r["name"] for r in kept] == ["a", "b", "c"] and data["runs"] == kept


def test_an_interrupted_grid_keeps_what_it_finished_and_resume_runs_only_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="interrupted at b"):
        _grid(out, Recorder(out, fail_on="b"))
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == ["a"] and not data["complete"] and data["missing"] == ["b", "c"]
    assert "summary" not in data
    later = dict(MACHINE, date_utc="2026-02-02T00:00:00Z")
    recorder = Recorder(out, value=2)
    _grid(out, recorder, resume=True, machine_now=lambda: later)
    assert recorder.ran == ["b", "c"]  # a is recorded: skipped
    data = json.loads(out.read_text())
    assert [(r["name"], r["value"]) for r in data["runs"]] == [("a", 1), ("b", 2), ("c", 2)] and data["complete"]
    assert data["machine"] == MACHINE  # the machine the first invocation found
    # Everything recorded: --resume runs nothing, and writes the same runs.
    recorder = Recorder(out)
    _grid(out, recorder, resume=True)
    assert recorder.ran == [] and json.loads(out.read_text())["runs"] == data["runs"]


def test_without_resume_the_grid_starts_afresh_and_another_scale_is_not_kept(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    _grid(out, Recorder(out))
    recorder = Recorder(out, value=5)
    _grid(out, recorder)
    assert recorder.ran == ["a", "b", "c"]
    other = json.loads(out.read_text())
    other["rounds"] = 3  # written at another scale
    out.write_text(json.dumps(other))
    recorder = Recorder(out, value=7)
    _grid(out, recorder, resume=True)
    assert recorder.ran == ["a", "b", "c"]
    assert [r["value"] for r in json.loads(out.read_text())["runs"]] == [7, 7, 7]


def test_only_runs_those_names_again_and_keeps_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    _grid(out, Recorder(out, fail_on="c"), only=["a", "b"])  # c never runs: no interruption
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == ["a", "b"] and data["missing"] == ["c"]
    recorder = Recorder(out, value=9)
    _grid(out, recorder, only=["b"])  # without --resume: the recorded runs are kept all the same
    assert recorder.ran == ["b"]
    assert [(r["name"], r["value"]) for r in json.loads(out.read_text())["runs"]] == [("a", 1), ("b", 9)]
    recorder = Recorder(out)
    _grid(out, recorder, only=[])  # nothing to run: the JSON is written again as it was
    assert recorder.ran == [] and [r["name"] for r in json.loads(out.read_text())["runs"]] == ["a", "b"]


def test_an_unknown_only_name_is_an_error_naming_the_grids_runs_before_anything_runs(tmp_path: Path) -> None:
    runs = RUNS
    out = tmp_path / "bench.json"
    recorder = Recorder(out)
    with pytest.raises(runs.UnknownRunError, match=r"no run named zz in the grid; its runs: a, b, c"):
        _grid(out, recorder, only=["a", "zz"])
    assert recorder.ran == [] and not out.exists()
    with pytest.raises(ValueError, match="twice"):
        runs.run_grid([Run("a"), Run("a")], recorder, out, {}, _head, resume=False, only=None, machine_now=dict)


def test_recorded_names_and_the_scratch_directories(tmp_path: Path) -> None:
    """A bench whose results carry no ``name`` names them its own way (bench/robustness.py:
    ``Case.of(run).name``); each run's ``work / name`` is gone after it."""
    out = tmp_path / "bench.json"
    seen: list[Path] = []

    def run_one(run: Run, work: Path) -> dict[str, Any]:
        for earlier in seen:
            assert not earlier.exists()
        seen.append(work / run.name)
        (work / run.name).mkdir()
        return {"label": run.name.upper()}

    runs = RUNS
    runs.run_grid(GRID[:2], run_one, out, {}, _head, resume=False, only=None, machine_now=dict,
                  recorded_name=lambda r: r["label"].lower())
    recorder = Recorder(out)
    runs.run_grid(GRID, recorder, out, {}, _head, resume=True, only=None, machine_now=dict,
                  recorded_name=lambda r: r.get("label", r.get("name", "")).lower())
    assert recorder.ran == ["c"] and not any(p.exists() for p in seen)


def test_the_benches_read_resume_and_only_through_the_helper() -> None:
    runs = RUNS
    parser = argparse.ArgumentParser()
    runs.add_grid_arguments(parser)
    assert vars(parser.parse_args(["--resume", "--only", "x", "y"])) == {"resume": True, "only": ["x", "y"]}
    assert vars(parser.parse_args([])) == {"resume": False, "only": None}
    for bench in ("robustness", "update_directions", "defence_scores"):
        text = (Path(__file__).resolve().parents[1] / "bench" / f"{bench}.py").read_text()
        assert "run_grid(" in text and "write_json(" not in text and "mkdtemp(" not in text, bench
