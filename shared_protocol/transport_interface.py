"""The transport interface: what methods, agents and the coordinator see of the network.

:class:`Transport` is the interface methods and the coordinator use; they never
import paho. It moves whole blobs (:class:`Delivery` on the way in) and counts
them in :class:`TrafficStats`. Its implementations are
:class:`~shared_protocol.mqtt.transport.MqttTransport` and
:class:`~shared_protocol.memory_transport.InMemoryTransport`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from .sender_policy import SenderLimits


class TransportError(RuntimeError):
    """The transport could not do what was asked (not connected in time, publish not acknowledged)."""


@dataclass(frozen=True)
class Delivery:
    """One complete inbound blob (read-only bytes or a read-only view of them)."""

    topic: str
    payload: bytes | memoryview
    transfer_id: str
    wire_bytes: int
    received_at: float


@dataclass
class TrafficStats:
    payload_bytes_out: int = 0
    wire_bytes_out: int = 0
    payload_bytes_in: int = 0
    wire_bytes_in: int = 0
    messages_out: int = 0
    messages_in: int = 0
    chunks_out: int = 0
    chunks_in: int = 0
    rejected_chunks: int = 0
    resent_chunks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class Transport(ABC):
    """What methods, agents and the coordinator see of the network."""

    stats: TrafficStats

    @abstractmethod
    def connect(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def subscribe(self, topic_filter: str) -> None: ...

    @abstractmethod
    def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
        """Send one blob. With ``wait`` (the default), return once the broker
        acknowledged every chunk; without, return as soon as its chunks are in
        flight (at most ``max_inflight_chunks`` across all blobs, so memory stays
        bounded) and call :meth:`flush` after a stream of publishes.

        ``reply_topic`` (default: the one set by ``set_reply_topic``) is where the
        receiver may ask for missing chunks; it must be a topic this client reads
        and the receiver may write (the server uses the agent's own up topic).
        """

    @abstractmethod
    def flush(self) -> None:
        """Block until every chunk published so far is acknowledged; raise if any was refused."""

    @abstractmethod
    def receive(self, timeout_s: float | None = None) -> Delivery | None:
        """Next complete inbound blob, or None after ``timeout_s``."""

    @abstractmethod
    def set_will(self, topic: str, blob: bytes) -> None:
        """Blob the broker publishes (retained) if this client vanishes. Call before connect."""

    @property
    @abstractmethod
    def connect_count(self) -> int:
        """Successful (re)connections so far; a change means we reconnected."""

    def expect_sender(self, source: str, limits: SenderLimits | None) -> None:
        """State what the sender publishing on topic ``source`` may send at a time (None:
        nothing stated). A transport that does not reassemble chunks ignores it."""

    def block_sender(self, source: str, why: str) -> None:
        """Drop everything that arrives on topic ``source`` from now on, unread."""

    def rejections(self) -> dict[str, int]:
        """Chunks refused below the message layer so far, by error code."""
        return {}

    def inbound_progress(self, source: str) -> tuple[int, int]:
        """(incomplete transfers, bytes of them held) from topic ``source`` now."""
        return 0, 0

    def backlog(self) -> int:
        """Complete inbound messages received and not yet taken by ``receive``."""
        return 0

    def drop_resend_cache(self) -> None:
        """Forget every blob kept for answering resend requests (the MQTT transport keeps the
        latest ``resend_cache_bytes`` of them): for a caller that knows none of them can be
        asked for any more."""
