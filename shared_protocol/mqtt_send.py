"""The MQTT transport's sending side: each blob is cut into chunks and published at
QoS 1 through one window of at most ``max_inflight_chunks`` unacknowledged chunks
across blobs (no drain between messages), the broker's acknowledgements (and
refusals) are tracked per packet id, and every blob sent is kept for resends."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from .chunked_blob import ChunkedBlob
from .mqtt_config import BrokerAddress, TransportConfig
from .mqtt_resend import ResendCache
from .transport_interface import TrafficStats, TransportError
from .wire_bytes import PUBACK_BYTES, publish_packet_bytes


class MqttSendWindow:
    """Publishing and flushing for :class:`~shared_protocol.mqtt_transport.MqttTransport`."""

    # Set up by MqttTransport.__init__ (mqtt_transport.py).
    config: TransportConfig
    address: BrokerAddress
    stats: TrafficStats
    chunk_size_bytes: int
    broker_max_packet_bytes: int | None
    _mqtt: Any
    _client: Any
    _reply_topic: str | None
    _publish_lock: threading.Lock
    _ack_cond: threading.Condition
    _pending: set[int]
    _early_acks: set[int]
    _nacked: dict[int, str]
    _window: deque[int]
    _unflushed: list[int]
    _sent: ResendCache

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        with self._ack_cond:
            if getattr(reason_code, "is_failure", False):
                self._nacked[mid] = str(reason_code)
            if mid in self._pending:
                self._pending.discard(mid)
            else:
                self._early_acks.add(mid)
            self._ack_cond.notify_all()

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
                payload = chunks.chunk(seq)  # hashes the blob as it goes: the digest rides on the last chunk
                info = self._client.publish(topic, payload, qos=1, retain=retain)
                if info.rc == self._mqtt.MQTT_ERR_QUEUE_SIZE:
                    raise TransportError("paho's outgoing queue is full")
                # When disconnected paho keeps QoS 1 messages and sends them on reconnect.
                wire_total += publish_packet_bytes(topic, len(payload), 1, 1)
                with self._ack_cond:
                    self._unflushed.append(info.mid)
                    if info.mid in self._early_acks:
                        self._early_acks.discard(info.mid)
                    else:
                        self._pending.add(info.mid)
                        self._window.append(info.mid)
                    # Chunks stay in flight across blobs: no pipeline drain between messages.
                    self._wait_acked(self._window, deadline, keep=self.config.max_inflight_chunks - 1)
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
            self._wait_acked(self._window, deadline, keep=0)
            refused = [self._nacked.pop(m) for m in self._unflushed if m in self._nacked]
            self._unflushed.clear()
        if refused:
            raise TransportError(f"broker refused {len(refused)} published chunk(s): {refused[0]}")

    def _wait_acked(self, window: deque[int], deadline: float, keep: int) -> None:
        """With ``_ack_cond`` held: block until at most ``keep`` mids of ``window`` are unacknowledged."""
        while True:
            while window and window[0] not in self._pending:
                window.popleft()
            outstanding = [m for m in window if m in self._pending]
            if len(outstanding) <= keep:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"{len(outstanding)} chunks not acknowledged by {self.address.url()} within "
                    f"{self.config.publish_timeout_s}s"
                )
            self._ack_cond.wait(min(remaining, 1.0))

    def drop_resend_cache(self) -> None:
        with self._publish_lock:
            self._sent.clear()
