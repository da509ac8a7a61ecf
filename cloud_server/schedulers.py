"""Round schedulers: when agents get a round, when a round closes, and what happens in
between. The coordinator picks one, once, by the method's declared ``schedule``:

- ``sync``: every participant gets RoundStart(r); the round closes
  when all have finished or at its deadline, and proceeds if a quorum finished; agents
  that missed it are recorded as missing and take part again in the next round.
- ``sequential`` (split learning): a sync round whose participants take turns, one agent
  at a time; a late joiner waits for the next round.
- ``async``: no barrier; each agent's finished round is handed to the method at once and
  the agent immediately gets its answer and its next RoundStart. Round r's record closes
  when every agent that was given round r finished it or missed its deadline.

One ``round_deadline_s`` bounds a sync or sequential round as a whole, from its start:
every turn and the wait for evaluation answers end by then, and each RoundStart tells
its agent how much of it is left. In async mode each agent's round has its own deadline
from the moment it was given.

A scheduler drives the rounds through a narrow interface, :class:`~cloud_server.rounds.RoundHost`
(open and close a round, start an agent's round, send, hand the method what arrived);
the coordinator implements it and keeps its own fields to itself.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from shared_protocol.messages import RoundEnd

from .methods import RoundOutcome
from .rounds import OpenRound, RoundHost

if TYPE_CHECKING:
    from .agents import AgentRegistry
    from .config import ServerConfig
    from .records import RoundRecord

__all__ = ["SCHEDULERS", "AsyncScheduler", "OpenRound", "RoundHost", "RoundScheduler", "SequentialScheduler", "SyncScheduler",
           "make_scheduler"]

log = logging.getLogger("cloud_server")


class RoundScheduler(ABC):
    """Runs the rounds of a run through a :class:`RoundHost`: it starts agents' rounds,
    pumps messages while it waits, and closes rounds."""

    kind: ClassVar[str]
    description: ClassVar[str]  # for messages: "sync", "asynchronous", ...
    samples_agents: ClassVar[bool] = False  # client_fraction < 1 draws each round's agents
    WAITING_LOG_EVERY_S = 60.0  # while a round is open, who the server still waits for, and why
    # A participant that says it is idle (its round is over) but whose round_end has not
    # arrived this long after is asked to announce itself again (and then redoes the round).
    NUDGE_AFTER_S = 30.0

    def __init__(self, host: RoundHost, config: ServerConfig, registry: AgentRegistry) -> None:
        self.host = host
        self.config = config
        self.registry = registry
        self.stopping = False  # no new rounds or turns are started (a stop condition was met)
        self.status = "finished"  # how the run ended, unless a stop condition says otherwise
        self._waiting_logged_at = 0.0
        self._failed_in_a_row = 0

    @abstractmethod
    def run(self, first_round: int) -> bool:
        """Run rounds ``first_round`` .. ``config.rounds`` (fewer when the run stops early);
        False when no agent was left to run a round with. ``status`` then says how it ended."""

    @abstractmethod
    def deadline_for(self, started_at: float) -> float:
        """When a round opened at ``started_at`` closes whoever is missing."""

    def time_given_s(self, rnd: OpenRound) -> float:
        """The RoundStart's ``deadline_s`` for an agent starting its part of ``rnd`` now."""
        return max(0.0, rnd.time_left_s())

    def on_round_end(self, rnd: OpenRound, agent: str, end: RoundEnd) -> None:
        """``agent`` finished its part of ``rnd`` (its round_end is in ``rnd.done``)."""

    def on_missed(self, agent: str, round_: int) -> None:
        """``agent`` missed ``round_`` (deadline, offline, dropped, failed)."""

    def round_for_late_joiner(self, agent: str) -> int | None:
        """The open round an agent that (re)joins now takes part in; None: it waits."""
        return None

    def missed(self, agent: str, why: str) -> None:
        """``agent`` misses its round (deadline, offline past the grace period, dropped, failed)."""
        state = self.registry.agents[agent]
        rnd = self.host.open_rounds.get(state.round)
        if rnd is None or agent in rnd.done:
            return
        log.warning("agent %s missed round %d: %s", agent, state.round, why)
        rnd.missing.add(agent)
        self.host.discard(agent)
        self.on_missed(agent, state.round)

    def check_absent(self) -> None:
        for agent in self.registry.absent():
            self.missed(agent, f"offline for {self.config.offline_grace_s:.0f} s")

    def should_stop(self, record: RoundRecord) -> bool:
        """After a closed round: stop the run (too many rounds in a row without quorum, or
        the target accuracy reached)?"""
        self._failed_in_a_row = 0 if record.status == "ok" else self._failed_in_a_row + 1
        if self._failed_in_a_row >= self.config.max_failed_rounds:
            self.status = "aborted"
            log.error("%d rounds in a row without quorum: aborting", self._failed_in_a_row)
            return True
        target = self.config.target_accuracy
        if target is not None and record.accuracy is not None and record.accuracy >= target:
            self.status = "stopped_target"
            log.info("target accuracy %.2f%% reached in round %d", 100 * target, record.round)
            return True
        return False

    def evaluation_waiting(self, rnd: OpenRound) -> list[str]:
        """Agents whose evaluation report ``rnd`` still awaits and that are still online."""
        return [a for a in rnd.eval_waiting() if a in self.registry.agents and self.registry.agents[a].active]

    def deliver(self, outcome: RoundOutcome) -> None:
        """Send what the method's completed round has for the agents."""
        for agent, msg in outcome.downloads:
            self.host.send(agent, msg)

    def quorum(self, rnd: OpenRound) -> int:
        return max(self.config.min_agents, math.ceil(self.config.min_fraction * len(rnd.participants)))

    # -- waiting -------------------------------------------------------------------- #

    def wait_for(self, rnd: OpenRound) -> None:
        """Pump until every participant of ``rnd`` finished or missed it, or its deadline."""
        while rnd.time_left_s() > 0:
            if not rnd.waiting_for():
                return
            self.host.pump(min(1.0, rnd.time_left_s()))
            self.check_absent()
            self.watch([rnd])
        late = rnd.waiting_for()
        if late:
            log.warning("round %d deadline passed; closing it without %s: %s", rnd.round, ", ".join(late),
                        "; ".join(f"{a}: {self.registry.why_waiting(a, rnd.resend_requests.get(a, 0))}" for a in late))

    def watch(self, rounds: list[OpenRound]) -> None:
        """While rounds are open: nudge participants whose round_end got lost, and log at least
        once a minute who the server still waits for and why."""
        now = time.monotonic()
        # Messages already received but not handled yet (the server was busy, e.g. training on
        # another agent's upload in async mode) may hold the round_end: no agent is nudged then.
        caught_up = self.host.backlog() == 0
        for rnd in rounds if caught_up else ():
            for agent in rnd.waiting_for():
                if self.registry.to_nudge(agent, self.NUDGE_AFTER_S):
                    log.warning("agent %s said it finished round %d %.0f s ago but its round_end has not arrived; "
                                "asking it to announce itself again (it then redoes the round)", agent, rnd.round,
                                now - self.registry.agents[agent].status_at)
                    self.host.discover(agent, rnd.round)
        self.registry.log_rejections()
        opened = min((r.started_at for r in rounds), default=now)
        if now - max(self._waiting_logged_at, opened) < self.WAITING_LOG_EVERY_S:
            return
        self._waiting_logged_at = now
        for rnd in rounds:
            waiting = rnd.waiting_for()
            if waiting:
                left = f", deadline in {rnd.deadline_at - now:.0f} s" if math.isfinite(rnd.deadline_at) else ""
                log.info("round %d open for %.0f s%s; waiting for %d of %d agents: %s", rnd.round, now - rnd.started_at,
                         left, len(waiting), len(rnd.participants),
                         "; ".join(f"{a} ({self.registry.why_waiting(a, rnd.resend_requests.get(a, 0))})" for a in waiting))

    def await_agents(self, round_: int) -> list[str]:
        """No agent is left to start round ``round_`` with (all offline or dropped). Per
        ``no_agents_policy``: wait up to ``registration_timeout_s`` for one to (re)join, or
        end the run. Returns the round's participants ([]: end the run)."""
        gone = ", ".join(f"{a} ({'dropped' if s.dropped else 'offline'})" for a, s in sorted(self.registry.agents.items()))
        if self.config.no_agents_policy == "end" or self.stopping:
            log.error("no agent is left to start round %d with (%s); ending the run (no_agents_policy = end)",
                      round_, gone or "none joined")
            return []
        timeout = self.config.registration_timeout_s
        log.warning("no agent is left to start round %d with (%s); waiting up to %.0f s for one to rejoin "
                    "(no_agents_policy = wait)", round_, gone or "none joined", timeout)
        self.host.discover(None, self.host.completed_round)
        deadline = time.monotonic() + timeout
        logged = time.monotonic()
        while time.monotonic() < deadline and not self.registry.active():
            self.host.pump(min(1.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() - logged >= self.WAITING_LOG_EVERY_S:
                logged = time.monotonic()
                log.warning("still no agent to start round %d with; %.0f s left", round_, deadline - logged)
        active = self.registry.active()
        if not active:
            log.error("no agent rejoined within %.0f s; ending the run before round %d", timeout, round_)
            return []
        log.info("%d agent(s) back: starting round %d", len(active), round_)
        return self.registry.sample(round_, active)


class SyncScheduler(RoundScheduler):
    kind = "sync"
    description = "sync"
    samples_agents = True

    def deadline_for(self, started_at: float) -> float:
        return started_at + self.config.round_deadline_s

    def run(self, first_round: int) -> bool:
        for round_ in range(first_round, self.config.rounds + 1):
            record = self.run_round(round_)
            if record is None:
                return False
            if self.should_stop(record):
                break
        return True

    def start(self, round_: int, participants: list[str]) -> OpenRound:
        """Give the participants their round and wait for it to end (or its deadline)."""
        for agent in participants:
            self.host.start_agent_round(agent, round_)
        rnd = self.host.open_round(round_)
        self.wait_for(rnd)
        return rnd

    def run_round(self, round_: int) -> RoundRecord | None:
        """Run one round; None when no agent is left to run it with (see ``await_agents``)."""
        host = self.host
        participants = self.registry.sample(round_, self.registry.active()) or self.await_agents(round_)
        if not participants:
            return None
        rnd = self.start(round_, participants)
        for agent in rnd.participants - set(rnd.done):
            rnd.missing.add(agent)
            host.discard(agent)
        quorum = self.quorum(rnd)
        status = "failed_quorum"
        if len(rnd.done) >= quorum:
            outcome = host.complete(rnd, dict(rnd.done))
            rnd.outcomes.append(outcome)
            if len(outcome.used_agents) >= quorum:
                self.deliver(outcome)
                if rnd.evaluate:
                    host.request_evaluation(rnd, sorted(rnd.done))
                    self.await_evaluation(rnd)
                status = "ok"
        else:
            log.warning("round %d: %d of %d agents finished, quorum is %d", round_, len(rnd.done), len(rnd.participants), quorum)
        for agent in rnd.participants:
            self.registry.agents[agent].round = 0
        return host.close_round(rnd, status)

    def await_evaluation(self, rnd: OpenRound) -> None:
        """Wait, within the round's deadline, for the evaluation reports of the agents asked."""
        while rnd.time_left_s() > 0 and self.evaluation_waiting(rnd):
            self.host.pump(min(1.0, rnd.time_left_s()))
            self.watch([rnd])

    def round_for_late_joiner(self, agent: str) -> int | None:
        # A late joiner takes part in the round that is open now, unless agents are sampled
        # (it waits for the next draw).
        open_rounds = self.host.open_rounds
        if self.config.client_fraction < 1.0 or not open_rounds or self.stopping:
            return None
        current = open_rounds[max(open_rounds)]
        return None if agent in current.participants else current.round


class SequentialScheduler(SyncScheduler):
    """Agents take turns within a sync round: the next agent's round starts when the
    previous agent finished or missed it. The turns share the round's one deadline."""

    kind = "sequential"
    description = "sequential (agents take turns)"
    samples_agents = False

    def start(self, round_: int, participants: list[str]) -> OpenRound:
        rnd = self.host.open_round(round_)
        for agent in participants:
            state = self.registry.agents[agent]
            if self.stopping or not state.active:
                continue  # went away while waiting for its turn
            if rnd.time_left_s() <= 0:
                # Its turn never came: it takes part (and is counted) as missing.
                log.warning("round %d deadline passed before agent %s's turn", round_, agent)
                rnd.participants.add(agent)
                continue
            self.host.start_agent_round(agent, round_)
            self.wait_for(rnd)
        return rnd

    def round_for_late_joiner(self, agent: str) -> int | None:
        return None  # a second agent mid-turn would interleave: it waits for the next round


class AsyncScheduler(RoundScheduler):
    kind = "async"
    description = "asynchronous"

    def deadline_for(self, started_at: float) -> float:
        return math.inf  # each agent's round has its own deadline, from when it was given

    def time_given_s(self, rnd: OpenRound) -> float:
        return self.config.round_deadline_s

    def run(self, first_round: int) -> bool:
        next_round = first_round
        while next_round <= self.config.rounds and not self.stopping:
            agents = self.registry.active() or self.await_agents(next_round)
            if not agents:
                return False
            for agent in agents:
                self.host.start_agent_round(agent, next_round)
            self._run_open_rounds()
            next_round = self.host.completed_round + 1  # every agent went away: start again from the next round
        return True

    def _run_open_rounds(self) -> None:
        host = self.host
        open_rounds = host.open_rounds
        while open_rounds:
            host.pump(0.5)
            self.check_absent()
            self.watch(list(open_rounds.values()))
            for agent in self.registry.overdue(self.config.round_deadline_s):
                self.missed(agent, "deadline passed")
            # Join: an online agent with nothing to do gets the lowest open round.
            for agent in self.registry.active():
                if self.registry.agents[agent].round == 0 and open_rounds and not self.stopping:
                    lowest = min(open_rounds)
                    if agent not in open_rounds[lowest].participants:
                        host.start_agent_round(agent, lowest)
            while open_rounds:
                lowest_round = open_rounds[min(open_rounds)]
                if lowest_round.waiting_for() or self.evaluation_waiting(lowest_round):
                    break
                used = {a for o in lowest_round.outcomes for a in o.used_agents}
                record = host.close_round(lowest_round, "ok" if len(used) >= self.quorum(lowest_round) else "failed_quorum")
                if self.should_stop(record):
                    self.stopping = True
                    for rnd in list(open_rounds.values()):
                        rnd.missing |= rnd.participants - set(rnd.done)

    def on_round_end(self, rnd: OpenRound, agent: str, end: RoundEnd) -> None:
        outcome = self.host.complete(rnd, {agent: end})
        self.deliver(outcome)
        rnd.outcomes.append(outcome)
        if rnd.evaluate:
            # Handled by the agent before its next RoundStart (same topic, in order).
            self.host.request_evaluation(rnd, [agent], wait_s=self.config.round_deadline_s)
        self._advance(agent, end.round)

    def on_missed(self, agent: str, round_: int) -> None:
        self._advance(agent, round_)

    def _advance(self, agent: str, finished_round: int) -> None:
        state = self.registry.agents[agent]
        state.round = 0
        if finished_round + 1 <= self.config.rounds and not self.stopping and state.active:
            self.host.start_agent_round(agent, finished_round + 1)


SCHEDULERS: dict[str, type[RoundScheduler]] = {s.kind: s for s in (SyncScheduler, SequentialScheduler, AsyncScheduler)}


def make_scheduler(kind: str, host: RoundHost, config: ServerConfig, registry: AgentRegistry) -> RoundScheduler:
    try:
        return SCHEDULERS[kind](host, config, registry)
    except KeyError:
        raise ValueError(f"unknown round schedule {kind!r}; a method declares one of {sorted(SCHEDULERS)}") from None
