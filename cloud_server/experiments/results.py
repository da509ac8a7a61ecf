"""The one result schema of every experiment, and the figures a cell takes from its run.

A results file (``bench/results/NAME.json``)::

    {"schema": 1,
     "experiment": {...the parsed experiment file...},
     "machine": {"cpu_model", "cores", "torch", "python"},
     "cells": [{"key", "method", "partition", "seed", "variant", "overrides", "command",
                "status": "done" | "failed", "wall_s", "error",
                "run": {RUN_FIGURES: number or null, RUN_SERIES: [number or null per round]} or null,
                "leakage": {"attacks": {name: {...}}, "strongest": {...} or null} or null}]}

``run`` is read from the run's ``report.json`` by :func:`run_figures` and ``leakage`` from
its ``audit/leakage.json`` by :func:`leakage_figures`; :func:`validate_results` checks a
document (the runner on every write, the suite on every committed file).
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from ..records import HEADLINE

__all__ = ["SCHEMA", "RUN_FIGURES", "RUN_SERIES", "OPTIONAL_RUN_FIGURES", "LEAKAGE_FIGURES", "ROBUSTNESS_FIGURES", "CELL_STATUSES", "ResultsError",
           "faulty_agents", "honest_accuracy", "leakage_figures", "load_results", "machine", "robustness_figures", "run_figures", "validate_results",
           "write_results"]

SCHEMA = 1
CELL_STATUSES = ("done", "failed")
#: The figures of a run, each a number or null (not measured by that method or that run).
RUN_FIGURES = (
    "final_accuracy", "best_accuracy", "local_accuracy", "edge_accuracy", "personalised_accuracy",
    "rounds", "rounds_planned", "edge_train_gflops", "edge_train_gflops_per_agent",
    "train_up_payload_bytes", "train_up_wire_bytes", "train_down_payload_bytes", "train_down_wire_bytes",
    "eval_up_payload_bytes", "eval_up_wire_bytes", "eval_down_payload_bytes", "eval_down_wire_bytes",
    "peak_agent_rss_bytes", "run_wall_s",
)
#: What the server's screen did and judged (its ``robustness`` records), the agents made faulty on
#: purpose (``--faulty-agent``, named in the report) apart from the honest ones; see :func:`robustness_figures`.
ROBUSTNESS_FIGURES = ("refused_uploads", "honest_refused_uploads", "faulty_refused_uploads", "faulty_unused_rounds",
                      "honest_min_cosine", "faulty_max_cosine", "honest_max_validation_rise", "faulty_min_validation_rise",
                      "honest_min_label_agreement", "faulty_max_label_agreement")
#: Figures a run has only with a setting on (differential privacy's ε, cloud_server/privacy.py);
#: results written before they existed lack them, so they are checked only where present.
OPTIONAL_RUN_FIGURES = ("dp_fedavg_epsilon", "dpsgd_epsilon", "activation_epsilon_per_image",
                        *(f"{k}_per_round" for k in ("server_train_s", "server_eval_s", "round_s")),
                        "up_wire_bytes_first_round", "up_wire_bytes_per_later_round", "server_eval_over_train",
                        "later_over_first_round_up", "agents_warned_against_peers", "report_warnings", "agent_idle_share",
                        "honest_accuracy", *ROBUSTNESS_FIGURES)
#: Per round of a run (lists, an entry null where that round measured none): the global accuracy, the
#: edge training GFLOPs and the bytes through the server's connection, both ways, training only.
RUN_SERIES = ("accuracy_by_round", "edge_train_gflops_by_round", "train_wire_bytes_by_round")
_IMAGE_SCORES = ("psnr_db", "ssim", "baseline_psnr_db", "baseline_ssim")
#: The strongest image attack's scores (and its PSNR over the mean image's), and the best label attack's error in the agents' label
#: histograms beside a uniform guess's, as figures of the long table.
LEAKAGE_FIGURES = (*(f"leakage_{k}" for k in _IMAGE_SCORES), "leakage_gain_db", "leakage_label_error",
                   "leakage_label_baseline_error")
_CELL_KEYS = ("key", "method", "partition", "seed", "variant", "overrides", "status", "wall_s", "run", "leakage")


class ResultsError(ValueError):
    """A results document that does not follow the schema; ``problems`` lists every finding."""

    def __init__(self, problems: list[str], where: str = "results") -> None:
        self.problems = problems
        super().__init__(f"{where} does not follow the results schema {SCHEMA} (see docs/experiments.md): "
                         + "; ".join(problems))


def machine() -> dict[str, Any]:
    """Where the cells ran: CPU model, cores, torch and Python versions (torch is not imported)."""
    from shared_protocol.hostinfo import host_info

    host = host_info()
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return {"cpu_model": host.cpu_model, "cores": host.cores, "torch": torch, "python": platform.python_version()}


def _last_evaluation(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r["evaluation"] for r in reversed(report.get("rounds", [])) if r.get("evaluation")), None)


def run_figures(report: Mapping[str, Any]) -> dict[str, float | int | None]:
    """A cell's figures from its run's ``report.json``: what the report holds, null where it has none.

    Bytes are the server connection's, training (the rounds) apart from evaluation; edge FLOPs are
    training's, forward + backward; the personalised accuracy is the last evaluation's model whose
    label starts with ``personalised``, where a method scores one."""
    totals = report["totals"]
    evaluation = _last_evaluation(report) or {}
    personalised = [v for k, v in evaluation.get("accuracy", {}).items() if k.startswith("personalised")]
    eval_bytes = totals.get("eval_bytes", {})
    agents = len(report.get("agents", {})) or None
    rounds = report.get("rounds", [])
    peaks = [costs.get("peak_rss_bytes", 0) for r in rounds for costs in r.get("per_agent", {}).values()]
    timing = _timing(rounds)
    flops = totals.get("edge_train_flops", 0)
    return {
        "final_accuracy": totals.get("final_accuracy"),
        "best_accuracy": totals.get("best_accuracy"),
        "local_accuracy": totals.get("final_local_accuracy"),
        "edge_accuracy": totals.get("final_edge_accuracy"),
        "personalised_accuracy": personalised[0] if personalised else None,
        "rounds": totals.get("rounds_completed"),
        "rounds_planned": report.get("config", {}).get("rounds"),
        "edge_train_gflops": flops / 1e9,
        "edge_train_gflops_per_agent": flops / 1e9 / agents if agents else None,
        **{f"train_{k}_bytes": totals.get(k) for k in ("up_payload", "up_wire", "down_payload", "down_wire")},
        **{f"eval_{k}_bytes": eval_bytes.get(k) for k in ("up_payload", "up_wire", "down_payload", "down_wire")},
        "peak_agent_rss_bytes": max(peaks) if any(peaks) else None,
        "run_wall_s": totals.get("wall_time_s"),
        "dp_fedavg_epsilon": ((report.get("privacy") or {}).get("dp_fedavg") or {}).get("epsilon"),
        "dpsgd_epsilon": ((report.get("privacy") or {}).get("dpsgd") or {}).get("epsilon"),
        "activation_epsilon_per_image": (report.get("defences") or {}).get("epsilon_per_image"),
        **timing,
        "server_eval_over_train": _ratio(timing["server_eval_s_per_round"], timing["server_train_s_per_round"]),
        "later_over_first_round_up": _ratio(timing["up_wire_bytes_per_later_round"], timing["up_wire_bytes_first_round"]),
        "agents_warned_against_peers": _warned_against_peers(report),
        "report_warnings": _report_warnings(report),
        "agent_idle_share": _idle_share(rounds),
        "honest_accuracy": honest_accuracy(report, evaluation),
        **robustness_figures(rounds, faulty_agents(report)),
        "accuracy_by_round": [r.get("accuracy") for r in rounds],
        "edge_train_gflops_by_round": [(r.get("edge_train_flops") or 0) / 1e9 for r in rounds],
        "train_wire_bytes_by_round": [r["bytes"]["up_wire"] + r["bytes"]["down_wire"]
                                      if {"up_wire", "down_wire"} <= set(r.get("bytes", {})) else None for r in rounds],
    }


def honest_accuracy(report: Mapping[str, Any], evaluation: Mapping[str, Any]) -> float | None:
    """The last evaluation's global accuracy over the agents not made faulty on purpose: where a
    method deploys a model per agent (FedKD's mentors, FedGKT's pipelines), the mean of the honest
    agents' figures, so that what a faulty device does to its own model (which no server defence
    can reach) is apart from what it does to the others'; with one deployed model, the global
    figure. Without a faulty agent, the global figure."""
    final = (report.get("totals") or {}).get("final_accuracy")
    faulty = faulty_agents(report)
    per_agent = evaluation.get("per_agent") or {}
    figures = {a: (v.get("accuracy") or {}).get(HEADLINE) for a, v in per_agent.items() if isinstance(v, Mapping)}
    honest = [float(f) for a, f in figures.items() if a not in faulty and f is not None]
    if not faulty or not honest:
        return final
    return sum(honest) / len(honest)


def faulty_agents(report: Mapping[str, Any]) -> set[str]:
    """The agents the report names as faulty on purpose (``[agent] fault``)."""
    return {a for a, info in report.get("agents", {}).items() if isinstance(info, Mapping) and info.get("fault")}


def robustness_figures(rounds: list[Mapping[str, Any]], faulty: set[str]) -> dict[str, float | int | None]:
    """What the screen did over a run's rounds (their ``excluded`` and ``robustness`` records): uploads
    refused as implausible (all, the honest agents', the faulty ones'; FedGKT counts every batch), the
    rounds a faulty agent's upload was not used in (refused, excluded or quarantined); and what it
    judged, where the check recorded it: the honest agents' lowest cosine with the round's median
    update and the faulty ones' highest, the honest agents' largest rise of the validation loss and
    the faulty ones' smallest finite one (a rise that is not finite is refused at any margin), the
    honest agents' lowest label agreement and the faulty ones' highest. Null where nothing was judged;
    the faulty agents' figures null in a run without one."""
    refused = {"honest": 0, "faulty": 0}
    judged: dict[str, list[float]] = {}
    unused = 0
    for r in rounds:
        section = r.get("robustness") or {}
        for agent, reasons in (section.get("refused") or {}).items():
            refused["faulty" if agent in faulty else "honest"] += sum(int(v.get("count", 1)) for v in reasons.values())
        if faulty & (set(r.get("excluded") or {}) | set(section.get("quarantine_excluded") or ())):
            unused += 1
        agreement = {a: f.get("server") for a, f in ((section.get("label_agreement") or {}).get("agents") or {}).items()}
        for figure, agents in (("cosine", (section.get("update_directions") or {}).get("agents")),
                               ("validation_rise", (section.get("update_validation") or {}).get("agents")),
                               ("label_agreement", agreement)):
            for agent, value in (agents or {}).items():
                if _is_number(value):
                    judged.setdefault(f"{'faulty' if agent in faulty else 'honest'}_{figure}", []).append(float(value))
    return {
        "refused_uploads": refused["honest"] + refused["faulty"] if rounds else None,
        "honest_refused_uploads": refused["honest"] if rounds else None,
        "faulty_refused_uploads": refused["faulty"] if rounds and faulty else None,
        "faulty_unused_rounds": unused if rounds and faulty else None,
        "honest_min_cosine": min(judged.get("honest_cosine", []), default=None),
        "faulty_max_cosine": max(judged.get("faulty_cosine", []), default=None),
        "honest_max_validation_rise": max(judged.get("honest_validation_rise", []), default=None),
        "faulty_min_validation_rise": min(judged.get("faulty_validation_rise", []), default=None),
        "honest_min_label_agreement": min(judged.get("honest_label_agreement", []), default=None),
        "faulty_max_label_agreement": max(judged.get("faulty_label_agreement", []), default=None),
    }


def _warned_against_peers(report: Mapping[str, Any]) -> int | None:
    """How many agents the run report warns about for updates that kept pointing against the
    others' (cloud_server/report/sanity.py); None for a run that judged no update's direction."""
    from cloud_server.report.sanity import against_the_peers

    judged = any(((r.get("robustness") or {}).get("update_directions") or {}).get("agents") for r in report.get("rounds", []))
    return len(against_the_peers(report)) if judged and "config" in report else None


def _report_warnings(report: Mapping[str, Any]) -> int | None:
    """How many warnings the run report puts before its figures (cloud_server/report/sanity.py:
    accuracy at chance, far below the run's local figure, updates against the peers)."""
    from cloud_server.report.sanity import sanity_warnings

    return len(sanity_warnings(report)) if {"config", "agents", "rounds"} <= set(report) else None


def _timing(rounds: list[Mapping[str, Any]]) -> dict[str, float | None]:
    """Where a run's time and upload bytes go per round: the server's training, its evaluation (the
    method's evaluation hook, e.g. scoring test maps, plus the evaluator's scoring on the global set;
    over the rounds that were evaluated), the whole round; the first round's bytes up and the mean of
    the later rounds' (what an upload sent once saves)."""
    later_up = [r["bytes"]["up_wire"] for r in rounds[1:] if "up_wire" in r.get("bytes", {})]
    evaluated = [r for r in rounds if r.get("evaluation")]
    return {
        "server_train_s_per_round": _mean(r.get("time_s", {}).get("server_train") for r in rounds),
        "server_eval_s_per_round": _mean((r["evaluation"].get("server_eval_s") or 0.0)
                                         + (r.get("server_hooks_s", {}).get("evaluation") or 0.0) for r in evaluated),
        "round_s_per_round": _mean(r.get("time_s", {}).get("round") for r in rounds),
        "up_wire_bytes_first_round": rounds[0].get("bytes", {}).get("up_wire") if rounds else None,
        "up_wire_bytes_per_later_round": sum(later_up) / len(later_up) if later_up else None,
    }


def _idle_share(rounds: list[Mapping[str, Any]]) -> float | None:
    """The agents' idle share: per agent, the seconds it waited for the server between its rounds
    over those plus its rounds' own seconds (from its first round's start to its last round's end),
    then the mean over the agents; None when no agent reported its times."""
    spent: dict[str, list[float]] = {}
    for r in rounds:
        for agent, costs in r.get("per_agent", {}).items():
            idle_round = spent.setdefault(agent, [0.0, 0.0])
            idle_round[0] += costs.get("idle_s") or 0.0
            idle_round[1] += costs.get("round_s") or 0.0
    return _mean(idle / (idle + busy) for idle, busy in spent.values() if idle + busy > 0)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _mean(values: Any) -> float | None:
    """The mean of the numbers among ``values``; None when there are none."""
    numbers = [v for v in values if _is_number(v)]
    return sum(numbers) / len(numbers) if numbers else None


def leakage_figures(leakage: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's leakage from its ``audit/leakage.json``: per attack the agent where it did best
    (image attacks: highest PSNR, with that attack's wall time; label attacks: lowest histogram
    error), the strongest image attack (highest PSNR) or null when no image attack ran, what
    the server was assumed to hold, the attacks that apply but did not run and why, and the
    audit's wall time."""
    attacks: dict[str, dict[str, Any]] = {
        name: {"agent": best["agent"], **{k: best[k] for k in _IMAGE_SCORES}} for name, best in leakage.get("best", {}).items()}
    for agent, entry in leakage.get("agents", {}).items():
        for row in entry.get("attacks", []):
            if "histogram_error" in row and (row["attack"] not in attacks
                                             or row["histogram_error"] < attacks[row["attack"]]["histogram_error"]):
                attacks[row["attack"]] = {"agent": agent, "histogram_error": row["histogram_error"],
                                          **({"baseline_histogram_error": row["baseline_histogram_error"]}
                                             if "baseline_histogram_error" in row else {})}
    skipped: dict[str, str] = {}
    rows = [row for entry in leakage.get("agents", {}).values()
            for row in entry.get("attacks", []) + entry.get("evaluation_uploads", {}).get("attacks", [])]
    for row in rows:  # an attack that applies but did not run, and why (the first agent's reason)
        if "skipped" in row and row["attack"] not in attacks:
            skipped.setdefault(row["attack"], row["skipped"])
    for name, scores in attacks.items():  # the wall time of the row that gave the best score
        best = next((row for row in rows if row.get("attack") == name and "wall_s" in row
                     and row.get("psnr_db") == scores.get("psnr_db")), None)
        if best is not None:
            scores["wall_s"] = best["wall_s"]
    images = [(scores["psnr_db"], name) for name, scores in attacks.items() if "psnr_db" in scores]
    strongest = None
    if images:
        _, name = max(images)
        strongest = {"attack": name, **{k: attacks[name][k] for k in _IMAGE_SCORES}}
    return {"attacks": attacks, "strongest": strongest, "not_supported": leakage.get("not_supported"),
            "knowledge": leakage.get("knowledge"), "skipped": skipped, "audit_wall_s": leakage.get("wall_s")}


# -- the schema -------------------------------------------------------------------------------- #


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_leakage(leakage: Any, where: str, problems: list[str]) -> None:
    if leakage is None:
        return
    if not isinstance(leakage, dict) or not isinstance(leakage.get("attacks"), dict) or "strongest" not in leakage:
        problems.append(f"{where}.leakage: expected {{\"attacks\": {{...}}, \"strongest\": ...}} or null")
        return
    for name, scores in leakage["attacks"].items():
        wanted = _IMAGE_SCORES if "psnr_db" in scores else ("histogram_error",)
        bad = [k for k in wanted if not _is_number(scores.get(k))]
        if bad or not isinstance(scores.get("agent"), str):
            problems.append(f"{where}.leakage.attacks.{name}: needs agent and numbers {', '.join(wanted)}")
    strongest = leakage["strongest"]
    if strongest is not None and (not isinstance(strongest, dict) or strongest.get("attack") not in leakage["attacks"]
                                  or not all(_is_number(strongest.get(k)) for k in _IMAGE_SCORES)):
        problems.append(f"{where}.leakage.strongest: expected null or an image attack of attacks with {', '.join(_IMAGE_SCORES)}")


def _check_cell(cell: Any, i: int, problems: list[str]) -> None:
    where = f"cells[{i}]"
    if not isinstance(cell, dict):
        problems.append(f"{where}: expected an object")
        return
    missing = [k for k in _CELL_KEYS if k not in cell]
    if missing:
        problems.append(f"{where}: missing {', '.join(missing)}")
        return
    where = f"cells[{i}] ({cell['key']})"
    for key in ("key", "method", "partition", "variant"):
        if not isinstance(cell[key], str) or not cell[key]:
            problems.append(f"{where}.{key}: expected a non-empty string")
    if not isinstance(cell["seed"], int) or isinstance(cell["seed"], bool):
        problems.append(f"{where}.seed: expected an integer")
    if cell["status"] not in CELL_STATUSES:
        problems.append(f"{where}.status: expected one of {CELL_STATUSES}, got {cell['status']!r}")
    if not (cell["wall_s"] is None or _is_number(cell["wall_s"])):
        problems.append(f"{where}.wall_s: expected a number")
    overrides = cell["overrides"]
    if not isinstance(overrides, dict) or not isinstance(overrides.get("flags"), dict) or not isinstance(overrides.get("settings"), dict):
        problems.append(f"{where}.overrides: expected {{\"flags\": {{...}}, \"settings\": {{...}}}}")
    run = cell["run"]
    if run is None:
        if cell["status"] == "done":
            problems.append(f"{where}.run: a done cell has its run's figures")
    elif not isinstance(run, dict):
        problems.append(f"{where}.run: expected an object or null")
    else:
        missing = [k for k in RUN_FIGURES if k not in run]
        if missing:
            problems.append(f"{where}.run: missing {', '.join(missing)}")
        bad = [k for k in (*RUN_FIGURES, *OPTIONAL_RUN_FIGURES) if k in run and not (run[k] is None or _is_number(run[k]))]
        if bad:
            problems.append(f"{where}.run: expected a number or null for {', '.join(bad)}")
        bad = [k for k in RUN_SERIES if k in run and not (isinstance(run[k], list) and all(v is None or _is_number(v) for v in run[k]))]
        if bad:
            problems.append(f"{where}.run: expected a list of numbers or nulls, one per round, for {', '.join(bad)}")
        for key in ("final_accuracy", "best_accuracy", "local_accuracy", "edge_accuracy", "personalised_accuracy"):
            if _is_number(run.get(key)) and not 0 <= run[key] <= 1:
                problems.append(f"{where}.run.{key}: an accuracy is a fraction in [0, 1], got {run[key]!r}")
    _check_leakage(cell["leakage"], where, problems)


def validate_results(doc: Any, where: str = "results") -> None:
    """Raise :class:`ResultsError` listing every way ``doc`` departs from the schema."""
    problems: list[str] = []
    if not isinstance(doc, dict):
        raise ResultsError(["expected a JSON object"], where)
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema: expected {SCHEMA}, got {doc.get('schema')!r}")
    experiment = doc.get("experiment")
    if not isinstance(experiment, dict) or not isinstance(experiment.get("name"), str):
        problems.append("experiment: expected the parsed experiment (an object with its name)")
    host = doc.get("machine")
    if not isinstance(host, dict) or [k for k in ("cpu_model", "cores", "torch", "python") if k not in host]:
        problems.append("machine: expected cpu_model, cores, torch and python")
    cells = doc.get("cells")
    if not isinstance(cells, list):
        problems.append("cells: expected a list")
        cells = []
    for i, cell in enumerate(cells):
        _check_cell(cell, i, problems)
    keys = [c.get("key") for c in cells if isinstance(c, dict)]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        problems.append(f"cells: a key is recorded twice: {', '.join(map(str, twice))}")
    if problems:
        raise ResultsError(problems, where)


def write_results(path: Path, doc: Mapping[str, Any]) -> None:
    """Validate, then write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    validate_results(doc, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def load_results(path: Path) -> dict[str, Any] | None:
    """The results at ``path``, validated; None when there is no file yet."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError([f"not JSON: {exc}"], str(path)) from None
    validate_results(doc, str(path))
    return doc  # type: ignore[no-any-return]
