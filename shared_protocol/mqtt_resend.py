"""The MQTT transport's control channel: a receiver missing chunks of a stalled transfer
asks the sender (on the transfer's reply topic) to resend them; the sender answers
from its :class:`ResendCache` of recently sent blobs. Control messages carry no
payload, only MQTT user properties."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from .chunk_format import P_CONTROL, P_SEQS, P_TRANSFER
from .chunked_blob import ChunkedBlob
from .transport_interface import TrafficStats

# The MQTT transport's modules log under the name they had as one module.
log = logging.getLogger("shared_protocol.transport")


class ResendCache:
    """Sent blobs by transfer id, for answering a receiver's resend request (chunks are re-cut
    from the blob on demand): the latest ``max_bytes`` of them, a blob larger than that never.
    Holds references to the blobs, not copies."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, tuple[str, ChunkedBlob]] = OrderedDict()  # transfer id -> (topic, blob)
        self.bytes = 0
        self._lock = threading.Lock()  # the network thread reads while the publishing thread adds

    def __len__(self) -> int:
        return len(self._blobs)

    def remember(self, topic: str, chunks: ChunkedBlob) -> None:
        if chunks.total_bytes > self.max_bytes:
            return
        with self._lock:
            self._blobs[chunks.transfer_id] = (topic, chunks)
            self.bytes += chunks.total_bytes
            while self.bytes > self.max_bytes:
                _, (_, old) = self._blobs.popitem(last=False)
                self.bytes -= old.total_bytes

    def get(self, transfer_id: str) -> tuple[str, ChunkedBlob] | None:
        with self._lock:
            return self._blobs.get(transfer_id)

    def clear(self) -> None:
        with self._lock:
            self._blobs.clear()
            self.bytes = 0


class MqttResendControl:
    """Sending and answering resend requests for :class:`~shared_protocol.mqtt_transport.MqttTransport`."""

    # Set up by MqttTransport.__init__ (mqtt_transport.py).
    stats: TrafficStats
    _client: Any
    _Properties: Any
    _PacketTypes: Any
    _sent: ResendCache

    def _send_control(self, topic: str, values: dict[str, str]) -> None:
        props = self._Properties(self._PacketTypes.PUBLISH)
        props.UserProperty = [(P_CONTROL, values["kind"]), (P_TRANSFER, values["tid"]), (P_SEQS, values["seqs"])]
        self._client.publish(topic, b"", qos=1, properties=props)

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
                self._client.publish(topic, chunks.chunk(seq), qos=1)
                self.stats.add(resent_chunks=1)
