"""The run report's schema: :func:`validate_report` checks a ``report.json`` as read
back from disk, collecting every problem (so one look fixes them all).

The fields, their types and their bounds come from the records in
:mod:`cloud_server.records` (the dataclasses the recorder writes); the checks of
how fields relate (totals equal the sums over the rounds, agent lists agree,
utilisation figures agree) are written here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Union

from shared_protocol.records import JsonRecord

from ..records import (
    ROUND_STATUSES,
    RUN_STATUSES,
    AgentInfo,
    AgentRoundRecord,
    ByteCounts,
    RoundRecord,
    RoundTimes,
    RunReport,
    RunTotals,
    ServerDeviceRecord,
    ServerInfo,
)
from ..privacy import check_privacy_section as _check_privacy
from .formatting import describe
from .per_device import AGENT_FIELDS

__all__ = ["ReportError", "validate_report", "specs_of", "kind_ok", "BYTE_KEYS", "TIME_KEYS"]

BYTE_KEYS = tuple(f.name for f in dataclasses.fields(ByteCounts))
TIME_KEYS = tuple(f.name for f in dataclasses.fields(RoundTimes))


class ReportError(ValueError):
    """A report is malformed or cannot be loaded; ``problems`` lists every finding."""

    def __init__(self, problems: Sequence[str], context: str = "invalid run report") -> None:
        self.problems = list(problems)
        shown = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{context} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{shown}")


_BAD = object()  # returned by _Checker.get when a field is missing or of the wrong type

# field name -> (kind, nullable, minimum, maximum)
_Spec = tuple[str, bool, float | None, float | None]



def _kind_of(annotation: Any) -> tuple[str, bool]:
    """A record field's annotation as (schema kind, nullable)."""
    nullable = False
    if typing.get_origin(annotation) in (Union, types.UnionType):
        nullable = type(None) in typing.get_args(annotation)
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = typing.get_origin(annotation) or annotation
    if isinstance(base, type) and issubclass(base, JsonRecord):
        return "dict", nullable
    kinds = {bool: "bool", int: "int", float: "number", str: "str", dict: "dict", list: "list"}
    if base not in kinds:
        raise TypeError(f"no schema kind for the record annotation {annotation!r}")  # a bug in records.py
    return kinds[base], nullable


def specs_of(record: type[JsonRecord], skip: tuple[str, ...] = ()) -> tuple[dict[str, _Spec], dict[str, _Spec]]:
    """The schema of a record type, from its dataclass fields: (required, checked only
    when present). Optional sections (``omit_empty``) are checked by their own code."""
    hints = typing.get_type_hints(record)
    required: dict[str, _Spec] = {}
    present: dict[str, _Spec] = {}
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        if f.name in skip or f.metadata.get("omit_empty"):
            continue
        spec = (*_kind_of(hints[f.name]), f.metadata.get("min"), f.metadata.get("max"))
        (present if f.metadata.get("added_later") else required)[f.name] = spec
    return required, present


_TOP_FIELDS = specs_of(RunReport)
_SERVER_FIELDS = specs_of(ServerInfo)
_AGENT_FIELDS = specs_of(AgentInfo)
# Agent-id lists are checked by _Checker.id_list (a list of str, and consistent with each other).
_ROUND_FIELDS = specs_of(RoundRecord, skip=("participants", "completed", "missing"))
_BYTES_FIELDS = specs_of(ByteCounts)
_TIME_FIELDS = specs_of(RoundTimes)
_PER_AGENT_FIELDS = specs_of(AgentRoundRecord)
# A round's ``server``: optional (reports written before it existed have none); checked whenever present.
_ROUND_SERVER_FIELDS = specs_of(ServerDeviceRecord)
_TOTALS_FIELDS = specs_of(RunTotals)


def kind_ok(value: Any, kind: str) -> bool:
    # bool is an int subclass in Python, but True is never a byte count.
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    raise AssertionError(f"unknown kind {kind!r}")  # a bug in this module, not in the report


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
        if not kind_ok(value, kind):
            self.add(f"{where}: expected {kind}{' or None' if nullable else ''}, got {describe(value)}")
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

    def fields(self, obj: Any, path: str, specs: tuple[Mapping[str, _Spec], Mapping[str, _Spec]]) -> dict[str, Any]:
        """Check every field of ``obj`` (``specs``: required, and checked only when present);
        return the good ones (extra keys are allowed)."""
        if not isinstance(obj, dict):
            self.add(f"{path}: expected dict, got {describe(obj)}")
            return {}
        required, when_present = specs
        good = {}
        for key, spec in [*required.items(), *((k, s) for k, s in when_present.items() if k in obj)]:
            value = self.get(obj, path, key, spec)
            if value is not _BAD:
                good[key] = value
        return good

    def id_list(self, obj: Mapping[str, Any], path: str, key: str) -> list[str] | None:
        value = self.get(obj, path, key, ("list", False, None, None))
        if value is _BAD:
            return None
        if not all(isinstance(v, str) for v in value):
            self.add(f"{path}.{key}: expected a list of agent ids (str), got {describe(value)}")
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
        ck.fields(model, f"models.{role}", ({
            "name": ("str", False, None, None),
            "params": ("int", False, 0, None),
            # A server model may not be countable (e.g. a method without one, or a
            # counter that cannot trace it); the edge model always is.
            "train_flops_per_sample": ("int", role == "server", 0, None),
        }, {}))


def _check_agents(ck: _Checker, agents: Any) -> None:
    if not isinstance(agents, dict):
        return
    for agent_id, info in agents.items():
        good = ck.fields(info, f"agents[{agent_id}]", _AGENT_FIELDS)
        counts = good.get("class_counts")
        if counts is not None and not all(kind_ok(c, "int") and c >= 0 for c in counts):
            ck.add(f"agents[{agent_id}].class_counts: expected non-negative ints, got {describe(counts)}")


_IMAGE_ATTACK_FIELDS: tuple[dict[str, _Spec], dict[str, _Spec]] = ({
    "agent": ("str", False, None, None),
    "psnr_db": ("number", False, None, None),
    "ssim": ("number", False, -1.0, 1.0),
    "baseline_psnr_db": ("number", False, None, None),
    "baseline_ssim": ("number", False, -1.0, 1.0),
}, {})


def _check_leakage(ck: _Checker, leakage: Any) -> None:
    """The audit's section (optional): what the server held, each image attack's best agent
    and scores beside the mean-image baseline, each label attack's worst histogram error."""
    if leakage is None:
        return
    good = ck.fields(leakage, "leakage", ({
        "knowledge": ("list", False, None, None),
        "image_attacks": ("dict", False, None, None),
        "label_attacks": ("dict", False, None, None),
        "strongest": ("str", True, None, None),
    }, {}))
    for name, entry in (good.get("image_attacks") or {}).items():
        ck.fields(entry, f"leakage.image_attacks[{name}]", _IMAGE_ATTACK_FIELDS)
    for name, entry in (good.get("label_attacks") or {}).items():
        ck.fields(entry, f"leakage.label_attacks[{name}]", ({"histogram_error": ("number", False, 0.0, 1.0)}, {}))
    strongest = good.get("strongest")
    if strongest is not None and strongest not in (good.get("image_attacks") or {}):
        ck.add(f"leakage.strongest is {strongest!r}, which is not among leakage.image_attacks")


def _check_round(ck: _Checker, index: int, rnd: Any) -> dict[str, Any]:
    """Check one round record; return its good fields (with ``bytes`` and ``time_s`` checked)."""
    path = f"rounds[{index}]"
    if isinstance(rnd, dict) and kind_ok(rnd.get("round"), "int"):
        path = f"rounds[{index}] (round {rnd['round']})"  # findable by either number
    good = ck.fields(rnd, path, _ROUND_FIELDS)
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
        good["bytes"] = ck.fields(good["bytes"], f"{path}.bytes", _BYTES_FIELDS)
    if "time_s" in good:
        good["time_s"] = ck.fields(good["time_s"], f"{path}.time_s", _TIME_FIELDS)
    for agent_id, costs in good.get("per_agent", {}).items():
        ck.fields(costs, f"{path}.per_agent[{agent_id}]", _PER_AGENT_FIELDS)
        if participants is not None and agent_id not in participants:
            ck.add(f"{path}.per_agent[{agent_id}]: not a participant of the round")
    check_device_bytes(ck, path, rnd, _BYTES_FIELDS)
    if "server" in rnd:
        _check_round_server(ck, f"{path}.server", rnd["server"])
    if "method" in rnd and not isinstance(rnd["method"], dict):
        # Optional: the method's own figures (ServerMethod.round_report); free-form inside.
        ck.add(f"{path}.method: expected a dict of the method's figures, got {describe(rnd['method'])}")
    hooks = rnd.get("server_hooks_s", {})
    if not isinstance(hooks, dict) or not all(kind_ok(v, "number") and v >= 0 for v in hooks.values()):
        ck.add(f"{path}.server_hooks_s: expected seconds >= 0 by hook, got {describe(hooks)}")
    return good


def _check_round_server(ck: _Checker, path: str, server: Any) -> None:
    good = ck.fields(server, path, _ROUND_SERVER_FIELDS)
    if len(good) != len(_ROUND_SERVER_FIELDS[0]):
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
        if not all(kind_ok(v, "int") and v >= 0 for v in by_reason.values()):
            ck.add(f"totals.rejected_by_reason: expected non-negative int counts, got {describe(by_reason)}")
        elif "rejected_messages" in good and sum(by_reason.values()) != good["rejected_messages"]:
            ck.add(
                f"totals.rejected_messages is {good['rejected_messages']} but rejected_by_reason "
                f"sums to {sum(by_reason.values())}"
            )
    if isinstance(totals, dict) and ("rejected_chunks" in totals or "rejected_chunks_by_reason" in totals):
        # Chunks refused below the message layer (written by runs since they were counted by code).
        chunks, by_code = totals.get("rejected_chunks"), totals.get("rejected_chunks_by_reason")
        if not kind_ok(chunks, "int") or chunks < 0:
            ck.add(f"totals.rejected_chunks: expected a non-negative int, got {describe(chunks)}")
        elif not isinstance(by_code, dict) or not all(kind_ok(v, "int") and v >= 0 for v in by_code.values()):
            ck.add(f"totals.rejected_chunks_by_reason: expected non-negative int counts, got {describe(by_code)}")
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
    expectations = (  # (totals field, its value from the rounds, what that is)
        ("best_accuracy", max(accs) if accs else None, "the best round accuracy"),
        ("final_accuracy", accs[-1] if accs else None, "the last measured round accuracy"),
        ("final_edge_accuracy", edge_accs[-1] if edge_accs else None, "the last measured round edge_accuracy"),
    )
    for key, expected, what in expectations:
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
        raise ReportError([f"report: expected dict, got {describe(report)}"])
    top = ck.fields(report, "", _TOP_FIELDS)
    if top.get("run_id") == "":
        ck.add("run_id: must not be empty")
    if "status" in top and top["status"] not in RUN_STATUSES:
        ck.add(f"status: expected one of {sorted(RUN_STATUSES)}, got {top['status']!r}")
    if "server" in top:
        ck.fields(top["server"], "server", _SERVER_FIELDS)
    _check_agents(ck, top.get("agents"))
    _check_models(ck, top.get("models"))
    _check_leakage(ck, report.get("leakage"))
    _check_privacy(ck, report.get("privacy"))
    check_per_device(ck, report.get("per_device"))

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


# -- the per-device figures: The schema of the per-device figures in a report read back from disk: each round's
# ``device_bytes`` (by agent, training's and evaluation's bytes) and the ``per_device``
# section, whose link seconds must follow from its bytes and its stated link speed, and whose
# memory shares from its peaks and memories.


_TOP = {"link_mbit": ("number", False, 0.0), "device_memory_bytes": ("int", True, 1), "memory_share_warned": ("number", False, 0.0),
        "agents": ("dict", False, None), "warnings": ("list", False, None)}


def _specs(fields: Mapping[str, tuple[str, bool]]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: (kind, nullable, 0, None) if kind in ("int", "number") else (kind, nullable, None, None)
            for k, (kind, nullable) in fields.items()}, {}


_AGENT_SPECS = _specs(AGENT_FIELDS)


def check_device_bytes(ck: _Checker, path: str, rnd: Mapping[str, Any], byte_specs: Any) -> None:
    """A round's ``device_bytes`` (optional): {agent: {"train": bytes, "evaluation": bytes}}."""
    if "device_bytes" not in rnd:
        return
    device_bytes = rnd["device_bytes"]
    if not isinstance(device_bytes, dict):
        ck.add(f"{path}.device_bytes: expected a dict of agents, got {describe(device_bytes)}")
        return
    for agent, held in device_bytes.items():
        where = f"{path}.device_bytes[{agent}]"
        good = ck.fields(held, where, ({"train": ("dict", False, None, None), "evaluation": ("dict", False, None, None)}, {}))
        for kind, counts in good.items():
            ck.fields(counts, f"{where}.{kind}", byte_specs)


def _near(a: float, b: float) -> bool:
    """Figures derived from rounded ones (per-device means, link seconds) agree this closely."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def check_per_device(ck: _Checker, section: Any) -> None:
    """The ``per_device`` section (optional)."""
    if section is None:
        return
    top = ck.fields(section, "per_device", ({k: (kind, nullable, low, None) for k, (kind, nullable, low) in _TOP.items()}, {}))
    link = top.get("link_mbit")
    if link is not None and link <= 0:
        ck.add(f"per_device.link_mbit: must be above 0 Mbit/s, got {link!r}")
        link = None
    for agent, entry in (top.get("agents") or {}).items():
        where = f"per_device.agents[{agent}]"
        good = ck.fields(entry, where, _AGENT_SPECS)
        if len(good) != len(AGENT_FIELDS):
            continue  # the missing or mistyped fields are already recorded
        for total, parts in (("up_wire", ("train_up_wire", "eval_up_wire")), ("down_wire", ("train_down_wire", "eval_down_wire"))):
            if not _near(good[total], good[parts[0]] + good[parts[1]]):
                ck.add(f"{where}.{total} is {good[total]!r}, expected {parts[0]} + {parts[1]} = {good[parts[0]] + good[parts[1]]!r}")
        for seconds, wire in (("up_link_s", "up_wire"), ("down_link_s", "down_wire")):
            if link is not None and not _near(good[seconds], good[wire] * 8 / (link * 1e6)):
                ck.add(f"{where}.{seconds} is {good[seconds]!r}, expected {wire} x 8 / (link_mbit x 10^6) = "
                       f"{good[wire] * 8 / (link * 1e6)!r}")
            if good[f"max_{seconds}"] + 1e-9 < good[seconds]:
                ck.add(f"{where}.max_{seconds} {good[f'max_{seconds}']!r} is below the mean {good[seconds]!r}")
        peak, memory, share = good["peak_rss_bytes"], good["memory_bytes"], good["memory_share"]
        expected = peak / memory if peak is not None and memory else None
        if (share is None) != (expected is None) or (share is not None and not _near(share, expected)):  # type: ignore[arg-type]
            ck.add(f"{where}.memory_share is {share!r}, expected peak_rss_bytes / memory_bytes = {expected!r}")
        warned = top.get("memory_share_warned")
        if share is not None and warned is not None and (share > warned) != (good["memory_warning"] is not None):
            ck.add(f"{where}.memory_warning is {good['memory_warning']!r} with memory_share {share!r} against "
                   f"memory_share_warned {warned!r}: a share above it has a warning, one at or below it none")
