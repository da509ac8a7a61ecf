"""The MQTT transport: one paho-mqtt 2.x client speaking MQTT v5 (QoS 1, persistent
session, last will, automatic reconnect with backoff, TLS and username/password).

This module owns the connection: the client's setup, connecting and reconnecting,
what the broker's CONNACK announces (its Maximum Packet Size, hence the chunk size;
the session expiry it grants) and the subscriptions. Sending through a bounded
window of chunks in flight, answering resend requests (from the
:class:`~shared_protocol.mqtt.resend.ResendCache` of blobs sent) and reassembling
inbound chunks (:class:`~shared_protocol.mqtt.reassembly.Reassembler`) are sections of the
one :class:`MqttTransport` class. Bytes are counted both as payload and as MQTT
packets on the wire (:mod:`.wire_bytes`).
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
import uuid
from collections import Counter, OrderedDict
from typing import Any

from ..errors import BudgetError, ProtocolError
from ..sender_policy import SenderLimits
from ..transport_interface import Delivery, TrafficStats, Transport, TransportError
from ..wire_bytes import PUBACK_BYTES, publish_packet_bytes, user_properties_bytes
from .chunk_format import DEFAULT_CHUNK_SIZE_BYTES, P_CONTROL, P_SEQS, P_TRANSFER
from .chunked_blob import ChunkedBlob
from .config import BrokerAddress, TransportConfig, chunk_size_for, tls_context
from .reassembly import Reassembler
from .resend import ResendCache

# The MQTT transport's modules log under the name they had as one module.
log = logging.getLogger("shared_protocol.transport")


class MqttTransport(Transport):
    """The MQTT implementation of :class:`Transport` (see the module's docstring)."""

    def __init__(self, config: TransportConfig) -> None:
        import paho.mqtt.client as mqtt  # imported here so the in-memory path needs no paho
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._mqtt = mqtt
        self._Properties = Properties
        self._PacketTypes = PacketTypes
        self.config = config
        self.address = BrokerAddress.parse(config.broker_url)
        self.client_id = config.client_id or f"es-{uuid.uuid4().hex[:12]}"
        self.stats = TrafficStats()
        self._inbox: queue.Queue[tuple[Delivery, int]] = queue.Queue()  # (delivery, bytes charged to the unexpected pool)
        unexpected = None
        if config.max_unexpected_transfer_bytes is not None:
            unexpected = SenderLimits(config.max_unexpected_transfer_bytes, config.max_unexpected_transfer_bytes, 4)
        self._reassembler = Reassembler(
            config.max_transfer_bytes, config.max_reassembly_bytes, config.transfer_timeout_s,
            unexpected=unexpected,
            unexpected_total_bytes=config.max_unexpected_total_bytes if unexpected is not None else None,
            max_invalid_transfers=config.max_invalid_transfers, ignore_s=config.ignore_invalid_s,
        )
        self._reassembler.on_ignore = self._on_ignore
        self._rejected_by_source: OrderedDict[str, Counter[str]] = OrderedDict()  # not logged yet, per topic
        self._rejections_logged_at = time.monotonic()
        self._rejections_lock = threading.Lock()
        self._rejected_by_reason: Counter[str] = Counter()
        self._queued_unexpected_bytes = 0  # complete blobs from unexpected senders waiting in the inbox
        # From the broker's CONNACK: its Maximum Packet Size (None: it announced none) and the
        # chunk size that follows from it and the config.
        self.broker_max_packet_bytes: int | None = None
        self.chunk_size_bytes = config.chunk_size_bytes or DEFAULT_CHUNK_SIZE_BYTES
        self.granted_session_expiry_s: int | None = None
        self._subscriptions: list[str] = []
        self._lock = threading.Lock()
        self._ack_cond = threading.Condition(self._lock)
        self._pending: set[int] = set()  # chunks' mids not acknowledged yet, across blobs
        self._early_acks: set[int] = set()
        self._untracked: set[int] = set()  # mids of control messages and resent chunks: acks not waited for
        self._nacked: dict[int, str] = {}  # mid -> reason the broker refused it (e.g. ACL)
        # Chunk payload buffers: free ones, and those paho holds until the broker acknowledges them.
        self._pool: list[bytearray] = []
        self._lent: dict[int, bytearray] = {}
        # A waiting sender is woken when at most this many chunks are unacknowledged (None: nobody waits).
        self._wake_at: int | None = None
        self._refused = threading.Event()
        self._sub_cond = threading.Condition()
        self._suback_pending: set[int] = set()
        self._early_subacks: set[int] = set()
        self._connected = threading.Event()
        self._connect_count = 0
        self._refused_reason: str | None = None
        self._closed = False
        self._publish_lock = threading.Lock()  # one blob at a time keeps the window meaningful
        self._inbound_wire: dict[tuple[str, str], int] = {}
        self._sent = ResendCache(config.resend_cache_bytes)
        self._reply_topic: str | None = None
        self._reasm_lock = threading.Lock()  # network thread and housekeeping thread
        self._housekeeper = threading.Thread(target=self._housekeeping, name=f"{self.client_id}-housekeeping", daemon=True)

        client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=True,
        )
        client.max_inflight_messages_set(max(20, config.max_inflight_chunks))
        client.reconnect_delay_set(
            min_delay=max(1, int(config.reconnect_min_s)), max_delay=max(1, int(config.reconnect_max_s))
        )
        username, password = config.credentials
        if username is not None or password is not None:
            # mod_mqtt (ejabberd) and others refuse a login without a password; paho sends one only if given.
            client.username_pw_set(username or "", password)
        if self.address.tls:
            client.tls_set_context(tls_context(config))
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        self._client = client

    # -- lifecycle --------------------------------------------------------- #

    @property
    def connect_count(self) -> int:
        return self._connect_count

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def set_reply_topic(self, topic: str) -> None:
        """Topic on which this client listens; receivers send resend requests there."""
        self._reply_topic = topic

    def set_will(self, topic: str, blob: bytes) -> None:
        chunks = ChunkedBlob(blob, self.chunk_size_bytes)
        if len(chunks) > 1:
            raise ValueError("a last-will blob must fit in one chunk")
        self._client.will_set(topic, chunks.chunk(0), qos=1, retain=True)

    def connect(self) -> None:
        props = self._Properties(self._PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.config.session_expiry_s
        try:
            self._client.connect(
                self.address.host,
                self.address.port,
                keepalive=self.config.keepalive_s,
                clean_start=False,
                properties=props,
            )
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot reach broker {self.address.url()}: {exc}") from exc
        self._client.loop_start()
        if not self._housekeeper.is_alive():
            self._housekeeper.start()
        deadline = time.monotonic() + self.config.connect_timeout_s
        while not self._connected.is_set() and not self._refused.is_set() and time.monotonic() < deadline:
            self._connected.wait(0.05)
        if not self._connected.is_set():
            self._client.loop_stop()
            if self._refused.is_set():
                raise TransportError(f"cannot use broker {self.address.url()}: {self._refused_reason}")
            reason = self._refused_reason or "no CONNACK (wrong port, or TLS expected?)"
            raise TransportError(f"could not connect to {self.address.url()} within {self.config.connect_timeout_s}s: {reason}")
        self._wait_subscribed(deadline)

    def close(self) -> None:
        self._closed = True
        self._client.disconnect()
        self._client.loop_stop()

    def kill(self) -> None:
        """Drop the connection without DISCONNECT (the broker then sends the will). For tests."""
        self._closed = True
        self._client.loop_stop()
        sock = self._client.socket()
        if sock is not None:
            sock.close()

    # -- paho callbacks (network thread) ----------------------------------- #

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._refused_reason = str(reason_code)
            log.warning("broker %s refused connection: %s", self.address.url(), reason_code)
            if str(reason_code) in ("Not authorized", "Bad user name or password"):
                client.disconnect()  # retrying with the same credentials cannot succeed
                self._refused.set()
            return
        limit = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        try:
            chunk_size = chunk_size_for(limit, self.config.chunk_size_bytes)
        except ValueError as exc:
            # Every chunk would make the broker drop the connection: fail now, saying why.
            self._refused_reason = str(exc)
            log.error("broker %s: %s", self.address.url(), exc)
            client.disconnect()
            self._refused.set()
            return
        if chunk_size != self.chunk_size_bytes or limit != self.broker_max_packet_bytes:
            log.info("broker %s announces a Maximum Packet Size of %s; chunks carry %d bytes", self.address.url(),
                     "none" if limit is None else f"{limit} bytes", chunk_size)
        self.broker_max_packet_bytes, self.chunk_size_bytes = limit, chunk_size
        granted = getattr(properties, "SessionExpiryInterval", None) if properties is not None else None
        granted = self.config.session_expiry_s if granted is None else int(granted)  # absent: ours stands
        if granted < self.config.session_expiry_s and granted != self.granted_session_expiry_s:
            log.warning(
                "broker %s granted a session expiry of %d s, not the %d s asked for: if this client is disconnected "
                "for longer than %d s the broker discards its session and the messages queued for it (an agent "
                "then misses what the server sent meanwhile and redoes its round; raise the broker's limit, e.g. "
                "ejabberd's mod_mqtt session_expiry)", self.address.url(), granted, self.config.session_expiry_s, granted,
            )
        self.granted_session_expiry_s = granted
        # The broker may have restarted without our session: always resubscribe.
        for topic_filter in self._subscriptions:
            self._track_subscribe(client.subscribe(topic_filter, qos=1))
        self._connect_count += 1
        self._connected.set()
        log.info("connected to %s as %s (connection %d)", self.address.url(), self.client_id, self._connect_count)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connected.clear()
        if not self._closed and not self._refused.is_set():
            log.warning("disconnected from %s (%s); reconnecting", self.address.url(), reason_code)

    # -- subscriptions ----------------------------------------------------- #

    def subscribe(self, topic_filter: str) -> None:
        self._subscriptions.append(topic_filter)
        if self.connected:
            self._track_subscribe(self._client.subscribe(topic_filter, qos=1))
            self._wait_subscribed(time.monotonic() + self.config.connect_timeout_s)

    def _track_subscribe(self, result: tuple[Any, int | None]) -> None:
        _rc, mid = result
        if mid is not None:
            with self._sub_cond:
                if mid in self._early_subacks:
                    self._early_subacks.discard(mid)
                else:
                    self._suback_pending.add(mid)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        with self._sub_cond:
            if mid in self._suback_pending:
                self._suback_pending.discard(mid)
            else:
                self._early_subacks.add(mid)
            self._sub_cond.notify_all()

    def _wait_subscribed(self, deadline: float) -> None:
        """Messages published to our topics after this returns reach us: the broker acknowledged the subscriptions."""
        with self._sub_cond:
            while self._suback_pending and time.monotonic() < deadline:
                self._sub_cond.wait(0.05)

    # -- sending: each blob cut into chunks and published at QoS 1 through one window of at most
    # ``max_inflight_chunks`` unacknowledged chunks across blobs (no drain between messages); the
    # broker's acknowledgements (and refusals) tracked per packet id; every blob sent kept for resends.
    # Control messages and resent chunks are not waited for: their acknowledgements must not be
    # taken for a later chunk's once paho reuses the packet id.

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        with self._ack_cond:
            if mid in self._untracked:
                self._untracked.discard(mid)
                return
            if getattr(reason_code, "is_failure", False):
                self._nacked[mid] = str(reason_code)
            if mid in self._pending:
                self._pending.discard(mid)
                self._recycle(self._lent.pop(mid, None))
            else:
                self._early_acks.add(mid)
            if self._wake_at is not None and len(self._pending) <= self._wake_at:
                self._ack_cond.notify_all()

    def _track(self, mid: int | None, payload: bytes | bytearray | None = None) -> None:
        """With ``_ack_cond`` held: a chunk's mid, waited for (paho numbers anew: an untracked
        message's acknowledgement that never came is not this chunk's). A payload written into a
        recycled buffer goes back to the pool once the broker has it (paho keeps it until then,
        to send it again after a reconnect)."""
        self._untracked.discard(mid)
        lent = payload if isinstance(payload, bytearray) else None
        if mid in self._early_acks:
            self._early_acks.discard(mid)
            self._recycle(lent)
        elif mid is not None:
            self._pending.add(mid)
            if lent is not None:
                self._lent[mid] = lent

    def _recycle(self, buffer: bytearray | None) -> None:
        """With ``_ack_cond`` held: an acknowledged chunk's buffer, free for a later chunk."""
        if buffer is not None and len(self._pool) <= self.config.max_inflight_chunks:
            self._pool.append(buffer)

    def _buffer(self, size: int) -> bytearray:
        """A free buffer of ``size`` bytes for a full chunk's payload (the pool keeps one size:
        when the chunk size changes, say on a broker with another packet limit, it starts anew)."""
        with self._ack_cond:
            if self._pool and len(self._pool[-1]) != size:
                self._pool.clear()
            if self._pool:
                return self._pool.pop()
        return bytearray(size)

    def _untrack(self, mid: int | None) -> None:
        """A control message's or a resent chunk's mid: its acknowledgement is not waited for."""
        with self._ack_cond:
            if mid in self._early_acks:
                self._early_acks.discard(mid)
                self._nacked.pop(mid, None)
            elif mid is not None:
                self._untracked.add(mid)

    def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
        # A caller's bytearray could change under chunks still in flight or kept for resends.
        chunks = ChunkedBlob(blob if isinstance(blob, bytes) else bytes(blob), self.chunk_size_bytes,
                             reply_topic=reply_topic or self._reply_topic or "")
        if retain and len(chunks) > 1:
            # The broker retains one message per topic: only the last chunk would survive.
            raise ValueError(f"a retained blob must fit in one chunk ({len(blob)} > {self.chunk_size_bytes} bytes)")
        if self.broker_max_packet_bytes is not None:
            # mosquitto, like most brokers, drops the connection on an oversized packet (paho does not check).
            largest = publish_packet_bytes(topic, len(chunks.header(0).pack()) + min(len(blob), chunks.chunk_size_bytes) + 32, 1, 1)
            if largest > self.broker_max_packet_bytes:
                raise TransportError(
                    f"a chunk on {topic} would be a {largest}-byte packet, over the broker's Maximum Packet Size of "
                    f"{self.broker_max_packet_bytes} bytes (topic or reply topic too long for chunk_size_bytes "
                    f"{self.chunk_size_bytes})"
                )
        deadline = time.monotonic() + self.config.publish_timeout_s
        wire_total = 0
        with self._publish_lock:
            self._sent.remember(topic, chunks)
            for seq in range(len(chunks)):
                # Hashes the blob as it goes: the digest rides on the last chunk. Full chunks (all
                # of one size) go in recycled buffers; a blob's last, shorter chunk is made anew.
                last = seq == len(chunks) - 1
                payload = chunks.chunk(seq) if last else chunks.chunk_into(seq, self._buffer(chunks.payload_bytes(seq)))
                info = self._client.publish(topic, payload, qos=1, retain=retain)
                if info.rc == self._mqtt.MQTT_ERR_QUEUE_SIZE:
                    raise TransportError("paho's outgoing queue is full")
                # When disconnected paho keeps QoS 1 messages and sends them on reconnect.
                wire_total += publish_packet_bytes(topic, len(payload), 1, 1)
                with self._ack_cond:
                    self._track(info.mid, payload)
                    # Chunks stay in flight across blobs: no pipeline drain between messages.
                    self._wait_acked(deadline, keep=self.config.max_inflight_chunks - 1)
            self.stats.add(
                payload_bytes_out=len(blob),
                wire_bytes_out=wire_total,
                wire_bytes_in=PUBACK_BYTES * len(chunks),
                messages_out=1,
                chunks_out=len(chunks),
            )
            if wait:
                self._flush_locked(deadline)

    def flush(self) -> None:
        with self._publish_lock:
            self._flush_locked(time.monotonic() + self.config.publish_timeout_s)

    def _flush_locked(self, deadline: float) -> None:
        with self._ack_cond:
            self._wait_acked(deadline, keep=0)
            # Every chunk is acknowledged by now: the refusals recorded are this flush's chunks'.
            refused = list(self._nacked.values())
            self._nacked.clear()
        if refused:
            raise TransportError(f"broker refused {len(refused)} published chunk(s): {refused[0]}")

    def _wait_acked(self, deadline: float, keep: int) -> None:
        """With ``_ack_cond`` held: block until at most ``keep`` chunks are unacknowledged."""
        try:
            while len(self._pending) > keep:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"{len(self._pending)} chunks not acknowledged by {self.address.url()} within "
                        f"{self.config.publish_timeout_s}s"
                    )
                self._wake_at = keep
                self._ack_cond.wait(min(remaining, 1.0))
        finally:
            self._wake_at = None

    def drop_resend_cache(self) -> None:
        with self._publish_lock:
            self._sent.clear()

    # -- receiving: inbound chunks counted, reassembled per sender within the receiver's limits and
    # queued as complete deliveries; refused chunks counted and logged sparingly; a housekeeping
    # thread expires dead transfers and asks senders to resend the chunks of stalled ones.

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        props = message.properties
        user_props = getattr(props, "UserProperty", None) if props is not None else None
        payload = message.payload
        wire = publish_packet_bytes(message.topic, len(payload), message.qos, user_properties_bytes(user_props or []))
        self.stats.add(wire_bytes_in=wire + (PUBACK_BYTES if message.qos else 0), wire_bytes_out=PUBACK_BYTES if message.qos else 0, chunks_in=1)
        if user_props:  # chunks carry their header in the payload; only control messages have properties
            values = dict(user_props)
            control = values.get(P_CONTROL)
            if control is not None:
                self._handle_control(control, values)
                return
        topic = message.topic
        with self._reasm_lock:
            try:
                header, body = self._reassembler.parse(payload, source=topic)
                key = (topic, header.transfer_id)
                blob = self._reassembler.add_chunk(header, body, source=topic)
            except ProtocolError as exc:
                self._rejected_chunk(topic, exc)
                return
            self._inbound_wire[key] = self._inbound_wire.get(key, 0) + wire
            if blob is None:
                return
            total_wire = self._inbound_wire.pop(key, wire)
            charged = 0
            if not self._reassembler.is_expected(topic):
                # Complete blobs from senders nobody expects wait in the inbox within the same small pool.
                if self._queued_unexpected_bytes + len(blob) > self._reassembler.unexpected_total_bytes:
                    self._rejected_chunk(topic, BudgetError(
                        f"a {len(blob)}-byte message on {topic} would exceed the {self._reassembler.unexpected_total_bytes}"
                        f"-byte bound on queued messages from unexpected senders; dropped"))
                    return
                charged = len(blob)
                self._queued_unexpected_bytes += charged
        self.stats.add(payload_bytes_in=len(blob), messages_in=1)
        self._inbox.put((Delivery(topic, blob, header.transfer_id, total_wire, time.time()), charged))

    def _rejected_chunk(self, topic: str, exc: ProtocolError) -> None:
        """Count a refused chunk; log the first per topic, then at most a summary a minute."""
        self.stats.add(rejected_chunks=1)
        with self._rejections_lock:
            self._rejected_by_reason[exc.code] += 1
            if topic not in self._rejected_by_source and len(self._rejected_by_source) >= 256:
                topic = "(other topics)"  # a flood from ever new topic names is summarised, not logged per name
            pending = self._rejected_by_source.get(topic)
            if pending is None:
                log.warning("rejected chunk on %s (%s): %s; further rejections on this topic are summarised once a minute",
                            topic, exc.code, exc)
                self._rejected_by_source[topic] = Counter()
            else:
                pending[exc.code] += 1

    def _log_rejection_summary(self) -> None:
        with self._rejections_lock:
            for topic, counts in self._rejected_by_source.items():
                if counts:
                    log.warning("rejected %d more chunks on %s in the last %.0f s (%s)", sum(counts.values()), topic,
                                time.monotonic() - self._rejections_logged_at,
                                ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
                    counts.clear()
            self._rejections_logged_at = time.monotonic()

    def _on_ignore(self, source: str, counts: dict[str, int]) -> None:
        log.warning("ignoring everything on %s for %.0f s: it sent %d invalid transfers (%s); what it sends meanwhile "
                    "is counted as ignored_sender, not logged", source, self.config.ignore_invalid_s, sum(counts.values()),
                    ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))

    def _housekeeping(self) -> None:
        """Expire dead transfers; ask senders to resend the chunks of stalled ones."""
        interval = max(0.2, min(1.0, self.config.resend_after_s / 4))
        asked: dict[tuple[str, str], float] = {}
        while not self._closed:
            time.sleep(interval)
            requests = []
            with self._reasm_lock:
                self._reassembler.expire()
                if len(self._inbound_wire) > len(self._reassembler.open_transfers()):
                    # Transfers evicted, expired or refused: their wire counts go with them.
                    live = set(self._reassembler.open_transfers())
                    self._inbound_wire = {k: v for k, v in self._inbound_wire.items() if k in live}
                    asked = {k: v for k, v in asked.items() if k in live}
                now = time.monotonic()
                strict = self.config.max_unexpected_transfer_bytes is not None
                for source, tid, missing in self._reassembler.stalled(self.config.resend_after_s):
                    if strict and not self._reassembler.is_expected(source):
                        continue  # a stranger's chunks name any reply topic they like: never publish there
                    reply = self._reassembler.reply_topic(tid, source)
                    if reply and missing and now - asked.get((source, tid), 0.0) >= self.config.resend_after_s:
                        asked[(source, tid)] = now
                        requests.append((reply, tid, missing))
            if time.monotonic() - self._rejections_logged_at >= 60.0:
                self._log_rejection_summary()
            for reply, tid, missing in requests:
                if self.connected:
                    log.info("asking %s to resend %d chunks of transfer %s", reply, len(missing), tid)
                    self._send_control(reply, {"kind": "resend", "tid": tid, "seqs": ",".join(map(str, missing[:2000]))})

    def receive(self, timeout_s: float | None = None) -> Delivery | None:
        try:
            delivery, charged = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if charged:
            with self._reasm_lock:
                self._queued_unexpected_bytes -= charged
        return delivery

    def expect_sender(self, source: str, limits: SenderLimits | None) -> None:
        with self._reasm_lock:
            self._reassembler.expect(source, limits)

    def block_sender(self, source: str, why: str) -> None:
        with self._reasm_lock:
            self._reassembler.block(source, why)

    def rejections(self) -> dict[str, int]:
        with self._rejections_lock:
            return dict(self._rejected_by_reason)

    def inbound_progress(self, source: str) -> tuple[int, int]:
        with self._reasm_lock:
            return len(self._reassembler.open_transfers(source)), self._reassembler.held_by(source)

    def backlog(self) -> int:
        return self._inbox.qsize()

    # -- the control channel: a receiver missing chunks of a stalled transfer asks the sender (on the
    # transfer's reply topic) to resend them; the sender answers from its ResendCache.

    def _send_control(self, topic: str, values: dict[str, str]) -> None:
        props = self._Properties(self._PacketTypes.PUBLISH)
        props.UserProperty = [(P_CONTROL, values["kind"]), (P_TRANSFER, values["tid"]), (P_SEQS, values["seqs"])]
        self._untrack(self._client.publish(topic, b"", qos=1, properties=props).mid)

    def _handle_control(self, kind: str, values: dict[str, str]) -> None:
        if kind != "resend":
            log.warning("unknown transport control message %r ignored", kind)
            return
        entry = self._sent.get(values.get(P_TRANSFER, ""))
        if entry is None:
            log.warning("resend requested for unknown or evicted transfer %s", values.get(P_TRANSFER))
            return
        topic, chunks = entry
        try:
            seqs = sorted({int(s) for s in values.get(P_SEQS, "").split(",") if s})
        except ValueError:
            log.warning("malformed resend request ignored")
            return
        for seq in seqs:
            if 0 <= seq < len(chunks):
                # Fire and forget from the network thread: never block it on acks.
                self._untrack(self._client.publish(topic, chunks.chunk(seq), qos=1).mid)
                self.stats.add(resent_chunks=1)


def make_transport(config: TransportConfig) -> MqttTransport:
    return MqttTransport(config)
