"""The blobs an MQTT transport sent recently (:class:`ResendCache`), kept so that it can
answer a receiver that asks for the missing chunks of a stalled transfer."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .chunked_blob import ChunkedBlob


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
