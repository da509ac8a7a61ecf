"""The :class:`RobustnessLedger`: per round and agent, what was refused and why (the first
figure and threshold, logged once per agent, round and reason), what was clipped, which
server steps were skipped, which rule ran; and quarantine: an agent refused as implausible
in ``quarantine_after`` consecutive rounds is excluded until a round in which all its
uploads were plausible (``quarantine_release = "plausible"``, used again from the round
after) or for the run (``"never"``). Its state is kept in the checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .robust_config import RobustnessConfig

# The name the robustness log lines have always had (cloud_server/robust.py before its split).
log = logging.getLogger("cloud_server.robust")

__all__ = ["RobustnessLedger"]


@dataclass
class _RoundEntry:
    refused: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # agent -> reason -> {count, detail}
    clipped: dict[str, dict[str, int]] = field(default_factory=dict)  # agent -> what -> count
    skipped_steps: dict[str, int] = field(default_factory=dict)  # agent -> server steps skipped on its data
    aggregation: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    quarantine_excluded: list[str] = field(default_factory=list)
    update_norms: dict[str, float] = field(default_factory=dict)  # agent -> its update's L2 norm, as screened
    reference_norm: float = 0.0  # the global model's norm the updates were screened against (0: none)
    update_cosines: dict[str, float] = field(default_factory=dict)  # agent -> cosine with the round's median update
    sections: dict[str, Any] = field(default_factory=dict)  # more checks' figures (record), key -> section, verbatim


class RobustnessLedger:
    """Per round: refusals, clips, skipped steps and the aggregation rule that ran; and
    the quarantine. Methods and the coordinator write it; the coordinator takes a round's
    entry (:meth:`take`) when the round closes."""

    def __init__(self, cfg: RobustnessConfig | None = None) -> None:
        self.cfg = cfg or RobustnessConfig()
        self._rounds: dict[int, _RoundEntry] = {}
        self.streaks: dict[str, int] = {}  # agent -> consecutive closed rounds with a refusal
        self.quarantined: dict[str, dict[str, Any]] = {}  # agent -> {"since": round, "why": str}
        self.history: list[dict[str, Any]] = []  # quarantine events: {"round", "agent", "event", "why"}

    def _entry(self, round_: int) -> _RoundEntry:
        return self._rounds.setdefault(round_, _RoundEntry())

    def refuse(self, round_: int, agent: str, reason: str, detail: str) -> None:
        by_reason = self._entry(round_).refused.setdefault(agent, {})
        if reason not in by_reason:
            by_reason[reason] = {"count": 0, "detail": detail}
            log.warning("round %d: refused %s's upload as implausible (%s): %s", round_, agent, reason, detail)
        by_reason[reason]["count"] += 1

    def norms(self, round_: int, norms: Mapping[str, float], reference_norm: float) -> None:
        """The update norms the plausibility check judged (recorded whether refused or not:
        what a user needs to set the thresholds for their fleet, and what bench/robustness.py
        reads for the honest agents' spread)."""
        entry = self._entry(round_)
        entry.update_norms.update({a: float(v) for a, v in norms.items()})
        entry.reference_norm = float(reference_norm)

    def directions(self, round_: int, cosines: Mapping[str, float]) -> None:
        """The cosines the direction check judged (recorded whether refused or not, and when
        the check is off: what a user needs to set ``plausible_min_cosine`` for their fleet;
        bench/update_directions.py reads them)."""
        self._entry(round_).update_cosines.update({a: float(v) for a, v in cosines.items()})

    def record(self, round_: int, key: str, section: Mapping[str, Any]) -> None:
        """Another check's figures, as the round's ``robustness[key]`` (strict JSON)."""
        self._entry(round_).sections[key] = dict(section)

    def refused_in(self, round_: int, agent: str) -> bool:
        entry = self._rounds.get(round_)
        return entry is not None and agent in entry.refused

    def clip(self, round_: int, agent: str, what: str, detail: str = "") -> None:
        counts = self._entry(round_).clipped.setdefault(agent, {})
        if what not in counts and detail:
            log.info("round %d: clipped %s's %s: %s", round_, agent, what, detail)
        counts[what] = counts.get(what, 0) + 1

    def skip_step(self, round_: int, agent: str, detail: str) -> None:
        steps = self._entry(round_).skipped_steps
        if agent not in steps:
            log.warning("round %d: skipped a server step on %s's data: %s", round_, agent, detail)
        steps[agent] = steps.get(agent, 0) + 1

    def aggregation(self, round_: int, figures: Mapping[str, Any]) -> None:
        self._entry(round_).aggregation = dict(figures)
        if figures.get("fallback"):
            self.warn(round_, f"aggregation: {figures['fallback']}")

    def warn(self, round_: int, text: str) -> None:
        log.warning("round %d: %s", round_, text)
        self._entry(round_).warnings.append(text)

    # -- quarantine --------------------------------------------------------- #

    def is_quarantined(self, agent: str) -> bool:
        return agent in self.quarantined

    def exclude_quarantined(self, round_: int, agent: str) -> str:
        """The reason a quarantined agent's upload is not used in ``round_`` (and note it)."""
        entry = self._entry(round_)
        if agent not in entry.quarantine_excluded:
            entry.quarantine_excluded.append(agent)
        q = self.quarantined[agent]
        return f"quarantined since round {q['since']} ({q['why']})"

    def close_round(self, round_: int, judged: Sequence[str]) -> None:
        """Update the quarantine after ``round_``: ``judged`` are the agents whose uploads
        the round examined (they finished it); an agent that was not judged keeps its state."""
        cfg = self.cfg
        entry = self._rounds.get(round_) or _RoundEntry()
        for agent in judged:
            refused = agent in entry.refused
            self.streaks[agent] = self.streaks.get(agent, 0) + 1 if refused else 0
            if agent in self.quarantined:
                if not refused and cfg.quarantine_release == "plausible":
                    del self.quarantined[agent]
                    self.history.append({"round": round_, "agent": agent, "event": "released",
                                         "why": "its uploads were plausible again"})
                    log.warning("round %d: %s sent plausible data again; it leaves quarantine", round_, agent)
                continue
            if cfg.quarantine_after and self.streaks[agent] >= cfg.quarantine_after:
                reasons = ", ".join(sorted(entry.refused[agent]))
                why = f"refused as implausible in {self.streaks[agent]} consecutive rounds (last: {reasons})"
                self.quarantined[agent] = {"since": round_ + 1, "why": why}
                self.history.append({"round": round_, "agent": agent, "event": "quarantined", "why": why})
                until = "for the rest of the run" if cfg.quarantine_release == "never" else "until it sends plausible data"
                log.error("round %d: quarantining %s %s: %s", round_, agent, until, why)

    def take(self, round_: int) -> tuple[dict[str, Any], list[str]]:
        """(the round record's ``robustness`` section, its warnings); empty when nothing happened
        and no update was screened (``update_norms``: the norms judged, every screened round;
        ``update_directions``: the cosines judged, every screened round with three or more agents)."""
        entry = self._rounds.pop(round_, None) or _RoundEntry()
        section: dict[str, Any] = {}
        if entry.refused:
            section["refused"] = {a: {r: dict(v) for r, v in reasons.items()} for a, reasons in sorted(entry.refused.items())}
        if entry.clipped:
            section["clipped"] = {a: dict(c) for a, c in sorted(entry.clipped.items())}
        if entry.skipped_steps:
            section["skipped_steps"] = dict(sorted(entry.skipped_steps.items()))
        if entry.quarantine_excluded:
            section["quarantine_excluded"] = sorted(entry.quarantine_excluded)
        if entry.update_norms:
            section["update_norms"] = {"reference": entry.reference_norm,
                                       "agents": {a: round(v, 6) for a, v in sorted(entry.update_norms.items())}}
        if entry.update_cosines:
            # NaN (no direction) is written as null: report.json is strict JSON.
            section["update_directions"] = {
                "reference": "coordinate-wise median of the round's updates",
                "threshold": self.cfg.plausible_min_cosine,
                "agents": {a: (round(v, 6) if math.isfinite(v) else None) for a, v in sorted(entry.update_cosines.items())}}
        section.update(entry.sections)
        events = [e for e in self.history if e["round"] == round_]
        if events:
            section["quarantine_events"] = events
        if self.quarantined:
            section["quarantined"] = {a: dict(q) for a, q in sorted(self.quarantined.items())}
        if entry.aggregation and (entry.aggregation.get("rule") != "mean" or entry.aggregation.get("fallback")
                                  or self.cfg.aggregation != "mean"):
            section["aggregation"] = entry.aggregation
        warnings = list(entry.warnings)
        for agent, reasons in section.get("refused", {}).items():
            counts = ", ".join(f"{r} x{v['count']}" for r, v in reasons.items())
            warnings.append(f"refused {agent}'s upload as implausible ({counts})")
        for agent, counts in section.get("clipped", {}).items():
            clips = ", ".join(f"{w} x{n}" for w, n in counts.items())
            warnings.append(f"clipped {agent}'s {clips}")
        for agent, n in section.get("skipped_steps", {}).items():
            warnings.append(f"skipped {n} server step(s) on {agent}'s data")
        for agent in section.get("quarantine_excluded", []):
            warnings.append(f"{agent} is quarantined: its upload was not used")
        return section, warnings

    # -- checkpoints -------------------------------------------------------- #

    def state(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks), "quarantined": {a: dict(q) for a, q in self.quarantined.items()},
                "history": list(self.history)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.streaks = {str(a): int(n) for a, n in state.get("streaks", {}).items()}
        self.quarantined = {str(a): {"since": int(q["since"]), "why": str(q["why"])} for a, q in state.get("quarantined", {}).items()}
        self.history = [dict(e) for e in state.get("history", [])]
