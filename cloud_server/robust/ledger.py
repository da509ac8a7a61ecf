"""The :class:`RobustnessLedger`: per round and agent, what was refused and why (the first
figure and threshold, logged once per agent, round and reason), what was clipped, which
server steps were skipped, which rule ran; and quarantine, decided on evidence.

Each check notes the agents whose uploads it could judge in a round (:meth:`examined`, under
the reason it refuses with; a refusal is a judgement too): a check may have no yardstick (the
direction and validation checks need three agents, FedGKT's label check two others and a
trained model), and a round it could not judge an agent in says nothing of that agent. An
agent refused in ``quarantine_after`` consecutive rounds *judged by the checks that refused it*
is quarantined: its uploads are still judged, never used. ``quarantine_release = "plausible"``
releases it after ``quarantine_release_after`` consecutive rounds in which every check that
refused it judged its uploads and none was refused (used again from the round after); a round
those checks could not judge it in neither counts nor breaks the count, for the streak either.
``"never"``: for the run. Its state is kept in the checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import RobustnessConfig

# The name the robustness log lines have always had (the single module cloud_server.robust was before its split).
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
    examined: dict[str, set[str]] = field(default_factory=dict)  # agent -> the checks (refusal reasons) that judged it
    sections: dict[str, Any] = field(default_factory=dict)  # more checks' figures (record), key -> section, verbatim


class RobustnessLedger:
    """Per round: refusals, clips, skipped steps and the aggregation rule that ran; and
    the quarantine. Methods and the coordinator write it; the coordinator takes a round's
    entry (:meth:`take`) when the round closes."""

    def __init__(self, cfg: RobustnessConfig | None = None) -> None:
        self.cfg = cfg or RobustnessConfig()
        self._rounds: dict[int, _RoundEntry] = {}
        self.streaks: dict[str, int] = {}  # agent -> consecutive judged rounds with a refusal
        self.streak_reasons: dict[str, set[str]] = {}  # agent -> the reasons it was refused for in its streak
        self.quarantined: dict[str, dict[str, Any]] = {}  # agent -> {"since": round, "why": str}
        self.history: list[dict[str, Any]] = []  # quarantine events: {"round", "agent", "event", "why"}

    def _entry(self, round_: int) -> _RoundEntry:
        return self._rounds.setdefault(round_, _RoundEntry())

    def refuse(self, round_: int, agent: str, reason: str, detail: str) -> None:
        entry = self._entry(round_)
        entry.examined.setdefault(agent, set()).add(reason)
        by_reason = entry.refused.setdefault(agent, {})
        if reason not in by_reason:
            by_reason[reason] = {"count": 0, "detail": detail}
            log.warning("round %d: refused %s's upload as implausible (%s): %s", round_, agent, reason, detail)
        by_reason[reason]["count"] += 1

    def examined(self, round_: int, reason: str, agents: Iterable[str]) -> None:
        """``agents``' uploads of ``round_`` were judged by the check that refuses with
        ``reason`` (refused or not): the evidence quarantine is decided on (the module doc). A
        check notes only the agents it had a yardstick for."""
        entry = self._entry(round_)
        for agent in agents:
            entry.examined.setdefault(agent, set()).add(reason)

    def norms(self, round_: int, norms: Mapping[str, float], reference_norm: float) -> None:
        """The update norms the plausibility check judged (recorded whether refused or not:
        what a user needs to set the thresholds for their fleet)."""
        entry = self._entry(round_)
        entry.update_norms.update({a: float(v) for a, v in norms.items()})
        entry.reference_norm = float(reference_norm)

    def directions(self, round_: int, cosines: Mapping[str, float]) -> None:
        """The cosines the direction check judged (recorded whether refused or not, and when
        the check is off: what a user needs to set ``plausible_min_cosine`` for their fleet;
        bench/experiments/direction_cosines.toml reads them)."""
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

    def close_round(self, round_: int, finished: Sequence[str]) -> None:
        """Update the quarantine after ``round_``: ``finished`` are the agents that finished it
        (an agent that did not keeps its state). An agent's round counts when it was refused, or
        when the checks its streak (or quarantine) is for all judged it (:meth:`examined`)."""
        cfg = self.cfg
        entry = self._rounds.get(round_) or _RoundEntry()
        for agent in finished:
            refused = set(entry.refused.get(agent, {}))
            seen = entry.examined.get(agent, set())
            if agent in self.quarantined:
                self._judge_quarantined(round_, agent, refused, seen)
                continue
            if refused:
                self.streaks[agent] = self.streaks.get(agent, 0) + 1
                self.streak_reasons[agent] = self.streak_reasons.get(agent, set()) | refused
            elif self.streak_reasons.get(agent, set()) <= seen:  # judged, plausible: the streak ends
                self.streaks[agent] = 0
                self.streak_reasons.pop(agent, None)
            else:
                missing = ", ".join(sorted(self.streak_reasons[agent] - seen))
                log.info("round %d: %s's uploads were not judged by %s: its streak of %d refused round(s) stands",
                         round_, agent, missing, self.streaks.get(agent, 0))
                continue
            if cfg.quarantine_after and self.streaks[agent] >= cfg.quarantine_after:
                reasons = ", ".join(sorted(entry.refused[agent]))
                why = f"refused as implausible in {self.streaks[agent]} consecutive rounds (last: {reasons})"
                self.quarantined[agent] = {"since": round_ + 1, "why": why,
                                           "checks": sorted(self.streak_reasons[agent]), "clean_rounds": 0}
                self.history.append({"round": round_, "agent": agent, "event": "quarantined", "why": why})
                until = ("for the rest of the run" if cfg.quarantine_release == "never" else
                         f"until its uploads pass {', '.join(sorted(self.streak_reasons[agent]))} in "
                         f"{cfg.quarantine_release_after} consecutive judged round(s)")
                log.error("round %d: quarantining %s %s: %s", round_, agent, until, why)

    def _judge_quarantined(self, round_: int, agent: str, refused: set[str], seen: set[str]) -> None:
        """A quarantined agent's round: refused, its count of clean rounds starts again (and the
        new reason must be passed too); judged clean by every check it must pass, one more clean
        round (released at ``quarantine_release_after``); not judged by them, no evidence."""
        q = self.quarantined[agent]
        if self.cfg.quarantine_release != "plausible":
            return
        if refused:
            q["clean_rounds"] = 0
            q["checks"] = sorted(set(q["checks"]) | refused)
            return
        missing = set(q["checks"]) - seen
        if missing:
            log.info("round %d: %s stays quarantined: its uploads were not judged by %s this round",
                     round_, agent, ", ".join(sorted(missing)))
            return
        q["clean_rounds"] += 1
        if q["clean_rounds"] < self.cfg.quarantine_release_after:
            return
        del self.quarantined[agent]
        self.streaks[agent] = 0
        self.streak_reasons.pop(agent, None)
        why = f"its uploads passed {', '.join(q['checks']) or 'the checks'} in {q['clean_rounds']} consecutive judged round(s)"
        self.history.append({"round": round_, "agent": agent, "event": "released", "why": why})
        log.warning("round %d: %s leaves quarantine: %s", round_, agent, why)

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
        return {"streaks": dict(self.streaks), "streak_reasons": {a: sorted(r) for a, r in self.streak_reasons.items()},
                "quarantined": {a: dict(q) for a, q in self.quarantined.items()}, "history": list(self.history)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.streaks = {str(a): int(n) for a, n in state.get("streaks", {}).items()}
        self.streak_reasons = {str(a): {str(r) for r in rs} for a, rs in state.get("streak_reasons", {}).items()}
        # A checkpoint from before the evidence rule has no "checks": any plausible round releases, as it did then.
        self.quarantined = {str(a): {"since": int(q["since"]), "why": str(q["why"]), "checks": [str(c) for c in q.get("checks", [])],
                                     "clean_rounds": int(q.get("clean_rounds", 0))}
                            for a, q in state.get("quarantined", {}).items()}
        self.history = [dict(e) for e in state.get("history", [])]
