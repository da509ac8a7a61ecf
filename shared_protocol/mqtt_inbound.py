"""The MQTT transport's receiving side: inbound chunks are counted, reassembled per
sender within the receiver's limits (:class:`~shared_protocol.reassembly.Reassembler`)
and queued as complete :class:`Delivery` objects; refused chunks are counted and
logged sparingly; a housekeeping thread expires dead transfers and asks senders to
resend the chunks of stalled ones."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from .chunk_format import P_CONTROL
from .errors import BudgetError, ProtocolError
from .mqtt_config import TransportConfig
from .reassembly import Reassembler
from .sender_policy import SenderLimits
from .transport_interface import Delivery, TrafficStats
from .wire_bytes import PUBACK_BYTES, publish_packet_bytes, user_properties_bytes

# The MQTT transport's modules log under the name they had as one module.
log = logging.getLogger("shared_protocol.transport")


class MqttInbound:
    """Receiving for :class:`~shared_protocol.mqtt_transport.MqttTransport`."""

    # Set up by MqttTransport.__init__ (mqtt_transport.py); the control channel's methods
    # come from MqttResendControl (mqtt_resend.py).
    config: TransportConfig
    stats: TrafficStats
    _closed: bool
    _inbox: queue.Queue[tuple[Delivery, int]]
    _reassembler: Reassembler
    _reasm_lock: threading.Lock
    _inbound_wire: dict[tuple[str, str], int]
    _queued_unexpected_bytes: int
    _rejections_lock: threading.Lock
    _rejected_by_reason: Counter[str]
    _rejected_by_source: OrderedDict[str, Counter[str]]
    _rejections_logged_at: float

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
