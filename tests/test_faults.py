"""Faults: an agent that sends garbage forever, a broker restarted mid-round,
stale-round replays."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shared_protocol.messages import Hello, RoundEnd, encode_message
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.topics import Topics
from shared_protocol.transport import InMemoryBroker, InMemoryTransport, MqttTransport, TransportConfig

from cloud_server.report import validate_report
from fedhelpers import Federation, agent_config, make_server, mqtt_federation, server_config
from edge_agent.agent import EdgeAgent


@pytest.mark.broker
def test_garbage_agent_is_dropped_and_the_run_goes_on(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = server_config(tmp_path, run_id="garbage", agents=2, rounds=2, max_rejections_per_agent=5)
    fed = mqtt_federation(cfg, [agent_config("garbage", i, 2) for i in range(2)], mosquitto.url)
    coordinator = fed.coordinator
    topics = Topics("garbage")
    rogue = MqttTransport(TransportConfig(broker_url=mosquitto.url, client_id="rogue", connect_timeout_s=10))
    rogue.connect()
    stop = threading.Event()

    def spew() -> None:
        hello = Hello(run="garbage", round=0, sender="rogue", cpu_model="x", arch="x", cores=1, memory_bytes=1,
                      backend="torch", num_samples=1, class_counts=[1], methods=["fedgkt"])
        deadline = time.monotonic() + 60
        while "rogue" not in coordinator.agents and time.monotonic() < deadline:
            rogue.publish(topics.up("rogue"), encode_message(hello))  # until the server is listening
            time.sleep(0.2)
        rng = np.random.default_rng(0)
        while not stop.is_set():
            rogue.publish(topics.up("rogue"), rng.bytes(200))  # not a frame
            forged = RoundEnd(run="garbage", round=1, sender="agent-0", num_samples=5)  # claims to be someone else
            rogue.publish(topics.up("rogue"), encode_message(forged))
            time.sleep(0.02)

    spewer = threading.Thread(target=spew, daemon=True)
    fed.start()
    spewer.start()
    try:
        report = fed.join(300)
    finally:
        stop.set()
        spewer.join(5)
        rogue.close()
    validate_report(report)
    assert report["status"] == "finished"
    assert all(r["status"] == "ok" and r["completed"] == ["agent-0", "agent-1"] for r in report["rounds"])
    assert all(r["samples"] == 160 for r in report["rounds"])
    assert coordinator.agents["rogue"].dropped
    rejected = report["totals"]["rejected_by_reason"]
    assert rejected.get("bad_magic", 0) + rejected.get("truncated_frame", 0) >= 1
    assert rejected.get("unknown_sender", 0) >= 1  # the forged sender
    assert report["totals"]["rejected_messages"] >= 5


def test_stale_and_replayed_messages_change_nothing(tmp_path: Path) -> None:
    """Uploads for a round that is not the agent's current round are refused and counted."""
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="stale", agents=1, rounds=1)
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    topics = Topics("stale")
    agent = InMemoryTransport(broker, "agent-0")
    agent.connect()
    coordinator.transport.subscribe(topics.up_any)
    coordinator.transport.connect()
    hello = Hello(run="stale", round=0, sender="agent-0", cpu_model="x", arch="x", cores=1, memory_bytes=1,
                  backend="torch", num_samples=4, class_counts=[4], methods=["fedgkt"])
    agent.publish(topics.up("agent-0"), encode_message(hello))
    coordinator.pump(1.0)
    rng = np.random.default_rng(0)
    replay = GktFeatures(run="stale", round=7, sender="agent-0", split="train", seq=0, instance="old",
                         features=np.zeros((2, 16, 32, 32), np.float32), logits=rng.normal(size=(2, 10)).astype(np.float32),
                         labels=np.array([1, 2]), sample_ids=np.array([1, 2]))
    agent.publish(topics.up("agent-0"), encode_message(replay))
    coordinator.pump(1.0)
    assert coordinator.rejected["stale_round"] == 1
    assert coordinator.method.staged == {}


@pytest.mark.broker
@pytest.mark.slow
def test_broker_restarted_mid_round(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = server_config(tmp_path, run_id="restart", rounds=2, round_deadline_s=120.0)
    agent_cfgs = [agent_config(cfg.run_id, i, 2, train_samples=320, test_samples=80) for i in range(2)]
    fed = mqtt_federation(cfg, agent_cfgs, mosquitto.url)
    for agent in fed.agents:
        agent.transport.config = replace(agent.transport.config)
    fed.start()
    # Restart the broker while round 1's uploads are on the way.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and fed.coordinator.transport.stats.chunks_in < 20:
        time.sleep(0.05)
    mosquitto.restart(down_s=1.0)
    report = fed.join(400)
    validate_report(report)
    assert report["status"] == "finished"
    assert [r["status"] for r in report["rounds"]] == ["ok", "ok"]
    for record in report["rounds"]:
        assert record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 320  # every sample once, none twice
    assert fed.coordinator.transport.connect_count >= 2
    assert all(a.transport.connect_count >= 2 for a in fed.agents)


@pytest.mark.broker
@pytest.mark.slow
def test_agent_killed_mid_upload_then_restarted(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The killed process's partial upload is void; the restarted agent redoes the
    round and every sample is counted exactly once."""
    import os
    import signal

    from fedhelpers import spawn, write_agent_toml

    cfg = server_config(tmp_path, run_id="midup", rounds=1, round_deadline_s=200.0, method_config={"upload_batch_samples": 16})
    fed = mqtt_federation(cfg, [], mosquitto.url)
    tomls = [write_agent_toml(tmp_path / f"agent-{i}.toml", agent_config("midup", i, 2, broker_url=mosquitto.url, train_samples=480)) for i in range(2)]
    procs = [spawn("edge_agent.cli", "run", "--config", str(t), log=tmp_path / f"agent-{i}.log") for i, t in enumerate(tomls)]
    try:
        fed.start()
        staged = fed.coordinator.method.staged
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ("agent-1" in staged and len(staged["agent-1"].train) >= 2):
            time.sleep(0.005)
        assert "agent-1" in staged, "agent-1 never started uploading"
        old_instance = staged["agent-1"].instance
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        procs[1] = spawn("edge_agent.cli", "run", "--config", str(tomls[1]), log=tmp_path / "agent-1-restarted.log")
        report = fed.join(300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    validate_report(report)
    (round1,) = report["rounds"]
    assert round1["status"] == "ok" and round1["completed"] == ["agent-0", "agent-1"]
    assert round1["samples"] == 480  # 240 per agent, the killed upload not added to the new one
    assert round1["per_agent"]["agent-1"]["samples"] == 240
    assert fed.coordinator.agents["agent-1"].instance != old_instance
