"""FedGKT over a real mosquitto: sync and async runs, learning, byte accounting
against an independent observer, an agent killed mid-round, a server killed
and resumed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from cloud_server.report import validate_report
from shared_protocol.mqtt.chunking import ChunkHeader
from shared_protocol.errors import ProtocolError
from shared_protocol.messages import decode_message
from shared_protocol.topics import Topics
from shared_protocol.transport import publish_packet_bytes

from fedhelpers import agent_config, mqtt_federation, server_config, spawn, write_agent_toml, write_server_toml

pytestmark = [pytest.mark.broker, pytest.mark.slow]


class Observer:
    """A separate MQTT client that watches every message of a run and sizes its packets."""

    def __init__(self, broker, run_id: str) -> None:  # type: ignore[no-untyped-def]
        self.wire_bytes = 0
        self.statuses: dict[str, str] = {}
        self.lock = threading.Lock()
        self.topics = Topics(run_id)
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"observer-{run_id}", protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.subscribe(self.topics.everything, qos=1)
        self.client.loop_start()
        time.sleep(0.3)

    def _on_message(self, client, userdata, message) -> None:  # type: ignore[no-untyped-def]
        props_len = len(message.properties.pack()) if message.properties is not None else 1
        with self.lock:
            if not message.retain:  # retained copies replayed at subscribe time were not sent now
                self.wire_bytes += publish_packet_bytes(message.topic, len(message.payload), message.qos, props_len)
            if "/status/" in message.topic and message.payload:
                try:
                    _header, frame = ChunkHeader.parse(message.payload)  # a status frame is one chunk
                    self.statuses[message.topic.rsplit("/", 1)[1]] = decode_message(frame).state  # type: ignore[attr-defined]
                except ProtocolError:
                    pass  # an observer only watches

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path, mode: str) -> None:  # type: ignore[no-untyped-def]
    cfg = server_config(tmp_path, run_id=f"mq-{mode}", method_config={"mode": mode})
    observer = Observer(mosquitto, cfg.run_id)
    try:
        fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url).start()
        report = fed.join()
        time.sleep(0.5)
    finally:
        observer.close()
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(on_disk)
    assert on_disk["status"] == "finished"
    assert [r["round"] for r in on_disk["rounds"]] == [1, 2]
    assert all(r["status"] == "ok" and r["completed"] == ["agent-0", "agent-1"] for r in on_disk["rounds"])
    for name in ("rounds.csv", "summary.md", "accuracy_vs_round.png", "accuracy_vs_wire_mb.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    # Bytes on the wire in the report agree with what an independent client saw.
    # (training's and evaluation's: the report keeps them apart).
    evaluation = on_disk["totals"]["eval_bytes"]
    reported = on_disk["totals"]["wire_total"] + evaluation["up_wire"] + evaluation["down_wire"]
    assert reported == pytest.approx(observer.wire_bytes, rel=0.05)
    assert report["totals"]["edge_train_flops"] > 0


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _rounds_in(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["rounds"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return []


def test_hung_agent_round_closes_at_deadline_then_restarted_agent_rejoins(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """agent-1 hangs mid-round (SIGSTOP: its connection stays open, so only the deadline
    can end the wait); round 1 closes at the deadline with agent-0's quorum. agent-1 is
    then killed and restarted, and takes part in round 2."""
    cfg = server_config(tmp_path, run_id="hang", rounds=2, round_deadline_s=20.0, min_agents=1, registration_timeout_s=90.0)
    observer = Observer(mosquitto, cfg.run_id)
    procs = {}
    configs = {i: write_agent_toml(tmp_path / f"agent-{i}.toml", agent_config(cfg.run_id, i, 2, broker_url=mosquitto.url)) for i in range(2)}
    for i in range(2):
        procs[i] = spawn("edge_agent.cli", "run", "--config", str(configs[i]), log=tmp_path / f"agent-{i}.log")
    fed = mqtt_federation(cfg, [], mosquitto.url)
    try:
        fed.start()
        _wait_for(lambda: observer.statuses.get("agent-1") == "training", 120, "agent-1 to start round 1")
        os.kill(procs[1].pid, signal.SIGSTOP)
        report_path = tmp_path / "run" / "report.json"
        _wait_for(lambda: len(_rounds_in(report_path)) >= 1, 120, "round 1 to close")
        round1 = _rounds_in(report_path)[0]
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        procs[1] = spawn("edge_agent.cli", "run", "--config", str(configs[1]), log=tmp_path / "agent-1-restarted.log")
        report = fed.join(300)
    finally:
        observer.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert round1["status"] == "ok"
    assert round1["completed"] == ["agent-0"] and round1["missing"] == ["agent-1"]
    assert round1["time_s"]["round"] >= 19.0  # closed at the deadline, not before
    round2 = report["rounds"][1]
    assert round2["status"] == "ok" and round2["completed"] == ["agent-0", "agent-1"]
    assert round2["samples"] == 160  # each agent's 80 samples, none counted twice


def test_killed_agent_is_noticed_before_the_deadline(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A killed process closes its socket: the broker's last will marks it offline, and
    after the offline grace period the sync round closes without waiting for the deadline."""
    cfg = server_config(tmp_path, run_id="kill", rounds=1, round_deadline_s=300.0, offline_grace_s=5.0, min_agents=1, registration_timeout_s=90.0)
    observer = Observer(mosquitto, cfg.run_id)
    procs = {i: spawn("edge_agent.cli", "run", "--config", str(write_agent_toml(tmp_path / f"agent-{i}.toml", agent_config(cfg.run_id, i, 2, broker_url=mosquitto.url))), log=tmp_path / f"agent-{i}.log") for i in range(2)}
    fed = mqtt_federation(cfg, [], mosquitto.url)
    try:
        fed.start()
        _wait_for(lambda: observer.statuses.get("agent-1") == "training", 120, "agent-1 to start round 1")
        os.kill(procs[1].pid, signal.SIGKILL)
        report = fed.join(200)
    finally:
        observer.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    (round1,) = report["rounds"]
    assert round1["completed"] == ["agent-0"] and round1["missing"] == ["agent-1"]
    assert 5.0 <= round1["time_s"]["round"] < 120


def test_server_killed_after_round_one_resumes(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = replace(server_config(tmp_path, run_id="resume", rounds=3), broker_url=mosquitto.url)
    server_toml = write_server_toml(tmp_path / "server.toml", cfg)
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url)
    agent_threads = [threading.Thread(target=a.run, daemon=True) for a in fed.agents]
    for t in agent_threads:
        t.start()
    report_path = tmp_path / "run" / "report.json"
    server = spawn("cloud_server.cli", "run", "--config", str(server_toml), log=tmp_path / "server-1.log")
    try:
        _wait_for(lambda: len(_rounds_in(report_path)) >= 1, 240, "round 1 to close")
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        first = _rounds_in(report_path)[0]
        assert (tmp_path / "run" / "checkpoint" / "method.npz").exists()
        server = spawn("cloud_server.cli", "run", "--config", str(server_toml), "--resume", log=tmp_path / "server-2.log")
        assert server.wait(timeout=300) == 0, (tmp_path / "server-2.log").read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
        for a in fed.agents:
            a.stop()
        for t in agent_threads:
            t.join(30)
    report = json.loads(report_path.read_text())
    validate_report(report)
    assert report["status"] == "finished"
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3]
    assert report["rounds"][0] == first  # round 1 was not redone
    assert all(r["status"] == "ok" and r["samples"] == 160 for r in report["rounds"])
    log = (tmp_path / "server-2.log").read_text()
    assert "resumed from checkpoint after round 1" in log
