"""A bench's grid of named runs, resumable: the loop bench/robustness.py, bench/update_directions.py
and bench/defence_scores.py share.

Each run of the grid has a ``name``; its result is a JSON object. The bench's JSON holds every run
recorded so far, in grid order, with ``complete`` and ``missing`` (the grid's names not in it), and
is written after every run, so an interrupted bench keeps what it finished:

* ``--resume``: the runs already in the JSON are kept (if it was written at the same ``scale``)
  and only the others run;
* ``--only NAME ...``: these runs (again), the rest kept as recorded; a name the grid does not
  have is an error that lists the grid's names, raised before anything runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import machine, write_json  # noqa: E402


class Named(Protocol):
    @property
    def name(self) -> str: ...


R = TypeVar("R", bound=Named)
Document = dict[str, Any]


class UnknownRunError(ValueError):
    """``--only`` named a run the grid does not have."""


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--only``, as :func:`run_grid` reads them."""
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out (same scale) and run only the others")
    parser.add_argument("--only", nargs="*", default=None, help="run only these names (and keep the rest)")


def recorded_by_name(run: Document) -> str:
    return str(run["name"])


def previous_machine(previous: Document, now: Document) -> Document:
    """The machine as the first invocation found it (the default of :func:`run_grid`)."""
    return previous.get("machine", now)  # type: ignore[no-any-return]


def run_grid(grid: Sequence[R], run_one: Callable[[R, Path], Document], out: Path, scale: Document,
             head: Callable[[Document, list[Document]], Document], *, resume: bool, only: Sequence[str] | None,
             summary: Callable[[list[Document]], Any] | None = None,
             recorded_name: Callable[[Document], str] = recorded_by_name,
             resumed_machine: Callable[[Document, Document], Document] = previous_machine,
             work_prefix: str = "bench-", machine_now: Callable[[], Document] = machine) -> list[Document]:
    """Run ``grid`` (or what ``resume`` / ``only`` leave of it) and write ``out`` after every run.

    ``run_one(run, work)`` runs one and returns its result; ``work / run.name`` is removed after
    it. The JSON is ``head(machine, runs)`` (``scale`` is the bench's to put in it), then
    ``complete``, ``missing``, ``summary(runs)`` if given, and ``runs``. A recorded run is named by
    ``recorded_name``; it is kept only if the JSON's ``scale`` keys equal ``scale``'s, and the
    machine of a resumed JSON is ``resumed_machine(previous JSON, machine now)``. Returns the
    recorded runs, in grid order."""
    names = [r.name for r in grid]
    if len(set(names)) != len(names):
        raise ValueError(f"the grid names a run twice: {sorted({n for n in names if names.count(n) > 1})}")
    if only is not None:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise UnknownRunError(f"--only: no run named {', '.join(unknown)} in the grid; its runs: {', '.join(names)}")
    order = {n: i for i, n in enumerate(names)}
    done: dict[str, Document] = {}
    started = machine_now()
    if (resume or only is not None) and out.exists():
        previous = json.loads(out.read_text())
        if all(previous.get(k) == v for k, v in scale.items()):
            done = {recorded_name(r): r for r in previous["runs"]}
            started = resumed_machine(previous, started)
        else:
            print(f"{out} holds another scale: starting afresh", flush=True)
    todo = [r for r in grid if (r.name in only if only is not None else r.name not in done)]

    def kept() -> list[Document]:
        return sorted(done.values(), key=lambda r: order.get(recorded_name(r), len(order)))

    def save() -> None:
        runs = kept()
        missing = [n for n in names if n not in done]
        write_json(out, {**head(started, runs), "complete": not missing, "missing": missing,
                         **({"summary": summary(runs)} if summary is not None else {}), "runs": runs})

    work = Path(tempfile.mkdtemp(prefix=work_prefix))
    try:
        for run in todo:
            print(f"running {run.name}", flush=True)
            done[run.name] = run_one(run, work)
            save()
            shutil.rmtree(work / run.name, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not todo:
        save()
    return kept()
