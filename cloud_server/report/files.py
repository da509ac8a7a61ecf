"""The report files of a run directory: writing them (atomically), reading
``report.json`` back, and ``rounds.csv``."""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..device_target import DeviceTarget
from .formatting import cumulative_wire_mb
from .markdown import comparison_md, summary_md
from .per_device import per_device_section
from .plots import PLOTS
from .schema import BYTE_KEYS, TIME_KEYS, ReportError, validate_report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["REPORT_FILES", "CSV_COLUMNS", "write_report", "load_report", "render_run_dir", "compare_runs", "rounds_csv"]

# Name used in the returned dict -> file name in the run directory.
REPORT_FILES: dict[str, str] = {
    "report": "report.json",
    "rounds_csv": "rounds.csv",
    "accuracy_vs_round": "accuracy_vs_round.png",
    "accuracy_vs_wire_mb": "accuracy_vs_wire_mb.png",
    "edge_cost": "edge_cost.png",
    "summary": "summary.md",
}

CSV_COLUMNS: tuple[str, ...] = (
    "round", "status", "participants", "completed", "missing",
    "accuracy", "local_accuracy", "edge_accuracy", "edge_local_accuracy", "server_loss", "samples",
    "up_payload", "up_wire", "down_payload", "down_wire", "cum_wire_mb",
    "edge_train_flops",
    "round_s", "server_train_s", "edge_compute_s", "edge_encode_s", "edge_network_s", "edge_idle_s",
)


def rounds_csv(rounds: Sequence[Mapping[str, Any]]) -> str:
    def value(v: Any) -> Any:
        return "" if v is None else v

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r, cum_mb in zip(rounds, cumulative_wire_mb(rounds)):
        t = r["time_s"]
        writer.writerow([
            r["round"], r["status"],
            ";".join(r["participants"]), ";".join(r["completed"]), ";".join(r["missing"]),
            value(r["accuracy"]), value(r.get("local_accuracy")), value(r["edge_accuracy"]), value(r.get("edge_local_accuracy")),
            value(r["server_loss"]), r["samples"],
            *(r["bytes"][k] for k in BYTE_KEYS), round(float(cum_mb), 6),
            r["edge_train_flops"],
            *(t[k] for k in TIME_KEYS),
        ])
    return buf.getvalue()


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write via a temporary file and ``os.replace``: a reader never sees half a file.

    The temporary name is created with ``open(..., "xb")`` rather than
    ``tempfile.mkstemp`` so the result gets the usual umask permissions, not 0600.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    done = False
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename is
        os.replace(tmp, path)
        done = True
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _write_figure(path: Path, fig: "Figure") -> None:
    _atomic_write(path, lambda f: fig.savefig(f, format="png"))


def write_report(run_dir: str | Path, report: dict[str, Any]) -> dict[str, Path]:
    """Validate ``report`` and write every report file into ``run_dir`` (created if needed).

    Each file is replaced atomically. Returns the paths by name (see
    :data:`REPORT_FILES`). Raises :class:`ReportError` before writing anything
    if the report is invalid.
    """
    validate_report(report)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / filename for name, filename in REPORT_FILES.items()}
    _write_text(paths["report"], json.dumps(report, indent=2, allow_nan=False, ensure_ascii=False) + "\n")
    _write_text(paths["rounds_csv"], rounds_csv(report["rounds"]))
    for name, plot in PLOTS.items():
        _write_figure(paths[name], plot(report))
    _write_text(paths["summary"], summary_md(report))
    return paths


def load_report(run_dir: str | Path) -> dict[str, Any]:
    """Load and validate ``RUN_DIR/report.json``; :class:`ReportError` says what is wrong."""
    path = Path(run_dir) / REPORT_FILES["report"]
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError([f"{path} does not exist; is {run_dir} a run directory?"], "cannot load run report") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError([f"{path}: {exc}"], "cannot load run report") from exc
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError([f"{path}: not valid JSON: {exc}"], "cannot load run report") from exc
    try:
        validate_report(report)
    except ReportError as exc:
        raise ReportError(exc.problems, f"invalid run report in {path}") from None
    return report


def _read_against(report: dict[str, Any], target: Mapping[str, Any] | None) -> dict[str, Any]:
    """The report with its per-device figures read against ``target`` (``link_mbit`` /
    ``device_memory`` over the run's own); without one, the report as written."""
    if target:
        section = per_device_section(report, DeviceTarget.of_config({**report["config"], **(target or {})}))
        report = {**report, "per_device": section} if section is not None else report
    return report


def render_run_dir(run_dir: str | Path, target: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Reload ``RUN_DIR/report.json`` and rewrite it, rounds.csv, the plots and summary.md
    (the per-device figures against ``target`` when given)."""
    return write_report(run_dir, _read_against(load_report(run_dir), target))


def compare_runs(run_dirs: Sequence[str | Path], target: Mapping[str, Any] | None = None) -> str:
    """A markdown table comparing several runs (e.g. one per method in a benchmark)."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run directory")
    return comparison_md([_read_against(load_report(run_dir), target) for run_dir in run_dirs])
