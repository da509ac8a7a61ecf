"""The MQTT transport: one paho-mqtt 2.x client speaking MQTT v5 (QoS 1, persistent
session, last will, automatic reconnect with backoff, TLS and username/password).

This module owns the connection: the client's setup, connecting and reconnecting,
what the broker's CONNACK announces (its Maximum Packet Size, hence the chunk size;
the session expiry it grants) and the subscriptions. Sending through a bounded
window of chunks in flight (:mod:`.mqtt_send`), answering resend requests
(:mod:`.mqtt_resend`) and reassembling inbound chunks (:mod:`.mqtt_inbound`) are
mixins of :class:`MqttTransport`, each in its own module. Bytes are counted both
as payload and as MQTT packets on the wire (:mod:`.wire_bytes`).
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from typing import Any

from .chunk_format import DEFAULT_CHUNK_SIZE_BYTES
from .chunked_blob import ChunkedBlob
from .mqtt_config import BrokerAddress, TransportConfig, chunk_size_for, tls_context
from .mqtt_inbound import MqttInbound
from .mqtt_resend import MqttResendControl, ResendCache
from .mqtt_send import MqttSendWindow
from .reassembly import Reassembler
from .sender_policy import SenderLimits
from .transport_interface import Delivery, TrafficStats, Transport, TransportError

# The MQTT transport's modules log under the name they had as one module.
log = logging.getLogger("shared_protocol.transport")


class MqttTransport(MqttSendWindow, MqttInbound, MqttResendControl, Transport):
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
        self._pending: set[int] = set()
        self._early_acks: set[int] = set()
        self._nacked: dict[int, str] = {}  # mid -> reason the broker refused it (e.g. ACL)
        self._window: deque[int] = deque()  # mids in flight, across blobs
        self._unflushed: list[int] = []  # mids published since the last flush
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


def make_transport(config: TransportConfig) -> MqttTransport:
    return MqttTransport(config)
