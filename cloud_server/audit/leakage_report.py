"""The audit's result in the run's own report: the ``leakage`` section of report.json (and so
of summary.md and the comparison of runs), and what the evaluation reports handed over, in words."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..audit_keeper import AUDIT_DIR

__all__ = ["attach_to_report", "eval_models_note", "leakage_section"]

log = logging.getLogger(__name__)

# What an evaluation report's models are, for the methods whose reports carry one.
_EVAL_MODELS = {"fedkd": "the agent's private mentor", "fedgkt": "the agent's ResNet-8, extractor included"}


def eval_models_note(method: str, eval_models: dict[str, Any]) -> str:
    """What the agents' evaluation reports handed the server besides figures, in words."""
    if not eval_models:
        return ""
    what = _EVAL_MODELS.get(method, "the models " + ", ".join(sorted({m for e in eval_models.values() for m in e["models"]})))
    sizes = sorted(entry["bytes"] for entry in eval_models.values())
    return (f"the evaluation reports of {len(eval_models)} agents carried {what} ({sizes[0] / 1e6:.2f}-{sizes[-1] / 1e6:.2f} "
            "MB each, trained on the private data): the audit uses an edge model as the extractor where one applies and "
            "does not invert trained models otherwise")


def leakage_section(result: dict[str, Any], picture: str | None = None) -> dict[str, Any]:
    """The run report's ``leakage`` section from an audit's result: per image attack the agent
    where it scored highest, per label attack the histogram error on the most exposed agent, the strongest
    image attack, what the server was assumed to hold and what was not run or not audited."""
    labels: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for entry in result["agents"].values():
        for row in entry["attacks"]:
            if "skipped" in row:
                skipped.setdefault(row["attack"], row["skipped"])
            elif "histogram_error" in row:
                worst = labels.get(row["attack"])
                if worst is None or row["histogram_error"] < worst["histogram_error"]:
                    labels[row["attack"]] = {"histogram_error": float(row["histogram_error"]),
                                             "baseline_histogram_error": float(row["baseline_histogram_error"])}
    images = {name: dict(best) for name, best in result["best"].items()}
    strongest = max(images, key=lambda name: images[name]["psnr_db"]) if images else None
    return {"knowledge": list(result["knowledge"]["holds"]), "note": result["knowledge"]["note"],
            "image_attacks": images, "label_attacks": labels, "strongest": strongest,
            "skipped": {k: v for k, v in skipped.items() if k not in images and k not in labels},
            "not_supported": result.get("not_supported"), "notes": list(result.get("notes", [])), "picture": picture,
            "audit_wall_s": result["wall_s"]}


def attach_to_report(run_dir: Path, section: dict[str, Any]) -> bool:
    """Put ``section`` into ``run_dir``'s report.json as ``leakage`` and rewrite summary.md and
    the plots; False when the run directory holds no report (the server's own directory) or one
    this version cannot load (written by an older EdgeSplit: the audit's own files still hold
    everything it found, and the log says so)."""
    from ..report import ReportError, load_report, write_report

    if not (run_dir / "report.json").exists():
        return False
    try:
        report = load_report(run_dir)
    except ReportError as exc:
        log.warning("%s does not load with this version of EdgeSplit, so it stays without the leakage section (the "
                    "audit's findings are in %s; run the run again for a report that carries them): %s",
                    run_dir / "report.json", run_dir / AUDIT_DIR, exc)
        return False
    report["leakage"] = section
    write_report(run_dir, report)
    return True
