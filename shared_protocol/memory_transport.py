"""The in-memory transport: the :class:`Transport` interface over an in-process
:class:`InMemoryBroker`, for fast unit tests of methods (one blob is one message,
delivered synchronously; bytes are counted as the MQTT transport would count them)."""

from __future__ import annotations

import queue
import threading
import time
import uuid

from .transport_interface import Delivery, TrafficStats, Transport
from .wire_bytes import PUBACK_BYTES, publish_packet_bytes


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT wildcard matching (+ one level, # the rest)."""
    f_parts, t_parts = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(f_parts):
        if part == "#":
            return True
        if i >= len(t_parts) or (part != "+" and part != t_parts[i]):
            return False
    return len(f_parts) == len(t_parts)


class InMemoryBroker:
    """Routes blobs between :class:`InMemoryTransport` instances in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, "InMemoryTransport"] = {}
        self._retained: dict[str, bytes] = {}
        self.published: list[tuple[str, int]] = []  # (topic, bytes): for assertions

    def attach(self, client: "InMemoryTransport") -> None:
        with self._lock:
            self._clients[client.client_id] = client

    def retained_matching(self, topic_filter: str) -> list[tuple[str, bytes]]:
        with self._lock:
            return [(t, b) for t, b in self._retained.items() if topic_matches(topic_filter, t)]

    def detach(self, client: "InMemoryTransport", send_will: bool) -> None:
        with self._lock:
            self._clients.pop(client.client_id, None)
        if send_will and client._will is not None:
            self.route(*client._will, retain=True)

    def route(self, topic: str, blob: bytes, retain: bool = False) -> None:
        with self._lock:
            self.published.append((topic, len(blob)))
            if retain:
                self._retained[topic] = blob
            clients = list(self._clients.values())
        for client in clients:
            client._offer(topic, blob)


class InMemoryTransport(Transport):
    def __init__(self, broker: InMemoryBroker, client_id: str) -> None:
        self.broker = broker
        self.client_id = client_id
        self.stats = TrafficStats()
        self._filters: list[str] = []
        self._inbox: queue.Queue[Delivery] = queue.Queue()
        self._will: tuple[str, bytes] | None = None
        self._connects = 0

    @property
    def connect_count(self) -> int:
        return self._connects

    def set_will(self, topic: str, blob: bytes) -> None:
        self._will = (topic, blob)

    def connect(self) -> None:
        self._connects += 1
        self.broker.attach(self)

    def close(self) -> None:
        self.broker.detach(self, send_will=False)

    def kill(self) -> None:
        self.broker.detach(self, send_will=True)

    def subscribe(self, topic_filter: str) -> None:
        self._filters.append(topic_filter)
        for topic, blob in self.broker.retained_matching(topic_filter):
            self._offer(topic, blob)

    def flush(self) -> None:
        """Delivery is synchronous in memory."""

    def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
        wire = publish_packet_bytes(topic, len(blob), 1, 1)
        self.stats.add(payload_bytes_out=len(blob), wire_bytes_out=wire, wire_bytes_in=PUBACK_BYTES, messages_out=1, chunks_out=1)
        self.broker.route(topic, bytes(blob), retain)

    def _offer(self, topic: str, blob: bytes) -> None:
        if any(topic_matches(f, topic) for f in self._filters):
            wire = publish_packet_bytes(topic, len(blob), 1, 1)
            self.stats.add(payload_bytes_in=len(blob), wire_bytes_in=wire, wire_bytes_out=PUBACK_BYTES, messages_in=1, chunks_in=1)
            self._inbox.put(Delivery(topic, blob, uuid.uuid4().hex, wire, time.time()))

    def receive(self, timeout_s: float | None = None) -> Delivery | None:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def backlog(self) -> int:
        return self._inbox.qsize()
