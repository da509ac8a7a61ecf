"""The data contract is checked at join, before any work: an agent's hello carries its
input shape and class count, the server refuses a mismatching agent naming both shapes
and the setting to change, the agent exits with the configuration-error code, and the
other agents' rounds complete (in memory here; over TLS mosquitto in test_deploy_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import logging
import time

from fldata import make_synthetic
from cloud_server.coordinator import Coordinator
from cloud_server.report import validate_report
from edge_agent.agent import EXIT_CONFIG, EXIT_OK, EdgeAgent
from shared_protocol.messages import Hello, Status, Welcome, decode_message, encode_message
from shared_protocol.topics import Topics
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import agent_config, make_server, server_config


def _hello(agent: str, run: str, **kw: object) -> Hello:
    return Hello(run=run, round=0, sender=agent, cpu_model="x", arch="x", cores=1, memory_bytes=1, backend="torch",
                 num_samples=1, class_counts=[1], methods=["fedgkt"], **kw)  # type: ignore[arg-type]


def _answer(tmp_path: Path, hellos: list[Hello], **server_kw: object) -> list[Welcome]:
    """The server's welcome to each hello, in order."""
    return _answered(tmp_path, hellos, **server_kw)[1]


def _answered(tmp_path: Path, hellos: list[Hello], **server_kw: object) -> tuple[Coordinator, list[Welcome]]:
    """The server and its welcome to each hello, in order."""
    run = hellos[0].run
    broker = InMemoryBroker()
    server_kw = {"agents": 2, **server_kw}
    coordinator = make_server(server_config(tmp_path, run_id=run, **server_kw), InMemoryTransport(broker, "server"))  # type: ignore[arg-type]
    coordinator.transport.subscribe(Topics(run).up_any)
    coordinator.transport.connect()
    replies = []
    for hello in hellos:
        client = InMemoryTransport(broker, hello.sender)
        client.subscribe(Topics(run).down(hello.sender))
        client.connect()
        client.publish(Topics(run).up(hello.sender), encode_message(hello))
        coordinator.pump(1.0)
        reply = decode_message(client.receive(1.0).payload)
        assert isinstance(reply, Welcome)
        replies.append(reply)
    return coordinator, replies


def test_first_agent_fixes_the_size_and_a_different_size_is_refused_naming_both(tmp_path: Path) -> None:
    first, second, old = _answer(tmp_path, [
        _hello("a", "c1", input_shape=[3, 32, 32], num_classes=10),
        _hello("b", "c1", input_shape=[3, 48, 48], num_classes=10),
        _hello("c", "c1"),  # an agent from before the contract: nothing to check
    ])
    assert first.accepted and old.accepted
    assert not second.accepted and second.code == "data_mismatch"
    assert "(3, 48, 48)" in second.reason and "(3, 32, 32)" in second.reason
    assert "agent a" in second.reason and "image_size" in second.reason


def test_the_size_the_first_agent_fixed_survives_a_server_restart(tmp_path: Path) -> None:
    """The checkpoint keeps the contract: after a resume, an agent with another size is still
    refused, naming the agent that fixed it, although none has said hello since."""
    from fedhelpers import Federation

    cfg = server_config(tmp_path, run_id="c5", agents=1, rounds=1, min_agents=1, eval_samples=16)
    broker = InMemoryBroker()
    first = make_server(cfg, InMemoryTransport(broker, "server"))
    agent = EdgeAgent(agent_config("c5", 0, 1, train_samples=32, test_samples=16), transport=InMemoryTransport(broker, "agent-0"))
    assert Federation(first, [agent]).start().join(240)["status"] == "finished"
    assert first.registry.input_hw == (32, 32) and "agent-0" in first.registry.input_hw_source
    resumed = make_server(cfg, InMemoryTransport(broker, "server2"))
    resumed.load_checkpoint()
    reason = resumed.registry.data_mismatch("b", _hello("b", "c5", input_shape=[3, 48, 48], num_classes=10))
    assert reason is not None and "(3, 32, 32)" in reason and "agent agent-0, the first to join" in reason
    fresh = make_server(server_config(tmp_path / "other", run_id="c5", agents=2), InMemoryTransport(broker, "server3"))
    assert fresh.registry.data_mismatch("b", _hello("b", "c5", input_shape=[3, 48, 48], num_classes=10)) is None


def test_the_configured_size_wins_over_the_first_agent(tmp_path: Path) -> None:
    (first,) = _answer(tmp_path, [_hello("a", "c2", input_shape=[3, 32, 32], num_classes=10)], image_size=(48, 48))
    assert not first.accepted and "(3, 48, 48)" in first.reason and "[server] image_size" in first.reason


def test_channels_and_classes_name_their_server_keys(tmp_path: Path) -> None:
    gray, classes = _answer(tmp_path, [
        _hello("a", "c3", input_shape=[1, 32, 32], num_classes=10),
        _hello("b", "c3", input_shape=[3, 32, 32], num_classes=9),
    ])
    assert not gray.accepted and "in_channels = 1" in gray.reason and "(1, 32, 32)" in gray.reason
    assert not classes.accepted and "9 classes" in classes.reason and "num_classes" in classes.reason


def test_a_device_refused_at_join_does_not_hold_the_first_round_up(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Three devices expected, one refused for its image size, the other two joined: the first
    round starts at once, not at the end of the join window; the log says why it starts short."""
    coordinator, replies = _answered(tmp_path, [
        _hello("a", "c6", input_shape=[3, 32, 32], num_classes=10),
        _hello("b", "c6", input_shape=[3, 48, 48], num_classes=10),
        _hello("c", "c6", input_shape=[3, 32, 32], num_classes=10),
    ], agents=3, min_agents=1, registration_timeout_s=300, image_size=(32, 32))
    assert [r.accepted for r in replies] == [True, False, True] and replies[1].code == "data_mismatch"
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cloud_server"):
        coordinator.registry.wait_for_agents(coordinator.pump)
    assert time.monotonic() - start < 10
    assert "starting with 2 of 3 expected agents (1 refused at join: b)" in caplog.text


def test_the_join_window_still_waits_for_a_device_not_heard_from(tmp_path: Path) -> None:
    """One device joined and one refused of three: the third may still come, so the window is
    waited out; an agent outside the allow-list is no device of the run and shortens nothing."""
    coordinator, replies = _answered(tmp_path, [
        _hello("a", "c7", input_shape=[3, 32, 32], num_classes=10),
        _hello("b", "c7", input_shape=[3, 48, 48], num_classes=10),
        _hello("stranger", "c7", input_shape=[3, 32, 32], num_classes=10),
    ], agents=3, min_agents=1, registration_timeout_s=2, image_size=(32, 32), allow_list=("a", "b", "c"))
    assert [r.code for r in replies] == ["", "data_mismatch", "not_allowed"]
    assert coordinator.registry.refused_devices() == ["b"]
    start = time.monotonic()
    coordinator.registry.wait_for_agents(coordinator.pump)
    assert time.monotonic() - start >= 1.5


def test_mis_sized_agent_is_refused_at_join_and_the_others_finish(tmp_path: Path) -> None:
    # A join window far longer than the test may take: the refused agent does not hold round 1 up.
    cfg = server_config(tmp_path, run_id="c4", agents=2, rounds=1, min_agents=1, registration_timeout_s=600, image_size=(32, 32))
    broker = InMemoryBroker()
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    good = EdgeAgent(agent_config("c4", 0, 2), transport=InMemoryTransport(broker, "agent-0"))
    big = make_synthetic(64, in_channels=3, size=48, seed=1)
    bad_data = (big, make_synthetic(16, in_channels=3, size=48, seed=2, split="test"))
    bad = EdgeAgent(agent_config("c4", 1, 2), transport=InMemoryTransport(broker, "agent-1"), data=bad_data)
    from fedhelpers import Federation

    report = Federation(coordinator, [good, bad]).start().join(240)
    validate_report(report)
    assert report["status"] == "finished" and report["rounds"][0]["completed"] == ["agent-0"]
    assert [r["agent"] for r in report["refused_agents"]] == ["agent-1"]
    assert report["refused_agents"][0]["code"] == "data_mismatch"
    assert "(3, 48, 48)" in report["refused_agents"][0]["reason"]
    assert bad.exit_code == EXIT_CONFIG and good.exit_code == EXIT_OK
    assert bad.rounds_done == []
    # The refused agent has exited: its retained status says so (a dashboard must not show it online).
    retained = dict(broker.retained_matching(Topics("c4").status("agent-1")))
    status = decode_message(retained[Topics("c4").status("agent-1")])
    assert isinstance(status, Status) and status.state == "offline"
