"""The coordinator never crashes on an empty round and never waits silently: every agent
gone after a failed round ends the run (or waits for one, per ``no_agents_policy``),
the server says every minute whom it waits for and why, a participant whose round_end
never came is asked again, and one deadline closes the round, turns and evaluation
included. In memory, with scripted agents, so each takes seconds."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from cloud_server.evaluation import Evaluation
from cloud_server.coordinator import Coordinator
from cloud_server.methods import RoundOutcome, ServerContext, ServerMethod
from cloud_server.report import validate_report
from cloud_server.schedulers import RoundScheduler
from fedhelpers import make_server, server_config
from shared_protocol.messages import Discover, Hello, RoundEnd, RoundStart, Status, decode_message, encode_message
from shared_protocol.topics import Topics
from shared_protocol.transport import InMemoryBroker, InMemoryTransport


class ScriptedAgent:
    """An agent that says hello and answers every message with ``on_message`` (no training)."""

    def __init__(self, broker: InMemoryBroker, run: str, agent_id: str,
                 on_message: Callable[["ScriptedAgent", object], None]) -> None:
        self.id, self.run, self.topics = agent_id, run, Topics(run)
        self.transport = InMemoryTransport(broker, agent_id)
        self.transport.subscribe(self.topics.down(agent_id))
        self.transport.subscribe(self.topics.down_all)
        self.transport.connect()
        self.on_message = on_message
        self.received: list[object] = []
        self.gone = False

    def hello(self) -> None:
        msg = Hello(run=self.run, round=0, sender=self.id, cpu_model="x", arch="x", cores=1, memory_bytes=1,
                    backend="torch", num_samples=8, class_counts=[8], methods=["fedgkt"])
        self.transport.publish(self.topics.up(self.id), encode_message(msg))

    def status(self, state: str) -> None:
        msg = Status(run=self.run, round=0, sender=self.id, state=state)
        self.transport.publish(self.topics.status(self.id), encode_message(msg), retain=True)

    def poll(self) -> None:
        while (delivery := self.transport.receive(timeout_s=0)) is not None:
            msg = decode_message(delivery.payload)
            self.received.append(msg)
            self.on_message(self, msg)


def run_with(coordinator: Coordinator, agents: list[ScriptedAgent], timeout_s: float = 60) -> dict:
    result: dict = {}
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            result.update(coordinator.run())
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        for agent in agents:
            agent.poll()
        time.sleep(0.01)
    thread.join(1)
    assert not thread.is_alive(), "the server did not end the run"
    if errors:
        raise errors[0]
    return result


def go_offline_on_round_start(agent: ScriptedAgent, msg: object) -> None:
    if isinstance(msg, RoundStart):
        agent.gone = True
        agent.status("offline")  # what its last will says when the device dies
    elif isinstance(msg, Discover) and not agent.gone:
        agent.hello()  # the server's call at start


@pytest.mark.parametrize("policy", ["end", "wait"])
def test_every_agent_gone_after_a_failed_round_ends_the_run(tmp_path: Path, policy: str, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="empty", agents=2, rounds=3, round_deadline_s=5.0, offline_grace_s=0.0,
                        registration_timeout_s=2.0, no_agents_policy=policy)
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    agents = [ScriptedAgent(broker, "empty", f"agent-{i}", go_offline_on_round_start) for i in range(2)]
    started = time.monotonic()
    report = run_with(coordinator, agents)
    validate_report(report)
    assert report["status"] == "no_agents"
    assert [r["status"] for r in report["rounds"]] == ["failed_quorum"]  # round 2 never started: nobody to start it with
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("no agent is left to start round 2 with (agent-0 (offline), agent-1 (offline))") for m in messages)
    if policy == "wait":
        assert any("no agent rejoined within 2 s; ending the run before round 2" in m for m in messages)
        assert time.monotonic() - started >= 2.0
    else:
        assert any("ending the run (no_agents_policy = end)" in m for m in messages)


def test_an_agent_back_while_the_server_waits_gets_the_next_round(tmp_path: Path) -> None:
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="back", agents=2, rounds=2, round_deadline_s=5.0, offline_grace_s=0.0,
                        registration_timeout_s=20.0, max_failed_rounds=5)
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    rejoined = threading.Event()

    def come_back_once(agent: ScriptedAgent, msg: object) -> None:
        if isinstance(msg, RoundStart):
            agent.gone = True
            agent.status("offline")
        elif isinstance(msg, Discover) and not agent.gone:
            agent.hello()
        elif isinstance(msg, Discover) and agent.id == "agent-0" and not rejoined.is_set() and coordinator.completed_round == 1:
            rejoined.set()  # the server asked who is there while it waits: agent-0 is back
            agent.status("online")
            agent.hello()

    agents = [ScriptedAgent(broker, "back", f"agent-{i}", come_back_once) for i in range(2)]
    report = run_with(coordinator, agents)
    validate_report(report)
    assert rejoined.is_set()
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert report["rounds"][1]["participants"] == ["agent-0"]
    assert report["status"] == "finished"


def test_the_server_says_whom_it_waits_for_asks_again_and_closes_at_the_deadline(
        tmp_path: Path, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """agent-0 trains forever; agent-1 says it finished but its round_end never comes
    (refused on the way). The server names both every 'minute' (1 s here) with what it
    knows, asks agent-1 to announce itself again, and closes the round at its deadline."""
    monkeypatch.setattr(RoundScheduler, "WAITING_LOG_EVERY_S", 1.0)
    monkeypatch.setattr(RoundScheduler, "NUDGE_AFTER_S", 1.0)
    caplog.set_level(logging.INFO)
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="slow", agents=2, rounds=1, round_deadline_s=4.0, registration_timeout_s=10.0)
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))

    def answer(agent: ScriptedAgent, msg: object) -> None:
        if isinstance(msg, RoundStart):
            agent.status("training" if agent.id == "agent-0" else "idle")
        elif isinstance(msg, Discover) and not any(isinstance(m, RoundStart) for m in agent.received):
            agent.hello()

    agents = [ScriptedAgent(broker, "slow", f"agent-{i}", answer) for i in range(2)]
    started = time.monotonic()
    report = run_with(coordinator, agents)
    elapsed = time.monotonic() - started
    validate_report(report)
    (record,) = report["rounds"]
    assert record["status"] == "failed_quorum" and record["missing"] == ["agent-0", "agent-1"]
    assert elapsed < 60  # the deadline closed it: agent-0 would train forever
    messages = [r.getMessage() for r in caplog.records]
    waiting = [m for m in messages if m.startswith("round 1 open for")]
    assert len(waiting) >= 2
    assert "waiting for 2 of 2 agents" in waiting[0]
    assert "agent-0 (said 'training'" in waiting[-1] and "agent-1 (said 'idle'" in waiting[-1]
    assert any(m.startswith("agent agent-1 said it finished round 1") for m in messages)
    def asked_again(agent: ScriptedAgent) -> bool:
        after_start = agent.received[[isinstance(m, RoundStart) for m in agent.received].index(True):]
        return any(isinstance(m, Discover) for m in after_start)

    assert asked_again(agents[1])  # asked to announce itself again
    assert not asked_again(agents[0])  # the one still training is left alone
    assert any(m.startswith("round 1 deadline passed; closing it without agent-0, agent-1") for m in messages)


class _TurnsThenEvaluation(ServerMethod):
    """A sequential method whose evaluation requests are never answered: the server step
    is scripted (the coordinator's waits are under test, not a method)."""

    name = "fedgkt"  # the scripted agents implement it; its steps are replaced here
    schedule = "sequential"

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx, {})

    def resolved_config(self) -> dict:
        return {}

    def welcome_settings(self) -> dict:
        return {}

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict, dict]:
        return {}, {}

    def on_upload(self, agent: str, msg: object) -> None:
        raise AssertionError("the scripted agents upload nothing")

    def complete(self, round_: int, ends: dict, evaluate: bool) -> RoundOutcome:
        return RoundOutcome(samples=8 * len(ends), used_agents=sorted(ends))

    def evaluation(self, round_: int, reports: dict) -> Evaluation:
        return Evaluation()  # nothing to score: the coordinator's wait for the reports is under test

    def model_info(self) -> dict:
        return {"edge": None, "server": None}


def test_a_sequential_round_with_evaluation_ends_within_one_deadline(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """agent-0 finishes its turn at once, agent-1 hangs in its turn, agent-2 waits for its
    turn, and nobody answers the evaluation requests. Turn by turn with a deadline each,
    then another deadline for the evaluation, this round would take three deadlines; one
    ``round_deadline_s`` bounds it from its start, plus one grace: the coordinator pumps in
    slices of at most 1 s, and the thread needs a moment to be scheduled."""
    caplog.set_level(logging.INFO)
    deadline_s, grace_s = 4.0, 2.0
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="turns", agents=3, rounds=1, round_deadline_s=deadline_s, registration_timeout_s=20.0,
                        min_agents=1)
    coordinator = Coordinator(cfg, _TurnsThenEvaluation(cfg.method_context("cpu")), InMemoryTransport(broker, "server"))

    def answer(agent: ScriptedAgent, msg: object) -> None:
        if isinstance(msg, RoundStart) and agent.id == "agent-0":
            end = RoundEnd(run=agent.run, round=msg.round, sender=agent.id, num_samples=8)
            agent.transport.publish(agent.topics.up(agent.id), encode_message(end))
        elif isinstance(msg, Discover) and not any(isinstance(m, RoundStart) for m in agent.received):
            agent.hello()

    agents = [ScriptedAgent(broker, "turns", f"agent-{i}", answer) for i in range(3)]
    report = run_with(coordinator, agents)
    validate_report(report)
    (record,) = report["rounds"]
    assert record["status"] == "ok" and record["completed"] == ["agent-0"]
    assert record["missing"] == ["agent-1", "agent-2"]  # agent-2's turn never came
    assert record["time_s"]["round"] <= deadline_s + grace_s
    starts = {a.id: [m for m in a.received if isinstance(m, RoundStart)] for a in agents}
    assert starts["agent-2"] == []
    assert 0.0 < starts["agent-1"][0].deadline_s < deadline_s  # what is left of the round, not a deadline of its own
    messages = [r.getMessage() for r in caplog.records]
    assert "round 1 deadline passed before agent agent-2's turn" in messages
    assert "round 1: evaluated without the evaluation reports of agent-0" in messages


def test_no_agent_is_nudged_while_received_messages_wait(tmp_path: Path) -> None:
    """In async mode the server trains on one agent's upload for longer than NUDGE_AFTER_S
    while another agent's round_end, already received, waits in its inbox behind its 'idle'
    status. That agent is not asked to redo its round: nobody is nudged until the server has
    taken every message it received."""
    from shared_protocol.messages import Hello
    from shared_protocol.transport import Delivery

    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="busy", agents=1, rounds=1)
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    hello = Hello(run="busy", round=0, sender="agent-0", cpu_model="x", arch="x86_64", cores=1, memory_bytes=1,
                  backend="torch", num_samples=8, class_counts=[8], methods=["fedgkt"])
    state = coordinator.registry.join("agent-0", hello)
    rnd = coordinator.open_round(1)
    rnd.participants.add("agent-0")
    coordinator.registry.assign("agent-0", 1)
    long_ago = time.monotonic() - 10 * RoundScheduler.NUDGE_AFTER_S
    state.assigned_at, state.status, state.status_at, state.last_heard_at = long_ago - 1, "idle", long_ago, long_ago
    sent: list[object] = []
    coordinator.send = lambda agent, msg: sent.append(msg)  # type: ignore[method-assign]
    coordinator.transport._inbox.put(Delivery("edgesplit/v1/busy/up/agent-0", b"x", "t", 1, time.time()))  # type: ignore[attr-defined]
    assert coordinator.transport.backlog() == 1
    coordinator.scheduler.watch([rnd])
    assert sent == []  # its round_end may be the message waiting
    coordinator.transport.receive(0.1)
    coordinator.scheduler.watch([rnd])
    assert [type(m).__name__ for m in sent] == ["Discover"]  # caught up and still nothing: asked again
