"""What a user should not read past in a run's figures: a global accuracy at chance, or far
below the same run's local or personalised figure (summary.md's "Warnings")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .formatting import pct

__all__ = ["sanity_warnings"]

#: A global accuracy within this factor of chance (1 / classes) after ``_CHANCE_AFTER_ROUNDS``
#: evaluated rounds is called "at chance".
_CHANCE_FACTOR = 1.5
_CHANCE_AFTER_ROUNDS = 2
#: The deployed model's global accuracy this far (absolute) below another figure of the same run.
_GAP = 0.25


def sanity_warnings(report: Mapping[str, Any]) -> list[str]:
    """What a user should not read past: a run whose global accuracy stays at chance, or far
    below the same run's local or personalised figure, with the likely causes and the settings
    to change (empty when neither)."""
    evaluated = [r for r in report["rounds"] if r.get("accuracy") is not None]
    if len(evaluated) < _CHANCE_AFTER_ROUNDS:
        return []
    num_classes = int(report["config"].get("num_classes") or 10)
    last, chance = evaluated[-1], 1.0 / num_classes
    samples = [info.get("num_samples", 0) for info in report["agents"].values()]
    per_agent = f"{min(samples):,}-{max(samples):,}" if samples else "?"
    warnings = []
    if max(r["accuracy"] for r in evaluated) <= _CHANCE_FACTOR * chance:
        warnings.append(
            f"Global accuracy is at chance ({pct(last['accuracy'])}, chance {pct(chance)}) after {len(evaluated)} evaluated "
            f"rounds. Likely causes: too little training for this model ({per_agent} training images per agent, "
            f"{len(evaluated)} rounds), or a learning rate that does not suit it. Try more data (`--train-samples`), more "
            "rounds (`--rounds`) or fewer, larger agents (`--agents`), and check the method's learning rate (`--set "
            "<method>.lr=...`).")
    figures = {**(last.get("evaluation") or {}).get("accuracy", {}), "local": last.get("local_accuracy")}
    higher = {label: acc for label, acc in figures.items() if label != "model" and acc is not None
              and acc - last["accuracy"] >= _GAP}
    if higher and not warnings:
        named = ", ".join(f"{label} {pct(acc)}" for label, acc in sorted(higher.items()))
        warnings.append(
            f"The deployed model's global accuracy ({pct(last['accuracy'])}) is far below this run's {named}. On "
            "label-skewed shards (`--partition dirichlet:A` with a small A) a shared model can trail what each agent "
            "reaches on its own classes; compare with `--partition iid`, and see the method's notes on non-IID agents.")
    return warnings
