"""The MQTT transport against a real mosquitto on a free loopback port."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from types import SimpleNamespace

import pytest

from shared_protocol.mqtt.chunking import Reassembler, split_blob
from shared_protocol.transport import MqttTransport, TransportConfig, TransportError

pytestmark = pytest.mark.broker


def make(broker_url: str, client_id: str, **overrides) -> MqttTransport:  # type: ignore[no-untyped-def]
    cfg = TransportConfig(broker_url=broker_url, client_id=client_id, chunk_size_bytes=64 * 1024, connect_timeout_s=10, **overrides)
    t = MqttTransport(cfg)
    return t


def test_multi_megabyte_blob_arrives_intact_in_chunks(mosquitto) -> None:  # type: ignore[no-untyped-def]
    rx, tx = make(mosquitto.url, "rx"), make(mosquitto.url, "tx")
    rx.subscribe("t/big")
    rx.connect()
    tx.connect()
    try:
        blob = os.urandom(5 * 1024 * 1024 + 123)
        tx.publish("t/big", blob)
        got = rx.receive(timeout_s=30)
        assert got is not None and got.topic == "t/big"
        assert hashlib.sha256(got.payload).digest() == hashlib.sha256(blob).digest()
        chunks = -(-len(blob) // (64 * 1024))
        assert tx.stats.chunks_out == chunks and rx.stats.chunks_in == chunks
        assert tx.stats.payload_bytes_out == len(blob) == rx.stats.payload_bytes_in
        # Wire bytes: payload + per-chunk MQTT overhead, the same seen from both sides.
        assert len(blob) < tx.stats.wire_bytes_out < len(blob) * 1.02
        assert got.wire_bytes == tx.stats.wire_bytes_out
    finally:
        rx.close()
        tx.close()


def test_several_messages_keep_order_and_count(mosquitto) -> None:  # type: ignore[no-untyped-def]
    rx, tx = make(mosquitto.url, "rx2"), make(mosquitto.url, "tx2")
    rx.subscribe("t/+")
    rx.connect()
    tx.connect()
    try:
        blobs = [os.urandom(n) for n in (10, 70_000, 0, 200_000)]
        for b in blobs:
            tx.publish("t/x", b)
        got = [rx.receive(timeout_s=10) for _ in blobs]
        assert [g.payload for g in got if g] == blobs
    finally:
        rx.close()
        tx.close()


def test_duplicate_and_out_of_order_chunks_from_raw_client(mosquitto) -> None:  # type: ignore[no-untyped-def]
    """A raw paho client replays chunks out of order with duplicates; one blob comes out."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    rx = make(mosquitto.url, "rx3")
    rx.subscribe("t/raw")
    rx.connect()
    raw = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="raw", protocol=mqtt.MQTTv5)
    raw.connect(mosquitto.host, mosquitto.port)
    raw.loop_start()
    try:
        blob = os.urandom(300_000)
        chunks = split_blob(blob, 50_000)
        order = [3, 0, 5, 0, 1, 3, 2, 4]  # dupes of 0 and 3, shuffled
        for i in order:
            raw.publish("t/raw", chunks[i], qos=1).wait_for_publish(5)
        got = rx.receive(timeout_s=10)
        assert got is not None and got.payload == blob
        assert rx.receive(timeout_s=0.5) is None  # no second copy
        # A missing chunk: blob never delivered, seq listed as missing.
        partial = split_blob(os.urandom(100_000), 50_000, transfer_id="partial")
        raw.publish("t/raw", partial[0], qos=1).wait_for_publish(5)
        # A payload that is not a chunk is counted and dropped; the receiver carries on.
        raw.publish("t/raw", b"not a chunk", qos=1).wait_for_publish(5)
        time.sleep(0.5)
        assert rx.receive(timeout_s=0.5) is None
        assert rx._reassembler.missing("partial", source="t/raw") == [1]
        assert rx.stats.rejected_chunks == 1
    finally:
        raw.loop_stop()
        raw.disconnect()
        rx.close()


def test_transfer_completes_across_a_broker_restart(mosquitto) -> None:  # type: ignore[no-untyped-def]
    """The broker dies mid-transfer and comes back on the same port; the blob still arrives whole."""
    opts = dict(reconnect_min_s=0.2, reconnect_max_s=1, publish_timeout_s=60, resend_after_s=2.0)
    rx = make(mosquitto.url, "rx4", **opts)
    tx = make(mosquitto.url, "tx4", max_inflight_chunks=2, **opts)
    rx.set_reply_topic("t/rx4-ctl")
    tx.set_reply_topic("t/tx4-ctl")
    rx.subscribe("t/restart")
    tx.subscribe("t/tx4-ctl")
    rx.connect()
    tx.connect()
    blob = os.urandom(4 * 1024 * 1024)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            tx.publish("t/restart", blob)
        except TransportError as exc:  # recorded and asserted below
            errors.append(exc)

    sender = threading.Thread(target=send)
    try:
        sender.start()
        # Wait until part of the transfer went through, then restart the broker.
        deadline = time.monotonic() + 10
        while rx.stats.chunks_in < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.stats.chunks_in >= 8
        mosquitto.restart(down_s=0.5)
        sender.join(timeout=90)
        assert not sender.is_alive() and not errors
        # Chunks routed before the restart went to rx; those lost with the broker are
        # re-requested by rx from tx's reply topic (resend) once the transfer stalls.
        got = rx.receive(timeout_s=60)
        assert got is not None and got.payload == blob
        # The blob can be whole before both clients are back (every chunk routed before the
        # broker went down): their reconnects are still due, within their backoff.
        deadline = time.monotonic() + 30
        while (rx.connect_count < 2 or tx.connect_count < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rx.connect_count >= 2 and tx.connect_count >= 2
    finally:
        rx.close()
        tx.close()


def test_connect_to_nothing_fails_clearly() -> None:
    from tests.conftest import free_port

    t = make(f"mqtt://127.0.0.1:{free_port()}", "nobody")
    with pytest.raises(TransportError, match="cannot reach broker"):
        t.connect()


def test_last_will_published_when_client_vanishes(mosquitto) -> None:  # type: ignore[no-untyped-def]
    watcher = make(mosquitto.url, "watcher")
    watcher.subscribe("t/status/+")
    watcher.connect()
    doomed = make(mosquitto.url, "doomed", keepalive_s=1)
    doomed.set_will("t/status/doomed", b"offline")
    doomed.connect()
    try:
        doomed.kill()
        got = watcher.receive(timeout_s=10)
        assert got is not None and got.payload == b"offline"
    finally:
        watcher.close()


def test_retained_blob_must_fit_one_chunk(mosquitto) -> None:  # type: ignore[no-untyped-def]
    tx = make(mosquitto.url, "tx-retain")
    tx.connect()
    try:
        tx.publish("t/retained", b"small", retain=True)
        with pytest.raises(ValueError, match="one chunk"):
            tx.publish("t/retained", os.urandom(200 * 1024), retain=True)
    finally:
        tx.close()


@pytest.mark.parametrize("ack_first", [True, False])
def test_an_acknowledged_control_message_is_not_taken_for_a_later_chunk_with_its_packet_id(ack_first: bool) -> None:
    """paho numbers packets 1..65535 and reuses the numbers: the PUBACK of a resend request (or a
    resent chunk), whether it arrives before or after its publish returns, must not count as the
    acknowledgement of the chunk that next gets the same packet id, or a flush returns with that
    chunk unacknowledged. Positive control: a chunk's own early acknowledgement still counts."""
    t = MqttTransport(TransportConfig(broker_url="mqtt://127.0.0.1:1"))
    if ack_first:
        t._on_publish(None, None, 7, None, None)
        t._untrack(7)
    else:
        t._untrack(7)
        t._on_publish(None, None, 7, None, None)
    assert not t._early_acks and not t._untracked
    with t._ack_cond:
        t._track(7)  # the next chunk with packet id 7
    assert t._pending == {7}
    with pytest.raises(TransportError, match="1 chunks not acknowledged"):
        with t._ack_cond:
            t._wait_acked(time.monotonic() + 0.05, keep=0)
    t._on_publish(None, None, 7, None, None)
    assert not t._pending
    t._on_publish(None, None, 8, None, None)  # acknowledged before its publish returned
    with t._ack_cond:
        t._track(8)
        t._wait_acked(time.monotonic() + 0.05, keep=0)
    assert not t._pending and not t._early_acks
    t._untrack(9)  # a control message whose acknowledgement never comes (its session lost)
    with t._ack_cond:
        t._track(9)  # paho numbered a chunk 9 again
    t._on_publish(None, None, 9, None, None)
    assert not t._pending and not t._untracked


class _HoldingClient:
    """A stand-in for paho's client that keeps each payload, as paho does to send it again after a
    reconnect, until the test's broker thread acknowledges its packet id."""

    def __init__(self) -> None:
        self.mid = 0
        self.held: dict[int, tuple[bytes | bytearray, bytes]] = {}
        self.payloads: list[bytes | bytearray] = []
        self.sent: list[bytes] = []  # each payload's bytes when it was published
        self.at: dict[int, float] = {}
        self.lock = threading.Lock()

    def publish(self, topic: str, payload: bytes | bytearray, qos: int, retain: bool) -> SimpleNamespace:
        with self.lock:
            self.mid += 1
            self.held[self.mid] = (payload, bytes(payload))
            self.payloads.append(payload)
            self.sent.append(bytes(payload))
            self.at[self.mid] = time.monotonic()
            return SimpleNamespace(rc=0, mid=self.mid)


@pytest.mark.parametrize("early", [False, True])
def test_a_chunk_buffer_is_reused_only_once_the_broker_has_acknowledged_its_chunk(early: bool) -> None:
    """The sender writes chunks into recycled buffers: no buffer may change while paho still holds
    the chunk it carries (unacknowledged: paho would send the changed bytes after a reconnect),
    whether the acknowledgement comes after or before the publish call returns. Positive control:
    buffers are reused (fewer buffers than chunks), so the check had something to catch."""
    t = MqttTransport(TransportConfig(broker_url="mqtt://127.0.0.1:1", chunk_size_bytes=4096, max_inflight_chunks=4))
    client = _HoldingClient()
    t._client = client
    changed: list[int] = []
    stop = threading.Event()

    def broker() -> None:  # acknowledges the oldest chunk paho holds, checking it is still as sent
        while not stop.is_set():
            with client.lock:
                mid = min(client.held, default=None)
                if mid is not None and not early and len(client.held) < 3 and time.monotonic() < client.at[mid] + 0.005:
                    mid = None  # let a few pile up: acknowledgements well after their publish returned
                entry = client.held.pop(mid) if mid is not None else None
            if entry is None:
                time.sleep(0.0005)
                continue
            if bytes(entry[0]) != entry[1]:
                changed.append(mid)
            t._on_publish(None, None, mid, None, None)

    acker = threading.Thread(target=broker, daemon=True)
    acker.start()
    blobs = [os.urandom(10 * 4096 + 17 * i) for i in range(4)]
    try:
        for blob in blobs:
            t.publish("t/x", blob, wait=False)
        t.flush()
    finally:
        stop.set()
        acker.join(5)
    assert not changed, f"chunks {changed} changed while paho held them"
    recycled = [p for p in client.payloads if isinstance(p, bytearray)]
    assert len(recycled) >= len(blobs) * 9 and len({id(p) for p in recycled}) <= 4 + 2
    r = Reassembler()
    out = [r.add(sent, "t/x") for sent in client.sent]
    assert [bytes(b) for b in out if b is not None] == blobs
