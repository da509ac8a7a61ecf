"""Run an experiment's grid, resumably: each cell is ``edgesplit local`` (and, when the
experiment audits, ``edgesplit audit``), or ``edgesplit centralized`` for a reference cell, in a
subprocess of its own, into its own run directory; the results file is rewritten, atomically, after every cell.

A cell recorded as done with the same command is skipped on a rerun; a failed cell, or one
whose command changed (its overrides or the scale), runs again. A run that outlives the
budget is stopped (its whole process group: broker, server and agents) and recorded as failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from .results import SCHEMA, leakage_figures, load_results, machine, run_figures, write_results
from .spec import CENTRALIZED, Cell, Experiment, ExperimentError

__all__ = ["CellExecutor", "CellOutcome", "SubprocessExecutor", "default_paths", "run_experiment"]

#: Lines of a failed subprocess's output kept in the cell's ``error``.
ERROR_TAIL_LINES = 15
#: Seconds a stopped run has to clean up (its launcher stops the broker) before it is killed.
STOP_GRACE_S = 20.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CellOutcome:
    """What running one cell gave: its status, its run's figures, its leakage, why it failed."""

    status: str  # "done" | "failed"
    run: dict[str, Any] | None = None
    leakage: dict[str, Any] | None = None
    error: str | None = None


class CellExecutor(Protocol):
    def __call__(self, experiment: Experiment, cell: Cell, run_dir: Path) -> CellOutcome: ...

    def audit(self, experiment: Experiment, run_dir: Path) -> CellOutcome:
        """The experiment's audit of the run in ``run_dir`` alone: ``leakage`` or ``error``."""
        ...


def default_paths(experiment_file: Path, name: str) -> tuple[Path, Path]:
    """(runs directory, results file) of an experiment: beside its ``experiments/`` folder,
    ``runs/NAME`` and ``results/NAME.json`` (``bench/runs/NAME``, ``bench/results/NAME.json``)."""
    base = experiment_file.resolve().parent
    if base.name == "experiments":
        base = base.parent
    return base / "runs" / name, base / "results" / f"{name}.json"


def cell_command(experiment: Experiment, cell: Cell) -> list[str]:
    """What the cell runs (without its run directory): recorded, and compared on a rerun."""
    return ["edgesplit", *cell.command_args(experiment.scale)]


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-ERROR_TAIL_LINES:])


def _run_bounded(argv: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``argv`` in a session of its own, output to ``log``; past ``timeout_s`` the whole
    session is interrupted, then killed. (exit code or None when stopped, the log's tail)."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _stop_session(proc)
        except KeyboardInterrupt:  # its own session does not get the terminal's Ctrl-C: pass it on
            _stop_session(proc)
            raise
    return code, _tail(log.read_text(errors="replace"))


def _stop_session(proc: subprocess.Popen) -> None:
    """Terminate ``proc``'s session (the launcher then stops its server, agents and broker; SIGINT
    may be ignored by a runner started in the background), then kill whatever of it is left after
    the grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class SubprocessExecutor:
    """Runs a cell as ``python -m cloud_server.launcher local ...`` (then ``audit``), with this
    process's code first on the path, so the cells run what the runner was started from.
    ``broker``: every run uses this broker instead of starting its own."""

    broker: str | None = None
    python: str = sys.executable

    def _env(self) -> dict[str, str]:
        code_root = str(Path(__file__).resolve().parents[2])
        path = os.environ.get("PYTHONPATH", "")
        return dict(os.environ, PYTHONPATH=code_root + (os.pathsep + path if path else ""), PYTHONUNBUFFERED="1")

    def __call__(self, experiment: Experiment, cell: Cell, run_dir: Path) -> CellOutcome:
        run_dir.mkdir(parents=True, exist_ok=True)
        federated = cell.method != CENTRALIZED  # a reference cell has no broker, no agents and nothing to audit
        audited = federated and experiment.audit is not None
        command = cell.command_args(experiment.scale)
        argv = [self.python, "-m", "cloud_server.launcher", *command,
                "--out", str(run_dir), "--run-id", cell.key, *(["--broker", self.broker] if self.broker and federated else []),
                # Keep what the audit reads, but leave the audit to the step below, with the experiment's options and budget.
                *(["--set", "server.audit=true"] if audited else [])]
        report_path = run_dir / "report.json"
        report_path.unlink(missing_ok=True)  # a figure read from an old run would pass for this one's
        code, tail = _run_bounded(argv, run_dir / "bench-local.log", experiment.max_wall_s, self._env())
        if code is None:
            return CellOutcome("failed", error=f"stopped after the budget of {experiment.max_wall_s:g} s (budget.max_wall_s)\n{tail}")
        if code != 0 or not report_path.exists():
            return CellOutcome("failed", error=f"edgesplit {command[0]} exited with code {code}\n{tail}")
        run = run_figures(json.loads(report_path.read_text()))
        if not audited:
            return CellOutcome("done", run=run)
        return replace(self.audit(experiment, run_dir), run=run)

    def audit(self, experiment: Experiment, run_dir: Path) -> CellOutcome:
        assert experiment.audit is not None
        audit = experiment.audit
        leakage_path = run_dir / "audit" / "leakage.json"
        leakage_path.unlink(missing_ok=True)
        budget = audit.max_wall_s or experiment.max_wall_s
        code, tail = _run_bounded([self.python, "-m", "cloud_server.launcher", "audit", str(run_dir), *audit.audit_args()],
                                  run_dir / "bench-audit.log", budget, self._env())
        if code != 0 or not leakage_path.exists():
            why = f"stopped after {budget:g} s (audit.max_wall_s)" if code is None else f"exited with code {code}"
            return CellOutcome("failed", error=f"edgesplit audit {why}\n{tail}")
        return CellOutcome("done", leakage=leakage_figures(json.loads(leakage_path.read_text())))


def _elapsed(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def result_line(record: dict[str, Any]) -> str:
    """One line per finished cell: its status, accuracy, bytes up, edge FLOPs, strongest attack."""
    if record["status"] != "done":
        return f"FAILED: {(record.get('error') or '').splitlines()[0] if record.get('error') else 'no reason recorded'}"
    run = record["run"]
    parts = [f"done in {record['wall_s']:.0f} s"]
    if run["final_accuracy"] is not None:
        parts.append(f"global {100 * run['final_accuracy']:.1f}%")
    if run["train_up_wire_bytes"] is not None:
        parts.append(f"up {run['train_up_wire_bytes'] / 1e6:.2f} MB")
    parts.append(f"edge {run['edge_train_gflops']:.1f} GFLOPs")
    strongest = (record.get("leakage") or {}).get("strongest")
    if strongest:
        parts.append(f"strongest attack {strongest['attack']} {strongest['psnr_db']:.1f} dB "
                     f"(baseline {strongest['baseline_psnr_db']:.1f})")
    return ", ".join(parts)


def run_experiment(experiment: Experiment, *, results_path: Path, runs_dir: Path, only: str | None = None,
                   dry_run: bool = False, executor: CellExecutor | None = None, progress: Progress = print,
                   reaudit: bool = False, recollect: bool = False) -> dict[str, Any]:
    """Run the cells of ``experiment`` (those matching the glob ``only``) not yet done, writing
    ``results_path`` after each; return the results document. ``reaudit``: instead, audit the
    done cells again on what their runs kept (their run directories must still be there), as
    after a change to the audit; their runs' figures stay. ``recollect``: instead, read the done
    cells' run figures again from their runs' ``report.json`` (after the figures collected
    changed); nothing runs."""
    chosen = experiment.select(only)
    grid = experiment.cells()
    commands = {c.key: cell_command(experiment, c) for c in grid}
    previous = load_results(results_path)
    recorded = {c["key"]: c for c in (previous or {}).get("cells", []) if c["key"] in commands}
    dropped = sorted({c["key"] for c in (previous or {}).get("cells", [])} - set(commands))
    if dropped:
        progress(f"edgesplit bench: dropping {len(dropped)} recorded cells no longer in the grid: {', '.join(dropped)}")
    todo = [c for c in chosen if not (c.key in recorded and recorded[c.key]["status"] == "done"
                                      and recorded[c.key].get("command") == commands[c.key])]
    progress(f"edgesplit bench: {experiment.name}: {len(grid)} cells, {len(chosen)} chosen, "
             f"{len(chosen) - len(todo)} already done, {len(todo)} to run")

    def document() -> dict[str, Any]:
        cells = [recorded[c.key] for c in grid if c.key in recorded]
        return {"schema": SCHEMA, "experiment": experiment.as_data(), "machine": machine(), "cells": cells}

    if dry_run:
        for cell in todo:
            progress(f"  {cell.key}: {' '.join(commands[cell.key])}")
        return document()
    if recollect:
        for cell in chosen:
            report_path = runs_dir / cell.key / "report.json"
            if cell.key in recorded and recorded[cell.key]["status"] == "done" and report_path.exists():
                recorded[cell.key]["run"] = run_figures(json.loads(report_path.read_text()))
        write_results(results_path, document())
        return document()
    run = executor or SubprocessExecutor()
    if reaudit:
        _reaudit(experiment, [c for c in chosen if c.key in recorded and recorded[c.key]["status"] == "done"],
                 recorded, runs_dir, run, lambda: write_results(results_path, document()), progress)
        return document()
    started = time.monotonic()
    for i, cell in enumerate(todo, 1):
        progress(f"[{i}/{len(todo)}] {cell.key}: running ({len(todo) - i} left after it; {_elapsed(time.monotonic() - started)} elapsed)")
        cell_started = time.monotonic()
        outcome = run(experiment, cell, runs_dir / cell.key)
        recorded[cell.key] = {
            "key": cell.key, "method": cell.method, "partition": cell.partition, "seed": cell.seed, "variant": cell.variant,
            "overrides": asdict(cell.overrides), "command": commands[cell.key], "status": outcome.status,
            "wall_s": time.monotonic() - cell_started, "error": outcome.error, "run": outcome.run, "leakage": outcome.leakage,
        }
        write_results(results_path, document())
        progress(f"[{i}/{len(todo)}] {cell.key}: {result_line(recorded[cell.key])}")
    if not todo:
        write_results(results_path, document())
    failed = [k for k, c in recorded.items() if c["status"] != "done"]
    progress(f"edgesplit bench: {experiment.name}: {len(recorded) - len(failed)} of {len(grid)} cells done"
             + (f"; failed: {', '.join(failed)} (rerun to retry them)" if failed else "") + f"; results in {results_path}")
    return document()


def _reaudit(experiment: Experiment, cells: list[Cell], recorded: dict[str, dict[str, Any]], runs_dir: Path,
             run: CellExecutor, write: Callable[[], None], progress: Progress) -> None:
    if experiment.audit is None:
        raise ExperimentError(f"{experiment.name}: --reaudit needs an experiment that audits (audit = true)")
    for i, cell in enumerate(cells, 1):
        run_dir = runs_dir / cell.key
        if not (run_dir / "audit" / "kept.json").exists():
            progress(f"[{i}/{len(cells)}] {cell.key}: not audited again: {run_dir} no longer holds what the run kept")
            continue
        outcome = run.audit(experiment, run_dir)
        if outcome.status != "done":
            progress(f"[{i}/{len(cells)}] {cell.key}: the audit failed, the recorded leakage stays: {outcome.error}")
            continue
        recorded[cell.key]["leakage"] = outcome.leakage
        write()
        progress(f"[{i}/{len(cells)}] {cell.key}: audited again: {result_line(recorded[cell.key])}")
