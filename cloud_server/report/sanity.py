"""What a user should not read past in a run's figures: a global accuracy at chance, far below
the same run's local or personalised figure, or averaged with an update that kept pointing
against the others' (summary.md's "Warnings")."""

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
#: An update whose cosine with the coordinate-wise median of the round's updates is below this
#: points against the others; an agent whose update does so in more than half of its judged rounds
#: (two at least, unless the run trained no round after its last judged one) is named. A sign-flipped update sits near -1 in every round; honest agents on
#: label-skewed shards dip below zero in some rounds (the recorded cosines per partition are in
#: bench/results/update_directions.json and the robustness_defaults experiment's runs).
AGAINST_COSINE = -0.5
_AGAINST_MIN_ROUNDS = 2
#: The settings that already act on such an update (the warning names them when none is on).
_ROBUST_RULES = ("trimmed_mean", "median", "krum", "multi_krum")


def sanity_warnings(report: Mapping[str, Any]) -> list[str]:
    """What a user should not read past: a run whose global accuracy stays at chance, or far
    below the same run's local or personalised figure, with the likely causes and the settings
    to change (empty when neither)."""
    evaluated = [r for r in report["rounds"] if r.get("accuracy") is not None]
    if len(evaluated) < _CHANCE_AFTER_ROUNDS:
        return against_the_peers(report)
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
    warnings += against_the_peers(report)
    return warnings


def against_the_peers(report: Mapping[str, Any]) -> list[str]:
    """Per agent whose weight update kept pointing against the round's others (its cosine with
    their coordinate-wise median below ``AGAINST_COSINE`` in most of the rounds it was judged in)
    while the server averaged it in with no setting that acts on it: a warning naming the agent,
    the rounds, and the settings that stop such an update. Empty for methods that share no
    weights (no cosines recorded) and for runs with a robust rule, the direction check or the
    validation screen on."""
    config = report["config"]
    if (config.get("aggregation") in _ROBUST_RULES or (config.get("validation_samples") or 0) > 0
            or (config.get("plausible_min_cosine") if config.get("plausible_min_cosine") is not None else -1.0) > AGAINST_COSINE):
        return []
    judged: dict[str, list[float]] = {}
    last_judged = 0
    for round_record in report["rounds"]:
        cosines = ((round_record.get("robustness") or {}).get("update_directions") or {}).get("agents") or {}
        for agent, cosine in cosines.items():
            if cosine is not None:
                judged.setdefault(agent, []).append(float(cosine))
                last_judged = max(last_judged, int(round_record["round"]))
    # A run that trained no round after its last judged one (the rounds after it failed, or it was
    # aborted) gives no second round to judge: its judged rounds are all there is.
    later = [r for r in report["rounds"] if int(r["round"]) > last_judged]
    cut_short = (not any(r.get("status") == "ok" for r in later)
                 and (any(r.get("status") != "ok" for r in later) or report.get("status") == "aborted"))
    warnings = []
    for agent, cosines in sorted(judged.items()):
        against = [c for c in cosines if c < AGAINST_COSINE]
        if (len(cosines) >= _AGAINST_MIN_ROUNDS or cut_short) and 2 * len(against) > len(cosines):
            after = (f"; no round after round {last_judged} trained (the run was cut short there), so that is all that "
                     "could be judged" if cut_short and len(cosines) < _AGAINST_MIN_ROUNDS else "")
            warnings.append(
                f"{agent}'s weight update pointed against the other agents' in {len(against)} of the {len(cosines)} rounds "
                f"it was judged in (its cosine with the round's coordinate-wise median as low as {min(against):.2f}{after}), and "
                f"the server averaged it in (`[server] aggregation = \"{config.get('aggregation', 'mean')}\"`). A faulty or "
                "malicious device sends such updates (a sign flip), and so, in some rounds, can an honest one whose data "
                "differ from everyone else's. If that device is not to be trusted, set `[server] aggregation = \"median\"` "
                "(or \"trimmed_mean\", \"multi_krum\"), or hold out a validation set that screens updates "
                "(`[server] validation_samples`); docs/configuration.md measures what each costs.")
    return warnings
