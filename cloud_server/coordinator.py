"""The coordinator: owns the round loop, the agent registry, deadlines, quorum,
failures, checkpoints and the run report. Methods only configure rounds and
consume uploads (see :mod:`cloud_server.methods.base`).

Sync mode (FedGKT Algorithm 1): every participant gets RoundStart(r); the round
closes when all have finished or at the deadline, and proceeds if a quorum
finished; agents that missed it are recorded as missing and take part again
in the next round. Async mode: no barrier; each agent's finished round is
handed to the method at once and the agent immediately gets its answer and
its next RoundStart. Round r's record closes when every agent that was given
round r finished it or missed its deadline.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_protocol.chunking import SenderLimits
from shared_protocol.errors import ProtocolError, StaleMessageError, UnknownSenderError
from shared_protocol.frame import FrameLimits
from shared_protocol.hostinfo import cpu_model as _cpu_model
from shared_protocol.messages import (
    Discover,
    ErrorReply,
    Hello,
    Message,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    decode_message,
    encode_message,
)
from shared_protocol.methods import load_method_messages
from shared_protocol.topics import Topics
from shared_protocol.transport import Transport

from .config import ServerConfig
from .methods import RoundOutcome, ServerMethod
from .recorder import RunCounters, RunRecorder, server_info
from .records import AgentInfo, RoundRecord, RunReport

log = logging.getLogger("cloud_server")

SERVER_ID = "server"
VERSION = "0.1.0"


class RunAborted(RuntimeError):
    """The run cannot go on (too few agents, too many failed rounds)."""


@dataclass
class AgentState:
    agent_id: str
    hello: Hello
    online: bool = True
    rejections: int = 0
    dropped: bool = False
    round: int = 0  # round currently assigned (0: none)
    assigned_at: float = 0.0
    offline_since: float | None = None
    instance: str = ""
    status: str = ""  # its last status message ("training", "idle", ...)
    status_at: float = 0.0
    last_heard_at: float = 0.0  # any accepted message from it
    nudged_at: float = 0.0  # last time the server asked it to announce itself again


@dataclass
class OpenRound:
    round: int
    evaluate: bool
    started_at: float
    participants: set[str] = field(default_factory=set)
    done: dict[str, RoundEnd] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    outcomes: list[RoundOutcome] = field(default_factory=list)


class Coordinator:
    MAX_COMPLETION_REQUESTS = 3  # per agent and round, then what arrived is judged as it is
    WAITING_LOG_EVERY_S = 60.0  # while a round is open, who the server still waits for, and why
    # A participant that says it is idle (its round is over) but whose round_end has not
    # arrived this long after is asked to announce itself again (and then redoes the round).
    NUDGE_AFTER_S = 30.0
    STATUS_LIMITS = SenderLimits(64 * 1024, 256 * 1024, 4)  # status frames are a few hundred bytes

    def __init__(self, config: ServerConfig, method: ServerMethod, transport: Transport) -> None:
        self.config = config
        self.method = method
        self.transport = transport
        self.topics = Topics(config.run_id)
        self.out_dir = Path(config.out_dir)
        self.agents: dict[str, AgentState] = {}
        self.rejected: Counter[str] = Counter()
        self.limits = FrameLimits(max_body_bytes=256 * 1024 * 1024)
        self.completed_round = 0
        self.open_rounds: dict[int, OpenRound] = {}
        self._failed_in_a_row = 0
        self._completion_requests: dict[tuple[str, int], int] = {}
        self.recorder = RunRecorder(self.out_dir, config.rounds, RunCounters(
            agents=self._agent_report, rejected=lambda: self.rejected, rejected_chunks=self.transport.rejections,
            server_connection=self.transport.stats.snapshot,
        ))
        self._rejections_unlogged: dict[str, Counter[str]] = {}  # per sender, since the last summary
        self._rejections_logged_at = time.monotonic()
        self._waiting_logged_at = 0.0
        if config.client_fraction < 1.0 and (method.asynchronous or method.sequential):
            kind = "asynchronous" if method.asynchronous else "sequential (agents take turns)"
            raise ValueError(f"client_fraction < 1 samples the agents of sync rounds; {method.name} runs {kind} rounds")
        load_method_messages(method.name)

    # -- report and checkpoints (kept by the recorder) ----------------------------- #

    @property
    def report(self) -> RunReport:
        return self.recorder.report

    def _new_report(self) -> RunReport:
        return RunReport(
            edgesplit_version=VERSION, run_id=self.config.run_id, method=self.method.name,
            config={**self.config.to_dict(), "method_config": self.method.resolved_config()},
            server=server_info(self.method.ctx.device, _cpu_model()), models=self.method.model_info(),
        )

    def _agent_report(self) -> dict[str, AgentInfo]:
        return {a.agent_id: AgentInfo.from_hello(a.hello) for a in sorted(self.agents.values(), key=lambda a: a.agent_id)}

    def _update_totals(self) -> None:
        self.recorder.refresh()

    def write_report(self) -> None:
        self.recorder.write()

    @property
    def checkpoint_dir(self) -> Path:
        return self.recorder.checkpoint_dir

    def save_checkpoint(self) -> None:
        self.recorder.save_checkpoint(self.method.state(), round_=self.completed_round, config=self.config.to_dict(),
                                      method_config=self.method.resolved_config(), rejected=self.rejected)

    def load_checkpoint(self) -> None:
        saved = self.recorder.load_checkpoint()
        if saved.method_config != self.method.resolved_config():
            log.warning("resuming with a different method config than the checkpoint's")
        self.method.load_state(saved.method_state)
        self.completed_round, self.rejected = saved.round, Counter(saved.rejected)
        log.info("resumed from checkpoint after round %d", self.completed_round)

    # -- messaging -------------------------------------------------------------- #

    def _send(self, agent: str | None, msg: Message) -> None:
        topic = self.topics.down(agent) if agent else self.topics.down_all
        before = self.transport.stats.snapshot()
        codecs = self.method.download_codecs(msg) or None
        # An agent may ask for missing chunks only on its own up topic (the ACL allows no other).
        self.transport.publish(topic, encode_message(msg, codecs=codecs), reply_topic=self.topics.up(agent) if agent else None)
        after = self.transport.stats.snapshot()
        self._account(msg.round, "down", after["payload_bytes_out"] - before["payload_bytes_out"], after["wire_bytes_out"] - before["wire_bytes_out"])

    def _account(self, round_: int, direction: str, payload: int, wire: int) -> None:
        """Attribute a message's bytes to its round if it is open (registration, status and
        stale rounds count outside rounds)."""
        self.recorder.account(round_ if round_ in self.open_rounds else None, direction, payload, wire)

    def _base(self, round_: int) -> dict[str, Any]:
        return {"run": self.config.run_id, "round": round_, "sender": SERVER_ID}

    def _reject(self, agent: str | None, reason: str, detail: str, names_sender: bool = True) -> None:
        """Count a rejected message by reason. ``names_sender`` is False for a blob that did not
        decode: it names no sender, and on a broker without ACLs anyone may publish on an agent's
        topic, so it does not count toward dropping the agent (a message that decoded does)."""
        self.rejected[reason] += 1
        sender = agent or "?"
        if sender not in self._rejections_unlogged and len(self._rejections_unlogged) >= 256:
            sender = "other senders"  # a flood from ever new topic names is summarised, not logged per name
        unlogged = self._rejections_unlogged.get(sender)
        if unlogged is None:
            self._rejections_unlogged[sender] = Counter()
            log.warning("rejected message from %s (%s): %s; further rejections from %s are summarised once a minute",
                        sender, reason, detail, sender)
        else:
            unlogged[reason] += 1
        if time.monotonic() - self._rejections_logged_at >= self.WAITING_LOG_EVERY_S:
            self._log_rejections()
        state = self.agents.get(agent or "")
        if state is not None and names_sender:
            state.rejections += 1
            if state.rejections >= self.config.max_rejections_per_agent and not state.dropped:
                state.dropped = True
                log.error("dropping agent %s after %d rejected messages; what it sends from now on is ignored",
                          agent, state.rejections)
                self.transport.block_sender(self.topics.up(agent or ""), "dropped by the server")
                self._agent_gone(agent or "")

    def _log_rejections(self) -> None:
        for sender, counts in self._rejections_unlogged.items():
            if counts:
                log.warning("rejected %d more messages from %s in the last %.0f s (%s)", sum(counts.values()), sender,
                            time.monotonic() - self._rejections_logged_at,
                            ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
                counts.clear()
        self._rejections_logged_at = time.monotonic()

    def pump(self, timeout_s: float) -> None:
        """Receive and handle at most one inbound message."""
        delivery = self.transport.receive(timeout_s=max(0.0, timeout_s))
        if delivery is None:
            return
        topic_agent = self.topics.agent_of(delivery.topic)
        try:
            msg = decode_message(delivery.payload, self.limits)
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes)
            self._reject(topic_agent, exc.code, str(exc), names_sender=False)
            return
        try:
            if msg.run != self.config.run_id:
                raise StaleMessageError(f"message for run {msg.run!r}")
            if topic_agent is None or msg.sender != topic_agent:
                raise UnknownSenderError(f"sender {msg.sender!r} published on {delivery.topic}")
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes)
            self._reject(topic_agent, exc.code, str(exc))
            return
        self._account(msg.round, "up", len(delivery.payload), delivery.wire_bytes)
        agent = topic_agent
        state = self.agents.get(agent)
        if state is not None and state.dropped:
            self.rejected["dropped_agent"] += 1
            return
        if state is not None:
            state.last_heard_at = time.monotonic()
        if isinstance(msg, Status):
            if state is not None:
                state.status, state.status_at = msg.state, time.monotonic()
                was_online, state.online = state.online, msg.state != "offline"
                if was_online and not state.online:
                    log.warning("agent %s went offline", agent)
                    state.offline_since = time.monotonic()
                elif state.online:
                    state.offline_since = None
            return
        if isinstance(msg, Hello):
            self._on_hello(agent, msg)
            return
        if state is None:
            self._reject(agent, UnknownSenderError.code, f"{msg.TYPE} from an agent that never said hello")
            return
        if isinstance(msg, ErrorReply):
            log.warning("agent %s reports %s: %s", agent, msg.code, msg.reason)
            if msg.code == "round_failed" and msg.round == state.round:
                self._agent_missed(agent, f"agent error: {msg.reason}")
            return
        if msg.round != state.round or state.round == 0:
            self._reject(agent, StaleMessageError.code, f"{msg.TYPE} for round {msg.round}, agent is in round {state.round}")
            return
        if isinstance(msg, RoundEnd):
            self._on_round_end(agent, msg)
        elif isinstance(msg, self.method.upload_types):
            try:
                replies = self.method.on_upload(agent, msg)
            except ProtocolError as exc:
                self._reject(agent, exc.code, str(exc))
                return
            for target, reply in replies or ():
                self._send(target, reply)
        else:
            self._reject(agent, "unexpected_message", f"{msg.TYPE} is not expected from agents")

    def _on_hello(self, agent: str, hello: Hello) -> None:
        if self.config.allow_list and agent not in self.config.allow_list:
            self.rejected[UnknownSenderError.code] += 1
            log.warning("refusing agent %s: not in the allow-list", agent)
            self._send(agent, Welcome(**self._base(0), accepted=False, reason="agent id not in the server's allow-list"))
            return
        if self.method.name not in hello.methods:
            self._send(agent, Welcome(**self._base(0), accepted=False, reason=f"agent does not implement {self.method.name}"))
            return
        state = self.agents.get(agent)
        if state is None:
            state = self.agents[agent] = AgentState(agent, hello, last_heard_at=time.monotonic())
            log.info("agent %s joined: %s, %d cores, %d samples", agent, hello.cpu_model, hello.cores, hello.num_samples)
        else:
            state.hello, state.online, state.offline_since = hello, True, None
            if state.dropped:
                return
        self._expect_from(agent)
        self._send(agent, Welcome(**self._base(0), accepted=True, method=self.method.name, settings=self.method.welcome_settings()))
        # A participant that (re)joins while its round is open restarts it: it may have
        # been restarted and lost the RoundStart.
        if state.round and state.round in self.open_rounds and agent not in self.open_rounds[state.round].done:
            self.method.discard(agent)
            self._start_agent_round(agent, state.round)
        elif (not self.method.asynchronous and not self.method.sequential and self.config.client_fraction == 1.0
              and self.open_rounds and not self._stopping):
            # Sync: a late joiner takes part in the round that is open now (when agents take
            # turns it waits for the next round: a second agent mid-turn would interleave;
            # when agents are sampled, it waits for the next draw).
            current = self.open_rounds[max(self.open_rounds)]
            if agent not in current.participants:
                log.info("agent %s joins round %d in progress", agent, current.round)
                self._start_agent_round(agent, current.round)

    def _expect_from(self, agent: str) -> None:
        """Tell the transport what this agent may send: its largest upload, as the method
        knows it now, bounds what a transfer on its topic may declare."""
        largest = self.method.max_upload_bytes(agent, self.agents[agent].hello)
        if largest is None:  # the method cannot say: the largest frame the server decodes
            largest = self.limits.max_body_bytes + self.limits.max_header_bytes + 64
            limits = SenderLimits(largest, largest, 16)
        else:
            largest = max(largest, 1024 * 1024)  # round_end, errors and requests are small
            # An agent streams its uploads one after another: two transfers open at once, plus resends.
            limits = SenderLimits(largest, 2 * largest + 1024 * 1024, 8)
        self.transport.expect_sender(self.topics.up(agent), limits)
        self.transport.expect_sender(self.topics.status(agent), self.STATUS_LIMITS)

    # -- round mechanics --------------------------------------------------------- #

    def _evaluate(self, round_: int) -> bool:
        return round_ % self.config.eval_every == 0 or round_ == self.config.rounds

    def _open(self, round_: int) -> OpenRound:
        if round_ not in self.open_rounds:
            self.open_rounds[round_] = OpenRound(round_, self._evaluate(round_), time.monotonic())
        return self.open_rounds[round_]

    def _start_agent_round(self, agent: str, round_: int) -> None:
        rnd = self._open(round_)
        rnd.participants.add(agent)
        rnd.missing.discard(agent)
        state = self.agents[agent]
        state.round, state.assigned_at = round_, time.monotonic()
        self._expect_from(agent)  # the method may know the agent's uploads better by now
        config, weights = self.method.round_config(round_, agent, rnd.evaluate)
        self._send(
            agent,
            RoundStart(
                **self._base(round_), method=self.method.name, config=config, deadline_s=self.config.round_deadline_s,
                evaluate=rnd.evaluate, participants=sorted(rnd.participants), weights=weights,
            ),
        )

    def _active_agents(self) -> list[str]:
        return sorted(a for a, s in self.agents.items() if s.online and not s.dropped)

    def _sample_agents(self, round_: int, agents: list[str]) -> list[str]:
        """Client sampling: ``max(min_agents, ceil(C * K))`` of the ``K`` online agents,
        drawn without replacement by a generator seeded with (run seed, round), so a
        resumed run draws the same agents for the same round."""
        fraction = self.config.client_fraction
        if fraction >= 1.0 or not agents:
            return agents
        count = min(len(agents), max(self.config.min_agents, math.ceil(fraction * len(agents))))
        rng = random.Random(f"{self.config.seed}/{round_}")
        return sorted(rng.sample(agents, count))

    def _on_round_end(self, agent: str, end: RoundEnd) -> None:
        rnd = self.open_rounds.get(end.round)
        if rnd is None or agent in rnd.done:
            self._reject(agent, StaleMessageError.code, f"round_end for closed round {end.round}")
            return
        key = (agent, end.round)
        if self._completion_requests.get(key, 0) < self.MAX_COMPLETION_REQUESTS:
            requests = self.method.check_round_end(agent, end)
            if requests:
                self._completion_requests[key] = self._completion_requests.get(key, 0) + 1
                log.warning("agent %s's round %d upload is incomplete; asking it to resend (%d messages)", agent, end.round, len(requests))
                for target, msg in requests:
                    self._send(target, msg)
                return  # it sends round_end again when done
        rnd.done[agent] = end
        self.agents[agent].instance = end.instance
        if self.method.asynchronous:
            outcome = self.method.complete(end.round, {agent: end}, rnd.evaluate)
            self._deliver(outcome)
            rnd.outcomes.append(outcome)
            self._advance(agent, end.round)

    def _agent_missed(self, agent: str, why: str) -> None:
        state = self.agents[agent]
        rnd = self.open_rounds.get(state.round)
        if rnd is None or agent in rnd.done:
            return
        log.warning("agent %s missed round %d: %s", agent, state.round, why)
        rnd.missing.add(agent)
        self.method.discard(agent)
        if self.method.asynchronous:
            self._advance(agent, state.round)

    def _agent_gone(self, agent: str) -> None:
        """Dropped: stop waiting for it."""
        if self.agents[agent].round in self.open_rounds:
            self._agent_missed(agent, "dropped")

    def _check_absent(self) -> None:
        """Participants offline for longer than the grace period miss their round (a quick
        restart, e.g. by systemd, rejoins and redoes it instead)."""
        now = time.monotonic()
        for agent, state in self.agents.items():
            if state.round and state.offline_since is not None and now - state.offline_since >= self.config.offline_grace_s:
                self._agent_missed(agent, f"offline for {self.config.offline_grace_s:.0f} s")

    def _advance(self, agent: str, finished_round: int) -> None:
        state = self.agents[agent]
        nxt = finished_round + 1
        state.round = 0
        if nxt <= self.config.rounds and not self._stopping and state.online and not state.dropped:
            self._start_agent_round(agent, nxt)

    def _deliver(self, outcome: RoundOutcome) -> None:
        for agent, msg in outcome.downloads:
            self._send(agent, msg)

    # -- closing rounds -------------------------------------------------------------- #

    def _close(self, rnd: OpenRound, status: str) -> RoundRecord:
        del self.open_rounds[rnd.round]
        record = self.recorder.round_record(
            rnd.round, status, participants=rnd.participants, ends=rnd.done, outcomes=rnd.outcomes,
            started_at=rnd.started_at, server=self.method.ctx.device_meter.take(),
            method_figures=self.method.round_report(rnd.round),
        )
        self.completed_round = rnd.round
        self.recorder.add_round(record, checkpoint=self.save_checkpoint)
        return record

    def _wait_for_agents_of(self, rnd: OpenRound, deadline: float) -> None:
        """Pump until every participant of ``rnd`` finished or missed it, or ``deadline``."""
        while time.monotonic() < deadline:
            waiting = [a for a in rnd.participants if a not in rnd.done and a not in rnd.missing]
            if not waiting:
                break
            self.pump(min(1.0, deadline - time.monotonic()))
            self._check_absent()
            self._watch([rnd], deadline)
        else:
            late = sorted(a for a in rnd.participants if a not in rnd.done and a not in rnd.missing)
            if late:
                log.warning("round %d deadline passed; closing it without %s: %s", rnd.round, ", ".join(late),
                            "; ".join(f"{a}: {self._why_waiting(a, rnd)}" for a in late))

    # -- no silent waits ------------------------------------------------------------ #

    def _waiting_for(self, rnd: OpenRound) -> list[str]:
        return sorted(a for a in rnd.participants if a not in rnd.done and a not in rnd.missing)

    def _why_waiting(self, agent: str, rnd: OpenRound) -> str:
        """What the server knows about a participant it still waits for."""
        now = time.monotonic()
        state = self.agents[agent]
        if state.dropped:
            return "dropped"
        parts = []
        if not state.online:
            since = now - (state.offline_since or now)
            parts.append(f"offline for {since:.0f} s (misses the round after {self.config.offline_grace_s:.0f} s)")
        elif state.status and state.status_at >= state.assigned_at:
            parts.append(f"said '{state.status}' {now - state.status_at:.0f} s ago")
        else:
            parts.append("no status since its round started")
        parts.append(f"last message {now - state.last_heard_at:.0f} s ago")
        transfers, held = self.transport.inbound_progress(self.topics.up(agent))
        if transfers:
            parts.append(f"{transfers} upload(s) arriving, {held / 1e6:.1f} MB so far")
        asked = self._completion_requests.get((agent, rnd.round), 0)
        if asked:
            parts.append(f"asked {asked} time(s) to resend uploads that never arrived")
        if state.nudged_at > state.assigned_at:
            parts.append(f"asked {now - state.nudged_at:.0f} s ago to announce itself again (its round_end never came)")
        return ", ".join(parts)

    def _watch(self, rounds: list[OpenRound], deadline: float | None) -> None:
        """While rounds are open: nudge participants whose round_end got lost, and log at least
        once a minute who the server still waits for and why."""
        now = time.monotonic()
        for rnd in rounds:
            for agent in self._waiting_for(rnd):
                state = self.agents[agent]
                finished = state.online and state.status == "idle" and state.status_at > state.assigned_at
                quiet = min(now - state.status_at, now - state.last_heard_at, now - state.nudged_at)
                if finished and quiet >= self.NUDGE_AFTER_S and not self.transport.inbound_progress(self.topics.up(agent))[0]:
                    # It finished, yet its round_end never came (refused on the way, e.g. while a budget
                    # was full, or lost): ask it to announce itself; its hello restarts its round.
                    state.nudged_at = now
                    log.warning("agent %s said it finished round %d %.0f s ago but its round_end has not arrived; "
                                "asking it to announce itself again (it then redoes the round)", agent, rnd.round,
                                now - state.status_at)
                    self._send(agent, Discover(**self._base(rnd.round)))
        if time.monotonic() - self._rejections_logged_at >= self.WAITING_LOG_EVERY_S:
            self._log_rejections()
        opened = min((r.started_at for r in rounds), default=now)
        if now - max(self._waiting_logged_at, opened) < self.WAITING_LOG_EVERY_S:
            return
        self._waiting_logged_at = now
        for rnd in rounds:
            waiting = self._waiting_for(rnd)
            if waiting:
                left = f", deadline in {deadline - now:.0f} s" if deadline is not None else ""
                log.info("round %d open for %.0f s%s; waiting for %d of %d agents: %s", rnd.round, now - rnd.started_at,
                         left, len(waiting), len(rnd.participants),
                         "; ".join(f"{a} ({self._why_waiting(a, rnd)})" for a in waiting))

    def _await_agents(self, round_: int) -> list[str]:
        """No agent is left to start round ``round_`` with (all offline or dropped). Per
        ``no_agents_policy``: wait up to ``registration_timeout_s`` for one to (re)join, or
        end the run. Returns the round's participants ([]: end the run)."""
        gone = ", ".join(f"{a} ({'dropped' if s.dropped else 'offline'})" for a, s in sorted(self.agents.items()))
        if self.config.no_agents_policy == "end" or self._stopping:
            log.error("no agent is left to start round %d with (%s); ending the run (no_agents_policy = end)",
                      round_, gone or "none joined")
            return []
        timeout = self.config.registration_timeout_s
        log.warning("no agent is left to start round %d with (%s); waiting up to %.0f s for one to rejoin "
                    "(no_agents_policy = wait)", round_, gone or "none joined", timeout)
        self._send(None, Discover(**self._base(self.completed_round)))
        deadline = time.monotonic() + timeout
        logged = time.monotonic()
        while time.monotonic() < deadline and not self._active_agents():
            self.pump(min(1.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() - logged >= self.WAITING_LOG_EVERY_S:
                logged = time.monotonic()
                log.warning("still no agent to start round %d with; %.0f s left", round_, deadline - logged)
        active = self._active_agents()
        if not active:
            log.error("no agent rejoined within %.0f s; ending the run before round %d", timeout, round_)
            return []
        log.info("%d agent(s) back: starting round %d", len(active), round_)
        return self._sample_agents(round_, active)

    def _take_turns(self, round_: int, agents: list[str]) -> OpenRound:
        """Sequential sync round (split learning): one agent at a time, each with its
        own deadline; an agent that went away while waiting for its turn is skipped."""
        rnd = self._open(round_)
        for agent in agents:
            state = self.agents[agent]
            if self._stopping or not state.online or state.dropped:
                continue
            self._start_agent_round(agent, round_)
            self._wait_for_agents_of(rnd, time.monotonic() + self.config.round_deadline_s)
        return rnd

    def _await_evaluation(self, rnd: OpenRound, outcome: RoundOutcome) -> None:
        """Wait (at most one round deadline) for the agents' answers to the evaluation
        requests the method sent with its downloads; see ``ServerMethod.evaluation_pending``."""
        deadline = time.monotonic() + self.config.round_deadline_s
        while time.monotonic() < deadline:
            waiting = [
                a for a in self.method.evaluation_pending(rnd.round)
                if a in self.agents and self.agents[a].online and not self.agents[a].dropped
            ]
            if not waiting:
                break
            self.pump(min(1.0, deadline - time.monotonic()))
            self._watch([rnd], deadline)
        result = self.method.evaluation_result(rnd.round)
        if result is not None:
            outcome.correct, outcome.total = result

    def _sync_round(self, round_: int) -> RoundRecord | None:
        """Run one sync round; None when no agent is left to run it with (see ``_await_agents``)."""
        participants = self._sample_agents(round_, self._active_agents()) or self._await_agents(round_)
        if not participants:
            return None
        if self.method.sequential:
            rnd = self._take_turns(round_, participants)
        else:
            for agent in participants:
                self._start_agent_round(agent, round_)
            rnd = self._open(round_)
            self._wait_for_agents_of(rnd, time.monotonic() + self.config.round_deadline_s)
        for agent in rnd.participants - set(rnd.done):
            rnd.missing.add(agent)
            self.method.discard(agent)
        quorum = max(self.config.min_agents, math.ceil(self.config.min_fraction * len(rnd.participants)))
        if len(rnd.done) >= quorum:
            outcome = self.method.complete(round_, dict(rnd.done), rnd.evaluate)
            rnd.outcomes.append(outcome)
            if len(outcome.used_agents) >= quorum:
                self._deliver(outcome)
                self._await_evaluation(rnd, outcome)
                status = "ok"
            else:
                status = "failed_quorum"
        else:
            status = "failed_quorum"
            log.warning("round %d: %d of %d agents finished, quorum is %d", round_, len(rnd.done), len(rnd.participants), quorum)
        for agent in rnd.participants:
            self.agents[agent].round = 0
        return self._close(rnd, status)

    def _async_rounds(self, first_round: int) -> None:
        next_round = first_round
        while next_round <= self.config.rounds and not self._stopping:
            agents = self._active_agents() or self._await_agents(next_round)
            if not agents:
                self.report.status = "no_agents"
                return
            for agent in agents:
                self._start_agent_round(agent, next_round)
            self._async_loop()
            next_round = self.completed_round + 1  # every agent went away: start again from the next round

    def _async_loop(self) -> None:
        while self.open_rounds:
            self.pump(0.5)
            self._check_absent()
            now = time.monotonic()
            self._watch(list(self.open_rounds.values()), None)
            for agent, state in list(self.agents.items()):
                if state.round and now - state.assigned_at > self.config.round_deadline_s:
                    self._agent_missed(agent, "deadline passed")
            # Join: an online agent with nothing to do gets the lowest open round.
            for agent in self._active_agents():
                if self.agents[agent].round == 0 and self.open_rounds and not self._stopping:
                    lowest = min(self.open_rounds)
                    if agent not in self.open_rounds[lowest].participants:
                        self._start_agent_round(agent, lowest)
            while self.open_rounds:
                lowest = self.open_rounds[min(self.open_rounds)]
                if not lowest.participants <= set(lowest.done) | lowest.missing:
                    break
                used = {a for o in lowest.outcomes for a in o.used_agents}
                quorum = max(self.config.min_agents, math.ceil(self.config.min_fraction * len(lowest.participants)))
                record = self._close(lowest, "ok" if len(used) >= quorum else "failed_quorum")
                if self._should_stop(record):
                    self._stopping = True
                    for rnd in list(self.open_rounds.values()):
                        rnd.missing |= rnd.participants - set(rnd.done)

    # -- the run ------------------------------------------------------------------- #

    _stopping = False

    def _should_stop(self, record: RoundRecord) -> bool:
        self._failed_in_a_row = 0 if record.status == "ok" else self._failed_in_a_row + 1
        if self._failed_in_a_row >= self.config.max_failed_rounds:
            self.report.status = "aborted"
            log.error("%d rounds in a row without quorum: aborting", self._failed_in_a_row)
            return True
        target = self.config.target_accuracy
        if target is not None and record.accuracy is not None and record.accuracy >= target:
            self.report.status = "stopped_target"
            log.info("target accuracy %.2f%% reached in round %d", 100 * target, record.round)
            return True
        return False

    def wait_for_agents(self) -> None:
        deadline = time.monotonic() + self.config.registration_timeout_s
        last_count = -1
        while time.monotonic() < deadline and len(self._active_agents()) < self.config.expected_agents:
            count = len(self._active_agents())
            if count != last_count:
                log.info("waiting for agents: %d of %d joined", count, self.config.expected_agents)
                last_count = count
            self.pump(min(1.0, deadline - time.monotonic()))
        joined = len(self._active_agents())
        if joined < self.config.min_agents:
            raise RunAborted(
                f"only {joined} agents joined within {self.config.registration_timeout_s}s; need at least {self.config.min_agents}"
            )
        if joined < self.config.expected_agents:
            log.warning("starting with %d of %d expected agents", joined, self.config.expected_agents)

    def run(self, resume: bool = False) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()
        else:
            self.recorder.begin(self._new_report())
        self.transport.subscribe(self.topics.up_any)
        self.transport.subscribe(self.topics.status_any)
        self.transport.connect()
        self._send(None, Discover(**self._base(self.completed_round)))
        try:
            self.wait_for_agents()
            first = self.completed_round + 1
            if first > self.config.rounds:
                log.info("all %d rounds already done", self.config.rounds)
            elif self.method.asynchronous:
                self._async_rounds(first)
            else:
                for round_ in range(first, self.config.rounds + 1):
                    record = self._sync_round(round_)
                    if record is None:
                        self.report.status = "no_agents"
                        break
                    if self._should_stop(record):
                        break
            if self.report.status == "running":
                self.report.status = "finished"
        except RunAborted:
            self.report.status = "aborted"
            raise
        finally:
            self.recorder.finish()
            try:
                self._send(None, Shutdown(**self._base(self.completed_round), reason=self.report.status))
            except (OSError, RuntimeError) as exc:
                log.warning("could not broadcast shutdown: %s", exc)
            self.transport.close()
        return self.report.to_json()
