"""Cutting one outgoing blob into chunks (:class:`ChunkedBlob`).

The sender cuts chunks from a memoryview of the blob and hashes it incrementally
as chunks are cut, so the first chunk leaves before the blob is hashed and no
chunk is copied except into its own payload: a buffer the sender recycles once the
broker has acknowledged the chunk it carried, filled without holding the
interpreter lock.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np

from .chunk_format import CHUNK_FIXED_BYTES, DEFAULT_CHUNK_SIZE_BYTES, DIGEST_BYTES, MAX_TRANSFER_ID_BYTES, ChunkHeader, blob_hasher


class ChunkedBlob:
    """One outgoing blob, cut into chunk payloads on demand.

    Chunks are slices of a memoryview (the blob is not copied); the blob is
    hashed as chunks are cut in order, and the last chunk carries the digest.
    Thread-safe: the network thread may rebuild chunks for a resend request
    while the publishing thread is still cutting.
    """

    def __init__(self, blob: bytes, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                 transfer_id: str | None = None, reply_topic: str = "") -> None:
        if chunk_size_bytes <= 0:
            raise ValueError(f"chunk_size_bytes must be positive, got {chunk_size_bytes}")
        self.blob = blob
        self._view = memoryview(blob).cast("B")
        self.transfer_id = transfer_id or uuid.uuid4().hex
        if not 0 < len(self.transfer_id.encode()) <= MAX_TRANSFER_ID_BYTES:
            raise ValueError(f"transfer id must be 1..{MAX_TRANSFER_ID_BYTES} bytes, got {self.transfer_id!r}")
        self.chunk_size_bytes = chunk_size_bytes
        self.total_bytes = len(self._view)
        self.count = max(1, -(-self.total_bytes // chunk_size_bytes))
        self.reply_topic = reply_topic
        self._hasher = blob_hasher()
        self._hashed_upto = 0  # chunks [0, _hashed_upto) are in the hasher
        self._digest: bytes | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.count

    def body(self, seq: int) -> memoryview:
        return self._view[seq * self.chunk_size_bytes : (seq + 1) * self.chunk_size_bytes]

    def _hash_through(self, seq: int) -> bytes | None:
        """Hash chunks up to ``seq``; the blob's digest once every chunk is hashed."""
        with self._lock:
            while self._hashed_upto <= seq:
                self._hasher.update(self.body(self._hashed_upto))
                self._hashed_upto += 1
            if self._hashed_upto == self.count and self._digest is None:
                self._digest = self._hasher.digest()
            return self._digest

    @property
    def digest(self) -> bytes:
        """The whole blob's XXH3-128 digest (hashes what is not hashed yet)."""
        return self._hash_through(self.count - 1) or b""  # never empty: the last seq completes the hash

    def header(self, seq: int) -> ChunkHeader:
        if not 0 <= seq < self.count:
            raise IndexError(f"seq {seq} outside [0, {self.count})")
        digest = self._hash_through(seq)
        digest = digest if seq == self.count - 1 else None
        return ChunkHeader(self.transfer_id, seq, self.count, self.total_bytes, self.chunk_size_bytes, digest,
                           self.reply_topic)

    def chunk(self, seq: int) -> bytes:
        """The PUBLISH payload of chunk ``seq``: header + body (the one copy the broker client needs)."""
        return b"".join([self.header(seq).pack(), self.body(seq)])

    def payload_bytes(self, seq: int) -> int:
        """The length of chunk ``seq``'s payload (header and body)."""
        digest = DIGEST_BYTES if seq == self.count - 1 else 0
        return (CHUNK_FIXED_BYTES + len(self.transfer_id.encode()) + len(self.reply_topic.encode()) + digest
                + len(self.body(seq)))

    def chunk_into(self, seq: int, buffer: bytearray) -> bytes | bytearray:
        """Chunk ``seq``'s payload written into ``buffer`` when it has the payload's exact length
        (a sender's recycled buffer: no allocation, and the body is copied without holding the
        interpreter lock); otherwise :meth:`chunk`."""
        head, body = self.header(seq).pack(), self.body(seq)
        if len(buffer) != len(head) + len(body):
            return b"".join([head, body])
        buffer[: len(head)] = head
        np.frombuffer(buffer, np.uint8)[len(head) :] = np.frombuffer(body, np.uint8)
        return buffer

    def chunks(self) -> list[bytes]:
        return [self.chunk(seq) for seq in range(self.count)]


def split_blob(blob: bytes, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES, transfer_id: str | None = None,
               reply_topic: str = "") -> list[bytes]:
    """Cut ``blob`` into chunk payloads of at most ``chunk_size_bytes`` blob bytes each (at least one chunk)."""
    return ChunkedBlob(blob, chunk_size_bytes, transfer_id, reply_topic).chunks()
