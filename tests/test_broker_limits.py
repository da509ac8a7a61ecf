"""No sender can stall a run, and a broker that caps packet size is followed: floods of
garbage and never-completing transfers, one agent holding the most transfers it may,
a broker with ``max_packet_size 131072``, an explicit chunk size that cannot fit, and
a round that finds every agent gone. All against a real mosquitto on a free loopback port."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from cloud_server.report import validate_report
from fedhelpers import ROOT, agent_config, mqtt_federation, server_config, write_server_toml
from shared_protocol.mqtt.chunking import DIGEST_BYTES, ChunkHeader, SenderLimits, split_blob
from shared_protocol.transport import CHUNK_HEADROOM_BYTES, MqttTransport, TransportConfig, TransportError
from shared_protocol.topics import Topics

from conftest import Broker, free_port

pytestmark = pytest.mark.broker

LIMIT = 131072  # AWS IoT Core's 128 KiB


@pytest.fixture
def small_packet_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path, free_port(), extra_config=f"max_packet_size {LIMIT}\n")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _first_chunk(transfer_id: str, total_bytes: int, stride: int) -> bytes:
    """The first chunk of a transfer that declares ``total_bytes`` and never sends the rest."""
    count = -(-total_bytes // stride)
    return ChunkHeader(transfer_id, 0, count, total_bytes, stride).pack() + os.urandom(stride)


def _flood_payloads(rng: np.random.Generator, i: int) -> list[bytes]:
    """One round of everything an attacker throws: random bytes, well-formed chunks carrying
    garbage frames, a chunk with a wrong blob digest, a frame declaring a 4 GiB header, and first
    chunks of 256 MiB and of 2 MiB transfers that never complete."""
    garbage_frame = split_blob(rng.bytes(3000), 1024)
    wrong_sha = split_blob(rng.bytes(2000), 4096)[0]
    header, body = ChunkHeader.parse(wrong_sha)
    wrong_sha = replace(header, digest=bytes(DIGEST_BYTES)).pack() + bytes(body)
    huge_header = split_blob(struct.pack(">4sBBIQ", b"ESPL", 1, 0, 0xFFFFFFFF, 16) + bytes(64), 4096)[0]
    return [
        rng.bytes(200),
        *garbage_frame,
        wrong_sha,
        huge_header,
        _first_chunk(f"never-{i}", 256 * 1024 * 1024, 64 * 1024),
        _first_chunk(f"stall-{i}", 2 * 1024 * 1024, 64 * 1024),
    ]


@pytest.mark.slow
def test_flood_on_an_agents_and_a_strangers_topics_cannot_stall_a_run(mosquitto, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    cfg = server_config(tmp_path, run_id="flood", agents=2, rounds=2, round_deadline_s=240.0)
    fed = mqtt_federation(cfg, [agent_config("flood", i, 2) for i in range(2)], mosquitto.url)
    topics = Topics("flood")
    targets = [topics.up("agent-1"), topics.up("intruder"), topics.status("agent-1")]
    flooder = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="flooder", protocol=mqtt.MQTTv5)
    flooder.connect(mosquitto.host, mosquitto.port)
    flooder.loop_start()
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        rng = np.random.default_rng(0)
        i = 0
        while not stop.is_set():
            for topic in targets:
                for payload in _flood_payloads(rng, i):
                    flooder.publish(topic, payload, qos=1).wait_for_publish(10)
                    sent[0] += 1
            i += 1
            time.sleep(0.1)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()  # before the server starts: the first uploads arrive into a flood
    fed.start()
    try:
        report = fed.join(500)
    finally:
        stop.set()
        thread.join(10)
        flooder.loop_stop()
        flooder.disconnect()
    validate_report(report)
    assert report["status"] == "finished"
    for record in report["rounds"]:
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 160  # every sample of both agents, every round
    assert sent[0] > 200
    totals = report["totals"]
    chunks = totals["rejected_chunks_by_reason"]
    # Every refusal is counted by its reason: transfers declaring more than a sender may, wrong
    # hashes, headers that do not parse, and the stranger ignored after its invalid transfers.
    for code in ("size_limit", "hash_mismatch", "bad_chunk", "ignored_sender"):
        assert chunks.get(code, 0) >= 1, chunks
    assert totals["rejected_chunks"] == sum(chunks.values())
    assert totals["rejected_by_reason"].get("bad_magic", 0) >= 1  # garbage frames that completed
    assert totals["rejected_by_reason"].get("size_limit", 0) >= 1  # the 4 GiB header
    assert totals["rejected_messages"] == sum(totals["rejected_by_reason"].values())
    assert not fed.coordinator.agents["agent-1"].dropped  # garbage on its topic names no sender
    # Logged once per topic and sender, then summarised: not once per chunk.
    rejected_lines = [r for r in caplog.records if "rejected" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(rejected_lines) < 20 < totals["rejected_chunks"] + totals["rejected_messages"], len(rejected_lines)
    ignoring = [r for r in caplog.records if r.getMessage().startswith("ignoring everything on " + topics.up("intruder"))]
    assert len(ignoring) == 1


def test_one_agent_holding_its_most_transfers_cannot_fail_anothers_upload(mosquitto) -> None:  # type: ignore[no-untyped-def]
    """The receiver's total is 8 MiB; agent a opens the most transfers it may (8) and fills
    each almost to its 1 MiB length, never finishing one, and keeps opening more. b's upload
    and a's own live one still arrive: a can only fill its own 3 MiB."""
    a_topic, b_topic = "edgesplit/v1/b/up/a", "edgesplit/v1/b/up/b"
    rx = MqttTransport(TransportConfig(broker_url=mosquitto.url, client_id="rx-b", connect_timeout_s=10,
                                       max_transfer_bytes=2 << 20, max_reassembly_bytes=8 << 20,
                                       max_unexpected_transfer_bytes=64 << 10))
    for topic in (a_topic, b_topic):
        rx.expect_sender(topic, SenderLimits(1 << 20, 3 << 20, max_open_transfers=8))
    rx.subscribe("edgesplit/v1/b/up/+")
    rx.connect()
    greedy = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="greedy", protocol=mqtt.MQTTv5)
    greedy.connect(mosquitto.host, mosquitto.port)
    greedy.loop_start()
    b = MqttTransport(TransportConfig(broker_url=mosquitto.url, client_id="b", chunk_size_bytes=64 << 10, connect_timeout_s=10))
    b.connect()
    try:
        for t in range(24):  # three times the most it may have open
            for chunk in split_blob(os.urandom(1 << 20), 64 << 10, transfer_id=f"greedy-{t}")[:-1]:
                greedy.publish(a_topic, chunk, qos=1).wait_for_publish(10)
        deadline = time.monotonic() + 10
        while rx.stats.chunks_in < 24 * 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        open_a, held_a = rx.inbound_progress(a_topic)
        assert open_a <= 8 and held_a <= 3 << 20
        blob_b = os.urandom((1 << 20) - 4096)
        b.publish(b_topic, blob_b)
        got = rx.receive(timeout_s=20)
        assert got is not None and got.topic == b_topic and got.payload == blob_b
        live_a = os.urandom(900_000)
        for chunk in split_blob(live_a, 64 << 10, transfer_id="a-live"):
            greedy.publish(a_topic, chunk, qos=1).wait_for_publish(10)
        got = rx.receive(timeout_s=20)
        assert got is not None and got.topic == a_topic and got.payload == live_a
        assert rx.rejections().get("over_budget", 0) == 0  # nobody was refused for a budget
    finally:
        greedy.loop_stop()
        greedy.disconnect()
        b.close()
        rx.close()


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [None, 64 * 1024], ids=["adapted", "explicit-64KiB"])
def test_fedgkt_through_a_broker_with_a_128k_packet_limit(small_packet_broker: Broker, tmp_path: Path, chunk_size: int | None) -> None:
    cfg = server_config(tmp_path, run_id="small", agents=2, rounds=2, chunk_size_bytes=chunk_size,
                        method_config={"upload_batch_samples": 80})  # ~300 KB batches: several chunks each
    agents = [agent_config("small", i, 2, chunk_size_bytes=chunk_size) for i in range(2)]
    fed = mqtt_federation(cfg, agents, small_packet_broker.url)
    fed.start()
    report = fed.join(400)
    validate_report(report)
    assert report["status"] == "finished"
    for record in report["rounds"]:
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"] and record["samples"] == 160
    expected = chunk_size or LIMIT - CHUNK_HEADROOM_BYTES
    for transport in [fed.coordinator.transport, *(a.transport for a in fed.agents)]:
        assert transport.broker_max_packet_bytes == LIMIT
        assert transport.chunk_size_bytes == expected
        assert transport.connect_count == 1  # never disconnected for an oversized packet
    up = report["totals"]["server_connection"]
    assert up["chunks_in"] > up["messages_in"]  # uploads did travel in several chunks


def test_explicit_chunk_size_too_large_for_the_broker_fails_at_connect(small_packet_broker: Broker, tmp_path: Path) -> None:
    t = MqttTransport(TransportConfig(broker_url=small_packet_broker.url, chunk_size_bytes=512 * 1024, connect_timeout_s=10))
    with pytest.raises(TransportError, match=r"chunk_size_bytes 524288 does not fit the broker's Maximum Packet Size of 131072"):
        t.connect()
    # The server, from its config file: exit code 2 and the same message, at start, not mid-round.
    cfg = server_config(tmp_path, run_id="toolarge", agents=1, rounds=1, chunk_size_bytes=512 * 1024,
                        broker_url=small_packet_broker.url)
    toml = write_server_toml(tmp_path / "server.toml", cfg)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "cloud_server.cli", "run", "--config", str(toml), "--no-progress"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 2
    assert "chunk_size_bytes 524288" in result.stderr and "131072" in result.stderr, result.stderr[-2000:]


def test_url_credentials_and_launcher_flags_reach_both_configs(tmp_path: Path) -> None:
    from cloud_server.config import ServerConfig
    from cloud_server.launcher import build_parser, write_configs
    from edge_agent.config import EdgeConfig
    from shared_protocol.tomlio import read_toml

    args = build_parser().parse_args(["local", "--agents", "2", "--chunk-size", "65536",
                                      "--broker", "mqtt://fleet:s%40cret@127.0.0.1:1884"])
    server_toml, agent_tomls = write_configs(args, "creds", tmp_path, args.broker)
    server = ServerConfig.from_dict(read_toml(server_toml))
    assert server.transport_config().credentials == ("fleet", "s@cret") and server.chunk_size_bytes == 65536
    assert "s@cret" not in server_toml.read_text() and "s%40cret" not in server_toml.read_text()
    assert "***" not in str(server.to_dict()["broker_url"]) and "cret" not in str(server.to_dict())
    for path in agent_tomls:
        agent = EdgeConfig.from_dict(read_toml(path))
        assert agent.transport_config().credentials == ("fleet", "s@cret") and agent.chunk_size_bytes == 65536
    secret = tmp_path / "pw"
    secret.write_text("other\n")
    args = build_parser().parse_args(["local", "--username", "u", "--password-file", str(secret)])
    _, (agent_toml, *_) = write_configs(args, "creds2", tmp_path / "two", "mqtt://127.0.0.1:1884")
    assert EdgeConfig.from_dict(read_toml(agent_toml)).transport_config().credentials == ("u", "other")
    # A user:pass@ URL given straight to a config is used, not dropped, and never shown.
    config = TransportConfig(broker_url="mqtts://dev:pw@broker.example:8883")
    assert config.credentials == ("dev", "pw")
    with pytest.raises(ValueError, match="give it once"):
        TransportConfig(broker_url="mqtt://dev:pw@h:1", username="other")


def test_chunks_refused_while_the_budget_was_full_are_asked_for_again(mosquitto) -> None:  # type: ignore[no-untyped-def]
    """a holds most of the receiver's 2 MiB in a transfer it has not finished; b's upload
    arrives meanwhile and most of its chunks are refused (over_budget). a's transfer, the
    nearest to completion, still goes on; once it completes and frees its bytes, the
    receiver asks b for the missing chunks, and b's upload arrives whole."""
    up = {name: f"edgesplit/v1/rs/up/{name}" for name in "ab"}
    rx = MqttTransport(TransportConfig(broker_url=mosquitto.url, client_id="rx-rs", connect_timeout_s=10,
                                       max_transfer_bytes=2 << 20, max_reassembly_bytes=2 << 20,
                                       max_unexpected_transfer_bytes=64 << 10, resend_after_s=1.0))
    for topic in up.values():
        rx.expect_sender(topic, SenderLimits(3 << 19, 3 << 19, max_open_transfers=4))  # 1.5 MiB
    rx.subscribe("edgesplit/v1/rs/up/+")
    rx.connect()
    raw = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="raw-rs", protocol=mqtt.MQTTv5)
    raw.connect(mosquitto.host, mosquitto.port)
    raw.loop_start()
    b = MqttTransport(TransportConfig(broker_url=mosquitto.url, client_id="b-rs", chunk_size_bytes=64 << 10, connect_timeout_s=10))
    b.set_reply_topic("edgesplit/v1/rs/down/b")
    b.subscribe("edgesplit/v1/rs/down/b")
    b.connect()
    try:
        blob_a, blob_b = os.urandom(3 << 19), os.urandom(3 << 19)
        chunks_a = split_blob(blob_a, 64 << 10, transfer_id="a-held")
        for chunk in chunks_a[:-2]:  # 1,408 KiB of 1,536, not finished yet
            raw.publish(up["a"], chunk, qos=1).wait_for_publish(10)
        deadline = time.monotonic() + 10
        while rx.stats.chunks_in < len(chunks_a) - 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        b.publish(up["b"], blob_b)
        deadline = time.monotonic() + 10
        while rx.stats.chunks_in < len(chunks_a) - 2 + 24 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.rejections().get("over_budget", 0) >= 10  # most of b's chunks did not fit
        assert rx.receive(timeout_s=1) is None
        for chunk in chunks_a[-2:]:  # a finishes: it was nearest to completion, so it may
            raw.publish(up["a"], chunk, qos=1).wait_for_publish(10)
        got = {g.topic: g.payload for g in (rx.receive(timeout_s=30) for _ in range(2)) if g is not None}
        assert got == {up["a"]: blob_a, up["b"]: blob_b}
        assert b.stats.resent_chunks >= 10  # asked for again, not sent whole once more
    finally:
        raw.loop_stop()
        raw.disconnect()
        b.close()
        rx.close()
