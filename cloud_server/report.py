"""Run reports: ``report.json``, ``rounds.csv``, PNG plots and ``summary.md``.

The coordinator builds a report dict after every round and calls
:func:`write_report`; ``cloud-server report RUN_DIR`` calls
:func:`render_run_dir`, which reloads ``report.json`` and rewrites the rest.
The report dict's schema is documented in :func:`validate_report` and in
DESIGN.md ("Cost accounting").

Units: "MB" is 10**6 bytes and "GFLOPs" is 10**9 floating-point operations
(FLOPs = 2 x MACs, forward + backward), everywhere in this module.

Only numpy, matplotlib (imported lazily, so importing this module stays cheap
on the coordinator's start-up path) and the standard library are used.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # only for annotations; matplotlib is imported inside the plotting code
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "REPORT_FILES",
    "CSV_COLUMNS",
    "ReportError",
    "validate_report",
    "write_report",
    "load_report",
    "render_run_dir",
    "format_summary_line",
    "compare_runs",
]

DASH = "—"
MB = 1e6
GFLOP = 1e9

RUN_STATUSES = frozenset({"running", "finished", "stopped_target", "aborted", "no_agents"})
ROUND_STATUSES = frozenset({"ok", "failed_quorum"})
BYTE_KEYS = ("up_payload", "up_wire", "down_payload", "down_wire")
TIME_KEYS = ("round", "server_train", "edge_compute", "edge_encode", "edge_network", "edge_idle")
EDGE_PHASES = ("compute", "encode", "network", "idle")

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
    "accuracy", "edge_accuracy", "server_loss", "samples",
    "up_payload", "up_wire", "down_payload", "down_wire", "cum_wire_mb",
    "edge_train_flops",
    "round_s", "server_train_s", "edge_compute_s", "edge_encode_s", "edge_network_s", "edge_idle_s",
)


class ReportError(ValueError):
    """A report is malformed or cannot be loaded; ``problems`` lists every finding."""

    def __init__(self, problems: Sequence[str], context: str = "invalid run report") -> None:
        self.problems = list(problems)
        shown = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{context} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{shown}")


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #

_BAD = object()  # returned by _Checker.get when a field is missing or of the wrong type

# field name -> (kind, nullable, minimum, maximum)
_Spec = tuple[str, bool, float | None, float | None]

_SERVER_FIELDS: dict[str, _Spec] = {k: ("str", False, None, None) for k in ("device", "cpu_model", "torch", "hostname")}
_AGENT_FIELDS: dict[str, _Spec] = {
    "cpu_model": ("str", False, None, None),
    "arch": ("str", False, None, None),
    "cores": ("int", False, 0, None),
    "memory_bytes": ("int", False, 0, None),
    "backend": ("str", False, None, None),
    "num_samples": ("int", False, 0, None),
    "class_counts": ("list", False, None, None),
}
_PER_AGENT_FIELDS: dict[str, _Spec] = {
    "samples": ("int", False, 0, None),
    "train_flops": ("int", False, 0, None),
    "compute_s": ("number", False, 0, None),
    "encode_s": ("number", False, 0, None),
    "network_s": ("number", False, 0, None),
    "idle_s": ("number", False, 0, None),
    "peak_rss_bytes": ("int", False, 0, None),
    "payload_bytes_up": ("int", False, 0, None),
    "wire_bytes_up": ("int", False, 0, None),
    "payload_bytes_down": ("int", False, 0, None),
    "wire_bytes_down": ("int", False, 0, None),
    "codec": ("str", False, None, None),
    "codec_ratio": ("number", False, 0, None),
    "edge_accuracy": ("number", True, 0, 1),
}
# A round's ``server``: what the server's device did in it (cloud_server/device_meter.py).
# Optional (reports written before it existed have none); checked whenever present.
_ROUND_SERVER_FIELDS: dict[str, _Spec] = {
    "device": ("str", False, None, None),
    "device_name": ("str", False, None, None),
    "train_s": ("number", False, 0, None),
    "peak_memory_bytes": ("int", True, 0, None),  # None: not a GPU
    "gpu_utilization_percent": ("number", True, 0, 100),  # None: see gpu_utilization_unavailable
    "gpu_utilization_max_percent": ("number", True, 0, 100),
    "gpu_utilization_samples": ("int", False, 0, None),
    "gpu_utilization_unavailable": ("str", True, None, None),
}
_TOTALS_FIELDS: dict[str, _Spec] = {
    "rounds_completed": ("int", False, 0, None),
    "best_accuracy": ("number", True, 0, 1),
    "final_accuracy": ("number", True, 0, 1),
    "final_edge_accuracy": ("number", True, 0, 1),
    **{k: ("int", False, 0, None) for k in (*BYTE_KEYS, "wire_total", "edge_train_flops", "rejected_messages")},
    "wall_time_s": ("number", False, 0, None),
    "rejected_by_reason": ("dict", False, None, None),
}


def _kind_ok(value: Any, kind: str) -> bool:
    # bool is an int subclass in Python, but True is never a byte count.
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    raise AssertionError(f"unknown kind {kind!r}")  # a bug in this module, not in the report


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


class _Checker:
    """Collects every problem instead of stopping at the first, so one run fixes them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def get(self, obj: Mapping[str, Any], path: str, key: str, spec: _Spec) -> Any:
        kind, nullable, minimum, maximum = spec
        where = f"{path}.{key}" if path else key
        if key not in obj:
            self.add(f"{where}: missing")
            return _BAD
        value = obj[key]
        if value is None:
            if nullable:
                return None
            self.add(f"{where}: expected {kind}, got None")
            return _BAD
        if not _kind_ok(value, kind):
            self.add(f"{where}: expected {kind}{' or None' if nullable else ''}, got {_describe(value)}")
            return _BAD
        if kind in ("int", "number"):
            if not math.isfinite(value):
                self.add(f"{where}: expected a finite number, got {value!r}")
                return _BAD
            if minimum is not None and value < minimum:
                self.add(f"{where}: must be >= {minimum}, got {value!r}")
                return _BAD
            if maximum is not None and value > maximum:
                self.add(f"{where}: must be <= {maximum}, got {value!r}")
                return _BAD
        return value

    def fields(self, obj: Any, path: str, specs: Mapping[str, _Spec]) -> dict[str, Any]:
        """Check every field of ``obj``; return the good ones (extra keys are allowed)."""
        if not isinstance(obj, dict):
            self.add(f"{path}: expected dict, got {_describe(obj)}")
            return {}
        good = {}
        for key, spec in specs.items():
            value = self.get(obj, path, key, spec)
            if value is not _BAD:
                good[key] = value
        return good

    def id_list(self, obj: Mapping[str, Any], path: str, key: str) -> list[str] | None:
        value = self.get(obj, path, key, ("list", False, None, None))
        if value is _BAD:
            return None
        if not all(isinstance(v, str) for v in value):
            self.add(f"{path}.{key}: expected a list of agent ids (str), got {_describe(value)}")
            return None
        return value


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _check_models(ck: _Checker, models: Any) -> None:
    if not isinstance(models, dict):
        return  # the type problem is already recorded
    for role in ("edge", "server"):
        if role not in models:
            ck.add(f"models.{role}: missing (use None when the method has no {role} model)")
            continue
        model = models[role]
        if model is None:
            continue
        ck.fields(model, f"models.{role}", {
            "name": ("str", False, None, None),
            "params": ("int", False, 0, None),
            # A server model may not be countable (e.g. a method without one, or a
            # counter that cannot trace it); the edge model always is.
            "train_flops_per_sample": ("int", role == "server", 0, None),
        })


def _check_agents(ck: _Checker, agents: Any) -> None:
    if not isinstance(agents, dict):
        return
    for agent_id, info in agents.items():
        good = ck.fields(info, f"agents[{agent_id}]", _AGENT_FIELDS)
        counts = good.get("class_counts")
        if counts is not None and not all(_kind_ok(c, "int") and c >= 0 for c in counts):
            ck.add(f"agents[{agent_id}].class_counts: expected non-negative ints, got {_describe(counts)}")


def _check_round(ck: _Checker, index: int, rnd: Any) -> dict[str, Any]:
    """Check one round record; return its good fields (with ``bytes`` and ``time_s`` checked)."""
    path = f"rounds[{index}]"
    if isinstance(rnd, dict) and _kind_ok(rnd.get("round"), "int"):
        path = f"rounds[{index}] (round {rnd['round']})"  # findable by either number
    good = ck.fields(rnd, path, {
        "round": ("int", False, 1, None),
        "status": ("str", False, None, None),
        "accuracy": ("number", True, 0, 1),
        "edge_accuracy": ("number", True, 0, 1),
        "server_loss": ("number", True, None, None),
        "samples": ("int", False, 0, None),
        "edge_train_flops": ("int", False, 0, None),
        "bytes": ("dict", False, None, None),
        "time_s": ("dict", False, None, None),
        "per_agent": ("dict", False, None, None),
    })
    if not isinstance(rnd, dict):
        return good
    if "status" in good and good["status"] not in ROUND_STATUSES:
        ck.add(f"{path}.status: expected one of {sorted(ROUND_STATUSES)}, got {good['status']!r}")
    ids = {key: ck.id_list(rnd, path, key) for key in ("participants", "completed", "missing")}
    participants = ids["participants"]
    if participants is not None:
        for key in ("completed", "missing"):
            if ids[key] is not None and not set(ids[key]) <= set(participants):
                ck.add(f"{path}.{key}: {sorted(set(ids[key]) - set(participants))} are not participants")
    if ids["completed"] is not None and ids["missing"] is not None and set(ids["completed"]) & set(ids["missing"]):
        ck.add(f"{path}: {sorted(set(ids['completed']) & set(ids['missing']))} are both completed and missing")
    if "bytes" in good:
        good["bytes"] = ck.fields(good["bytes"], f"{path}.bytes", {k: ("int", False, 0, None) for k in BYTE_KEYS})
    if "time_s" in good:
        good["time_s"] = ck.fields(good["time_s"], f"{path}.time_s", {k: ("number", False, 0, None) for k in TIME_KEYS})
    for agent_id, costs in good.get("per_agent", {}).items():
        ck.fields(costs, f"{path}.per_agent[{agent_id}]", _PER_AGENT_FIELDS)
        if participants is not None and agent_id not in participants:
            ck.add(f"{path}.per_agent[{agent_id}]: not a participant of the round")
    if "server" in rnd:
        _check_round_server(ck, f"{path}.server", rnd["server"])
    if "method" in rnd and not isinstance(rnd["method"], dict):
        # Optional: the method's own figures (ServerMethod.round_report); free-form inside.
        ck.add(f"{path}.method: expected a dict of the method's figures, got {_describe(rnd['method'])}")
    return good


def _check_round_server(ck: _Checker, path: str, server: Any) -> None:
    good = ck.fields(server, path, _ROUND_SERVER_FIELDS)
    if len(good) != len(_ROUND_SERVER_FIELDS):
        return  # the missing or mistyped fields are already recorded
    mean, peak, samples, why = (good["gpu_utilization_percent"], good["gpu_utilization_max_percent"],
                                good["gpu_utilization_samples"], good["gpu_utilization_unavailable"])
    if (mean is None) != (why is not None):
        ck.add(f"{path}: gpu_utilization_percent is {mean!r} and gpu_utilization_unavailable is {why!r}: "
               "exactly one of them must be set (a figure, or why there is none)")
    if (mean is None) != (peak is None) or (mean is None) != (samples == 0):
        ck.add(f"{path}: gpu_utilization_percent {mean!r}, gpu_utilization_max_percent {peak!r} and "
               f"gpu_utilization_samples {samples!r} disagree on whether utilisation was sampled")
    elif mean is not None and mean > peak + 1e-9:
        ck.add(f"{path}: gpu_utilization_percent {mean!r} exceeds gpu_utilization_max_percent {peak!r}")


def _check_totals(ck: _Checker, totals: Any, rounds: list[dict[str, Any]], rounds_ok: bool) -> None:
    good = ck.fields(totals, "totals", _TOTALS_FIELDS)
    if isinstance(good.get("rejected_by_reason"), dict):
        by_reason = good["rejected_by_reason"]
        if not all(_kind_ok(v, "int") and v >= 0 for v in by_reason.values()):
            ck.add(f"totals.rejected_by_reason: expected non-negative int counts, got {_describe(by_reason)}")
        elif "rejected_messages" in good and sum(by_reason.values()) != good["rejected_messages"]:
            ck.add(
                f"totals.rejected_messages is {good['rejected_messages']} but rejected_by_reason "
                f"sums to {sum(by_reason.values())}"
            )
    if isinstance(totals, dict) and ("rejected_chunks" in totals or "rejected_chunks_by_reason" in totals):
        # Chunks refused below the message layer (written by runs since they were counted by code).
        chunks, by_code = totals.get("rejected_chunks"), totals.get("rejected_chunks_by_reason")
        if not _kind_ok(chunks, "int") or chunks < 0:
            ck.add(f"totals.rejected_chunks: expected a non-negative int, got {_describe(chunks)}")
        elif not isinstance(by_code, dict) or not all(_kind_ok(v, "int") and v >= 0 for v in by_code.values()):
            ck.add(f"totals.rejected_chunks_by_reason: expected non-negative int counts, got {_describe(by_code)}")
        elif sum(by_code.values()) != chunks:
            ck.add(f"totals.rejected_chunks is {chunks} but rejected_chunks_by_reason sums to {sum(by_code.values())}")
    if all(k in good for k in ("wire_total", "up_wire", "down_wire")) and good["wire_total"] != good["up_wire"] + good["down_wire"]:
        ck.add(f"totals.wire_total is {good['wire_total']}, expected up_wire + down_wire = {good['up_wire'] + good['down_wire']}")
    if not rounds_ok:
        return  # sums over broken rounds would only repeat the rounds' problems
    for key in BYTE_KEYS:
        expected = sum(r["bytes"][key] for r in rounds)
        if key in good and good[key] != expected:
            ck.add(f"totals.{key} is {good[key]}, but the rounds' bytes.{key} sum to {expected}")
    flops = sum(r["edge_train_flops"] for r in rounds)
    if "edge_train_flops" in good and good["edge_train_flops"] != flops:
        ck.add(f"totals.edge_train_flops is {good['edge_train_flops']}, but the rounds sum to {flops}")
    ok_rounds = sum(1 for r in rounds if r["status"] == "ok")
    if "rounds_completed" in good and good["rounds_completed"] != ok_rounds:
        ck.add(f"totals.rounds_completed is {good['rounds_completed']}, but {ok_rounds} rounds have status 'ok'")
    accs = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
    edge_accs = [r["edge_accuracy"] for r in rounds if r["edge_accuracy"] is not None]
    expectations = {
        "best_accuracy": (max(accs) if accs else None, "the best round accuracy"),
        "final_accuracy": (accs[-1] if accs else None, "the last measured round accuracy"),
        "final_edge_accuracy": (edge_accs[-1] if edge_accs else None, "the last measured round edge_accuracy"),
    }
    for key, (expected, what) in expectations.items():
        if key not in good:
            continue
        value = good[key]
        if (value is None) != (expected is None) or (value is not None and not _close(value, expected)):
            ck.add(f"totals.{key} is {value!r}, but {what} is {expected!r}")


def validate_report(report: dict[str, Any]) -> None:
    """Check a run report against the schema; raise :class:`ReportError` listing every problem.

    Checked: required keys and their types (extra keys are allowed, so the
    coordinator may add fields), enumerated statuses, round numbers >= 1 and
    strictly increasing, accuracies in [0, 1], non-negative counts, bytes,
    FLOPs and times, agent-id lists consistent within a round, totals equal to
    the sums over the rounds, and that the whole dict is strict JSON (no NaN,
    no numpy scalars).
    """
    ck = _Checker()
    if not isinstance(report, dict):
        raise ReportError([f"report: expected dict, got {_describe(report)}"])
    top = ck.fields(report, "", {
        "edgesplit_version": ("str", False, None, None),
        "run_id": ("str", False, None, None),
        "method": ("str", False, None, None),
        "config": ("dict", False, None, None),
        "started_at": ("str", False, None, None),
        "finished_at": ("str", True, None, None),
        "status": ("str", False, None, None),
        "server": ("dict", False, None, None),
        "agents": ("dict", False, None, None),
        "models": ("dict", False, None, None),
        "rounds": ("list", False, None, None),
        "totals": ("dict", False, None, None),
    })
    if top.get("run_id") == "":
        ck.add("run_id: must not be empty")
    if "status" in top and top["status"] not in RUN_STATUSES:
        ck.add(f"status: expected one of {sorted(RUN_STATUSES)}, got {top['status']!r}")
    if "server" in top:
        ck.fields(top["server"], "server", _SERVER_FIELDS)
    _check_agents(ck, top.get("agents"))
    _check_models(ck, top.get("models"))

    rounds: list[dict[str, Any]] = []
    rounds_ok = "rounds" in top
    previous = 0
    for index, rnd in enumerate(top.get("rounds", [])):
        before = len(ck.problems)
        good = _check_round(ck, index, rnd)
        number = good.get("round")
        if number is not None:
            if number <= previous:
                ck.add(f"rounds[{index}].round is {number}, but rounds must be strictly increasing (previous {previous})")
            previous = number
        rounds.append(good)
        rounds_ok = rounds_ok and len(ck.problems) == before
    if "totals" in top:
        _check_totals(ck, top["totals"], rounds, rounds_ok)

    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # Names the offending type or value; the field checks above usually say where.
        ck.add(f"report is not strict JSON: {exc}")
    if ck.problems:
        run = report.get("run_id")
        raise ReportError(ck.problems, f"invalid run report{f' for run {run!r}' if isinstance(run, str) else ''}")


# --------------------------------------------------------------------------- #
# formatting
# --------------------------------------------------------------------------- #


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.2f}%"


def _mb(n: float | None, decimals: int = 2) -> str:
    return DASH if n is None else f"{n / MB:,.{decimals}f}"


def _gflops(flops: float | None) -> str:
    """GFLOPs readable from 0.0001 (one small image) to millions (a whole run)."""
    if flops is None:
        return DASH
    g = flops / GFLOP
    if g == 0:
        return "0"
    if g >= 100:
        return f"{g:,.0f}"
    if g >= 1:
        return f"{g:.2f}"
    return f"{g:.3g}"


def _seconds(s: float | None) -> str:
    return DASH if s is None else f"{s:.1f}"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def _ratio(big: float | None, small: float | None) -> str:
    if big is None or small is None or small <= 0:
        return DASH
    return f"{big / small:.1f}×"


def _cell(value: Any) -> str:
    # A "|" inside a cell (a CPU model string, an agent id) would split the row.
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _figure(value: Any) -> str:
    """One of a method's own figures in a table cell: grouped ints, 4 significant digits."""
    if value is None:
        return DASH
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return _describe(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _server_device_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rounds' ``server`` entries: the device, its training seconds, peak memory and
    utilisation per round; empty if no round has them (reports from before they existed)."""
    measured = [r for r in rounds if isinstance(r.get("server"), dict)]
    if not measured:
        return []
    lines = ["## Server device per round", ""]
    rows = []
    for r in measured:
        srv = r["server"]
        util = srv.get("gpu_utilization_percent")
        rows.append([r["round"], srv.get("device_name", DASH), srv.get("device", DASH), _seconds(srv.get("train_s")),
                     _mb(srv.get("peak_memory_bytes"), 0),
                     DASH if util is None else f"{util:.0f}% / {srv.get('gpu_utilization_max_percent', 0):.0f}%"])
    lines += _table(["Round", "Device", "", "Train s", "Peak GPU MB", "GPU util. mean / max"], rows, right_from=3)
    reasons = sorted({r["server"].get("gpu_utilization_unavailable") for r in measured} - {None})
    lines += ["", "Train s: the server's own training in the round (the method's training or distillation). "
              "Peak GPU MB: the most memory torch held on the GPU since the previous round closed. "
              "GPU util.: the driver's utilisation sampled while the server trained."]
    if reasons:
        lines.append("No GPU utilisation where shown " + DASH + ": " + "; ".join(reasons) + ".")
    lines.append("")
    return lines


def _method_figures_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rounds' ``method`` entries (a method's own figures, ``ServerMethod.round_report``),
    whatever the method: its scalars as one table over the rounds; of the last round, each
    dict of scalars, or of dicts of scalars, as a table of its own. Empty if no round has any."""
    figured = [r for r in rounds if isinstance(r.get("method"), dict) and r["method"]]
    if not figured:
        return []
    lines = ["## Method figures per round", ""]
    keys: list[str] = []
    for r in figured:
        keys += [k for k, v in r["method"].items() if _is_scalar(v) and k not in keys]
    if keys:
        lines += _table(["Round", *keys], [[r["round"], *(_figure(r["method"].get(k)) for k in keys)] for r in figured])
        lines.append("")
    last = figured[-1]
    for key, value in last["method"].items():
        if not isinstance(value, dict) or not value:
            continue
        if all(_is_scalar(v) for v in value.values()):
            rows = [[k, _figure(v)] for k, v in value.items()]
            header = [key, "value"]
        elif all(isinstance(v, dict) and all(_is_scalar(x) for x in v.values()) for v in value.values()):
            columns: list[str] = []
            for v in value.values():
                columns += [c for c in v if c not in columns]
            rows = [[k, *(_figure(v.get(c)) for c in columns)] for k, v in value.items()]
            header = [key, *columns]
        else:
            continue  # deeper structures stay in report.json
        lines += [f"`{key}` in round {last['round']}:", ""]
        lines += _table(header, rows)
        lines.append("")
    lines += ["The method's own figures (`method` in each round of report.json).", ""]
    return lines


def format_summary_line(round_record: Mapping[str, Any], total_rounds: int) -> str:
    """One status line per round for the console, e.g.

    ``round 3/8  acc 81.20%  edge 76.10%  up 12.4 MB  down 0.3 MB  2/2 agents  41.2 s``

    Bytes are what the server's connection carried on the wire for the round.
    """
    acc = round_record.get("accuracy")
    edge = round_record.get("edge_accuracy")
    wire = round_record.get("bytes", {})
    line = (
        f"round {round_record['round']}/{total_rounds}"
        f"  acc {_pct(acc)}  edge {_pct(edge)}"
        f"  up {_mb(wire.get('up_wire', 0), 1)} MB  down {_mb(wire.get('down_wire', 0), 1)} MB"
        f"  {len(round_record.get('completed', []))}/{len(round_record.get('participants', []))} agents"
        f"  {_seconds(round_record.get('time_s', {}).get('round'))} s"
    )
    if round_record.get("status", "ok") != "ok":
        line += f"  [{round_record['status']}]"
    return line


# --------------------------------------------------------------------------- #
# derived series
# --------------------------------------------------------------------------- #


def _cumulative_wire_mb(rounds: Sequence[Mapping[str, Any]]) -> np.ndarray:
    per_round = np.array([r["bytes"]["up_wire"] + r["bytes"]["down_wire"] for r in rounds], dtype=np.float64)
    return np.cumsum(per_round) / MB  # (R,)


def _series(rounds: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """A per-round value as float64 with NaN where unknown (matplotlib leaves gaps at NaN)."""
    return np.array([np.nan if r[key] is None else float(r[key]) for r in rounds], dtype=np.float64)


def _rounds_csv(rounds: Sequence[Mapping[str, Any]]) -> str:
    def value(v: Any) -> Any:
        return "" if v is None else v

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r, cum_mb in zip(rounds, _cumulative_wire_mb(rounds)):
        t = r["time_s"]
        writer.writerow([
            r["round"], r["status"],
            ";".join(r["participants"]), ";".join(r["completed"]), ";".join(r["missing"]),
            value(r["accuracy"]), value(r["edge_accuracy"]), value(r["server_loss"]), r["samples"],
            *(r["bytes"][k] for k in BYTE_KEYS), round(float(cum_mb), 6),
            r["edge_train_flops"],
            *(t[k] for k in TIME_KEYS),
        ])
    return buf.getvalue()


# --------------------------------------------------------------------------- #
# plots
# --------------------------------------------------------------------------- #


def _new_figure(rows: int = 1, height: float = 4.2) -> tuple[Figure, list[Axes]]:
    # A bare Figure on an Agg canvas, not pyplot: no global figure registry to leak
    # from a long-running coordinator, and the host process's backend is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    # Fixed margins rather than constrained layout: the figures have a known shape,
    # and layout solving doubles the time of a report written after every round.
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.6 / height, top=1 - 0.4 / height, hspace=0.12)
    return fig, list(axes)


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4", fontsize=11)


def _integer_x(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _accuracy_axes(ax: Axes, x: np.ndarray, server: np.ndarray, edge: np.ndarray) -> None:
    """Server and edge accuracy (percent) against ``x``; a note if nothing was measured."""
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3)
    measured = np.concatenate([server[~np.isnan(server)], edge[~np.isnan(edge)]])
    if measured.size == 0:
        _note(ax, "no rounds yet" if x.size == 0 else "no accuracy measured yet")
        ax.set_ylim(0, 100)  # matplotlib's default 0..1 would read as fractions of a percent
        return
    for values, label, marker in ((server, "server model (extractor + server)", "o"), (edge, "edge models (sample-weighted)", "s")):
        keep = ~np.isnan(values)
        if keep.any():
            # Only measured points: a round without evaluation is not a zero.
            ax.plot(x[keep], 100 * values[keep], marker=marker, markersize=4, label=label)
    low, high = 100 * measured.min(), 100 * measured.max()
    ax.set_ylim(max(0.0, low - 5), min(101.0, high + 5))
    ax.legend(loc="lower right")


def _plot_accuracy_vs_round(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax,) = _new_figure()
    x = np.array([r["round"] for r in rounds], dtype=np.float64)
    failed = [r["round"] for r in rounds if r["status"] != "ok"]
    for i, number in enumerate(failed):
        ax.axvspan(number - 0.5, number + 0.5, color="tab:red", alpha=0.12, label="failed quorum" if i == 0 else None)
    _accuracy_axes(ax, x, _series(rounds, "accuracy"), _series(rounds, "edge_accuracy"))
    if failed and ax.get_legend() is None:
        ax.legend(loc="lower right")
    ax.set_xlabel("round")
    _integer_x(ax)
    ax.set_title(f"{report['run_id']} ({report['method']}): accuracy per round")
    return fig


def _plot_accuracy_vs_wire(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax,) = _new_figure()
    _accuracy_axes(ax, _cumulative_wire_mb(rounds), _series(rounds, "accuracy"), _series(rounds, "edge_accuracy"))
    ax.set_xlabel("cumulative MB on the wire (up + down)")
    ax.set_title(f"{report['run_id']} ({report['method']}): accuracy vs communication")
    return fig


def _plot_edge_cost(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax_flops, ax_time) = _new_figure(rows=2, height=6.0)
    ax_flops.set_title(f"{report['run_id']} ({report['method']}): edge cost per round")
    ax_flops.set_ylabel("edge train GFLOPs\n(sum over agents)")
    ax_time.set_ylabel("seconds per agent\n(mean over completed)")
    ax_time.set_xlabel("round")
    for ax in (ax_flops, ax_time):
        ax.grid(True, axis="y", alpha=0.3)
    if not rounds:
        for ax in (ax_flops, ax_time):
            _note(ax, "no rounds yet")
        return fig
    x = np.array([r["round"] for r in rounds], dtype=np.float64)
    ax_flops.bar(x, [r["edge_train_flops"] / GFLOP for r in rounds], width=0.7, color="tab:purple")
    bottom = np.zeros(len(rounds))
    for phase, color in zip(EDGE_PHASES, ("tab:blue", "tab:orange", "tab:green", "0.75")):
        seconds = np.array([r["time_s"][f"edge_{phase}"] for r in rounds], dtype=np.float64)
        ax_time.bar(x, seconds, width=0.7, bottom=bottom, label=phase, color=color)
        bottom += seconds
    if bottom.max() > 0:
        ax_time.set_ylim(0, 1.3 * bottom.max())  # headroom so the legend never covers a bar
    ax_time.legend(loc="upper left", ncols=4, fontsize=8)
    _integer_x(ax_time)
    return fig


# --------------------------------------------------------------------------- #
# summary.md
# --------------------------------------------------------------------------- #


def _model_name(model: Mapping[str, Any] | None) -> str:
    return DASH if model is None else model["name"]


def _summary_md(report: Mapping[str, Any]) -> str:
    rounds: list[dict[str, Any]] = report["rounds"]
    totals = report["totals"]
    models = report["models"]
    config = report["config"]
    edge, server = models["edge"], models["server"]
    lines: list[str] = [f"# EdgeSplit run `{report['run_id']}` — {report['method']}", ""]

    planned = config.get("rounds")
    rounds_text = f"{len(rounds)}" + (f" of {planned}" if isinstance(planned, int) else "")
    facts = [
        f"**Agents:** {len(report['agents'])}",
        f"**Rounds:** {rounds_text} ({totals['rounds_completed']} ok)",
        f"**Status:** {report['status']}",
        f"**Wall time:** {_duration(totals['wall_time_s'])}",
    ]
    if isinstance(config.get("dataset"), str):
        facts.append(f"**Dataset:** {config['dataset']}")
    lines += [" · ".join(facts), ""]
    srv = report["server"]
    lines += [
        f"Started {report['started_at']}, finished {report['finished_at'] or DASH}. "
        f"Server: {srv['hostname']}, {srv['device']} ({srv['cpu_model']}), torch {srv['torch']}; "
        f"EdgeSplit {report['edgesplit_version']}.",
        "",
    ]

    lines += ["## Accuracy (FedGKT Table 1 layout)", ""]
    lines += _table(
        ["Method", "Edge model", "Server model", "Final acc.", "Best acc.", "Edge acc."],
        [[report["method"], _model_name(edge), _model_name(server), _pct(totals["final_accuracy"]),
          _pct(totals["best_accuracy"]), _pct(totals["final_edge_accuracy"])]],
        right_from=3,
    )
    lines += ["", "Final acc.: last evaluated round, server model on the agents' test shards. "
              "Edge acc.: agents' own edge models, sample-weighted.", ""]

    lines += ["## Edge model cost (FedGKT Fig. 4 layout)", ""]
    if edge is None:
        lines += ["No edge model recorded for this method.", ""]
    else:
        rows = [["edge", edge["name"], f"{edge['params']:,}", _gflops(edge["train_flops_per_sample"])]]
        if server is not None:
            rows.append(["server", server["name"], f"{server['params']:,}", _gflops(server["train_flops_per_sample"])])
            rows.append(["server ÷ edge", "", _ratio(server["params"], edge["params"]),
                         _ratio(server["train_flops_per_sample"], edge["train_flops_per_sample"])])
        lines += _table(["Role", "Model", "Params", "Train GFLOPs / sample (fwd+bwd)"], rows, right_from=2)
        lines.append("")
        if server is not None:
            sentence = f"The edge model has {_ratio(server['params'], edge['params'])} fewer parameters"
            if server["train_flops_per_sample"] is not None:
                sentence += f" and needs {_ratio(server['train_flops_per_sample'], edge['train_flops_per_sample'])} fewer training FLOPs per sample"
            lines += [sentence + " than the server model.", ""]

    lines += ["## Communication (FedGKT Fig. 5 layout)", ""]
    n_rounds = len(rounds)
    comm_rows = []
    for label, pay_key, wire_key in (("up", "up_payload", "up_wire"), ("down", "down_payload", "down_wire"), ("total", None, None)):
        payload = totals["up_payload"] + totals["down_payload"] if pay_key is None else totals[pay_key]
        wire = totals["wire_total"] if wire_key is None else totals[wire_key]
        overhead = f"{100 * (wire - payload) / payload:.1f}%" if payload > 0 else DASH
        comm_rows.append([label, _mb(wire / n_rounds) if n_rounds else DASH, _mb(wire), _mb(payload), overhead])
    lines += _table(["Direction", "Wire MB / round", "Wire MB total", "Payload MB total", "Wire overhead"], comm_rows)
    entries = [a for r in rounds for a in r["per_agent"].values()]
    codecs = sorted({a["codec"] for a in entries if a["codec"]})
    ratios = [a["codec_ratio"] for a in entries if a["payload_bytes_up"] > 0]
    lines += ["", f"Upload codec: {', '.join(codecs) or DASH}; mean codec ratio (raw ÷ encoded) "
              f"{f'{float(np.mean(ratios)):.2f}×' if ratios else DASH} over {len(ratios)} agent-rounds. "
              "Wire = MQTT packets as the server's connection saw them; payload = frames before chunking."]
    outside = totals.get("outside_rounds")
    if isinstance(outside, dict) and all(_kind_ok(outside.get(k), "int") for k in BYTE_KEYS):
        lines.append(f"Outside rounds (registration, status, stale messages): "
                     f"{_mb(outside['up_wire'] + outside['down_wire'])} MB on the wire, not counted above.")
    if totals["rejected_messages"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(totals["rejected_by_reason"].items()))
        lines.append(f"Rejected messages: {totals['rejected_messages']} ({reasons}).")
    if totals.get("rejected_chunks"):
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(totals.get("rejected_chunks_by_reason", {}).items()))
        lines.append(f"Rejected chunks (never became messages): {totals['rejected_chunks']} ({reasons}).")
    lines.append("")

    lines += ["## Rounds", ""]
    if not rounds:
        lines += ["No rounds yet.", ""]
    else:
        lines += _table(
            ["Round", "Status", "Agents", "Acc.", "Edge acc.", "MB up", "MB down", "Edge GFLOPs", "Round s"],
            [[r["round"], r["status"], f"{len(r['completed'])}/{len(r['participants'])}", _pct(r["accuracy"]),
              _pct(r["edge_accuracy"]), _mb(r["bytes"]["up_wire"]), _mb(r["bytes"]["down_wire"]),
              _gflops(r["edge_train_flops"]), _seconds(r["time_s"]["round"])] for r in rounds],
            right_from=2,
        )
        lines.append("")
    lines += _server_device_md(rounds)
    lines += _method_figures_md(rounds)

    last = next((r for r in reversed(rounds) if r["per_agent"]), None)
    if last is not None:
        lines += [f"## Agents in round {last['round']}", ""]
        rows = []
        for agent_id, cost in sorted(last["per_agent"].items()):
            # After a resume only re-registered agents are in report["agents"].
            info = report["agents"].get(agent_id)
            cpu = DASH if info is None else f"{info['cpu_model']} ({info['arch']}, {info['cores']} cores)"
            # Two decimals: encode and network times are often well under a second.
            rows.append([agent_id, cpu, cost["samples"], *(f"{cost[f'{phase}_s']:.2f}" for phase in EDGE_PHASES),
                         _mb(cost["peak_rss_bytes"])])
        lines += _table(["Agent", "CPU", "Samples", "Compute s", "Encode s", "Network s", "Idle s", "Peak RSS MB"],
                        rows, right_from=2)
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# writing and loading
# --------------------------------------------------------------------------- #


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


def _write_figure(path: Path, fig: Figure) -> None:
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
    _write_text(paths["rounds_csv"], _rounds_csv(report["rounds"]))
    for name, plot in (
        ("accuracy_vs_round", _plot_accuracy_vs_round),
        ("accuracy_vs_wire_mb", _plot_accuracy_vs_wire),
        ("edge_cost", _plot_edge_cost),
    ):
        _write_figure(paths[name], plot(report))
    _write_text(paths["summary"], _summary_md(report))
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


def render_run_dir(run_dir: str | Path) -> dict[str, Path]:
    """Reload ``RUN_DIR/report.json`` and rewrite rounds.csv, the plots and summary.md."""
    return write_report(run_dir, load_report(run_dir))


def compare_runs(run_dirs: Sequence[str | Path]) -> str:
    """A markdown table comparing several runs (e.g. one per method in a benchmark)."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run directory")
    rows = []
    for run_dir in run_dirs:
        report = load_report(run_dir)
        totals, edge = report["totals"], report["models"]["edge"]
        rows.append([
            f"`{report['run_id']}`", report["method"], report["status"], totals["rounds_completed"],
            _pct(totals["final_accuracy"]), _pct(totals["best_accuracy"]), _pct(totals["final_edge_accuracy"]),
            _gflops(None if edge is None else edge["train_flops_per_sample"]),
            _mb(totals["wire_total"]), _duration(totals["wall_time_s"]),
        ])
    header = ["Run", "Method", "Status", "Rounds", "Final acc.", "Best acc.", "Edge acc.",
              "Edge GFLOPs / sample", "Wire MB", "Wall time"]
    return "\n".join(_table(header, rows, right_from=3)) + "\n"
