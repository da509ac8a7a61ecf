"""Splitting blobs into chunks below the broker's packet limit, and putting
them back together safely.

Each chunk carries, as MQTT v5 user properties: transfer id, seq, count, total
bytes and the whole blob's sha256. The :class:`Reassembler` accepts chunks in
any order, drops duplicates (QoS 1 delivers at least once), bounds memory per
transfer and in total, expires transfers that stall, can list the seqs still
missing, and hands a blob up only after its sha256 matches.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from .errors import ChunkError, HashMismatchError, LengthMismatchError, SizeLimitError

DEFAULT_CHUNK_SIZE_BYTES = 512 * 1024

# User-property keys. Short: they are repeated on every chunk.
P_TRANSFER, P_SEQ, P_COUNT, P_TOTAL, P_SHA = "es-tid", "es-seq", "es-cnt", "es-len", "es-sha"
P_REPLY = "es-reply"  # where the receiver may ask for missing seqs
P_CONTROL = "es-ctl"  # control messages of the transport itself (resend requests)


@dataclass(frozen=True)
class ChunkHeader:
    transfer_id: str
    seq: int
    count: int
    total_bytes: int
    sha256: str

    def properties(self) -> list[tuple[str, str]]:
        return [
            (P_TRANSFER, self.transfer_id),
            (P_SEQ, str(self.seq)),
            (P_COUNT, str(self.count)),
            (P_TOTAL, str(self.total_bytes)),
            (P_SHA, self.sha256),
        ]

    @classmethod
    def from_properties(cls, props: list[tuple[str, str]] | None) -> "ChunkHeader":
        values = dict(props or [])
        try:
            tid, seq, count = values[P_TRANSFER], int(values[P_SEQ]), int(values[P_COUNT])
            total, digest = int(values[P_TOTAL]), values[P_SHA]
        except KeyError as missing:
            raise ChunkError(f"chunk lacks user property {missing}") from None
        except ValueError:
            raise ChunkError(f"chunk has non-integer seq/count/length: {values}") from None
        if not (0 < len(tid) <= 64) or len(digest) != 64:
            raise ChunkError("chunk transfer id or sha256 has the wrong length")
        if count < 1 or not (0 <= seq < count) or total < 0:
            raise ChunkError(f"chunk seq {seq} / count {count} / length {total} is inconsistent")
        return cls(tid, seq, count, total, digest)


def split_blob(blob: bytes, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES, transfer_id: str | None = None) -> list[tuple[ChunkHeader, bytes]]:
    """Cut ``blob`` into chunks of at most ``chunk_size_bytes`` (at least one chunk)."""
    if chunk_size_bytes <= 0:
        raise ValueError(f"chunk_size_bytes must be positive, got {chunk_size_bytes}")
    tid = transfer_id or uuid.uuid4().hex
    digest = hashlib.sha256(blob).hexdigest()
    count = max(1, -(-len(blob) // chunk_size_bytes))
    return [
        (ChunkHeader(tid, seq, count, len(blob), digest), blob[seq * chunk_size_bytes : (seq + 1) * chunk_size_bytes])
        for seq in range(count)
    ]


@dataclass
class _Transfer:
    header: ChunkHeader
    started_at: float
    updated_at: float
    parts: dict[int, bytes] = field(default_factory=dict)
    received_bytes: int = 0
    # Hash as chunks arrive in order, so completing a blob does not hash it all at once.
    hasher: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    hashed_upto: int = 0  # seqs [0, hashed_upto) are in the hasher


@dataclass
class ReassemblyStats:
    completed: int = 0
    duplicates: int = 0
    rejected: int = 0
    expired: int = 0


class Reassembler:
    """Collects chunks per (source, transfer id) until a blob is complete.

    ``source`` is the topic (or sender) a chunk came from, so one sender cannot
    write into another's transfer. Not thread-safe: one network thread feeds it.
    """

    def __init__(
        self,
        max_transfer_bytes: int = 256 * 1024 * 1024,
        max_total_bytes: int = 1024 * 1024 * 1024,
        timeout_s: float = 120.0,
        remember_completed: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        max_transfers_per_source: int = 16,
    ) -> None:
        if max_transfer_bytes <= 0 or max_total_bytes < max_transfer_bytes:
            raise ValueError("need 0 < max_transfer_bytes <= max_total_bytes")
        self.max_transfer_bytes = max_transfer_bytes
        self.max_total_bytes = max_total_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._transfers: dict[tuple[str, str], _Transfer] = {}
        self._completed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember_completed
        self.max_transfers_per_source = max_transfers_per_source
        self.stats = ReassemblyStats()

    @property
    def reserved_bytes(self) -> int:
        """Memory promised to open transfers (their declared sizes)."""
        return sum(t.header.total_bytes for t in self._transfers.values())

    def open_transfers(self) -> list[tuple[str, str]]:
        return list(self._transfers)

    def add(self, header: ChunkHeader, payload: bytes, source: str = "") -> bytes | None:
        """Add one chunk; return the whole blob when this chunk completes it."""
        key = (source, header.transfer_id)
        if key in self._completed:
            self.stats.duplicates += 1
            return None
        now = self._clock()
        transfer = self._transfers.get(key)
        if transfer is None:
            if header.total_bytes > self.max_transfer_bytes:
                self.stats.rejected += 1
                raise SizeLimitError(
                    f"transfer {header.transfer_id} declares {header.total_bytes} bytes, limit {self.max_transfer_bytes}"
                )
            if self.reserved_bytes + header.total_bytes > self.max_total_bytes:
                self.expire()
                if self.reserved_bytes + header.total_bytes > self.max_total_bytes:
                    self.stats.rejected += 1
                    raise SizeLimitError(
                        f"transfer {header.transfer_id} ({header.total_bytes} bytes) would exceed the "
                        f"{self.max_total_bytes}-byte reassembly budget"
                    )
            if sum(1 for src, _ in self._transfers if src == source) >= self.max_transfers_per_source:
                self.stats.rejected += 1
                # One sender must not hold the whole budget hostage with half-sent transfers.
                raise SizeLimitError(f"{source or 'sender'} already has {self.max_transfers_per_source} transfers open")
            transfer = _Transfer(header, now, now)
            self._transfers[key] = transfer
        elif (header.count, header.total_bytes, header.sha256) != (
            transfer.header.count,
            transfer.header.total_bytes,
            transfer.header.sha256,
        ):
            self.stats.rejected += 1
            raise ChunkError(f"chunk {header.seq} of transfer {header.transfer_id} disagrees with earlier chunks")
        if header.seq in transfer.parts:
            self.stats.duplicates += 1
            return None
        if transfer.received_bytes + len(payload) > header.total_bytes:
            self.stats.rejected += 1
            self._drop(key)
            raise LengthMismatchError(f"transfer {header.transfer_id} received more bytes than the declared {header.total_bytes}")
        transfer.parts[header.seq] = payload if isinstance(payload, bytes) else bytes(payload)
        transfer.received_bytes += len(payload)
        transfer.updated_at = now
        while transfer.hashed_upto in transfer.parts:
            transfer.hasher.update(transfer.parts[transfer.hashed_upto])
            transfer.hashed_upto += 1
        if len(transfer.parts) < header.count:
            return None
        self._drop(key)
        blob = b"".join(transfer.parts[i] for i in range(header.count))
        if len(blob) != header.total_bytes:
            self.stats.rejected += 1
            raise LengthMismatchError(f"transfer {header.transfer_id}: {len(blob)} bytes, declared {header.total_bytes}")
        if transfer.hasher.hexdigest() != header.sha256:
            self.stats.rejected += 1
            raise HashMismatchError(f"transfer {header.transfer_id}: sha256 of the reassembled blob does not match")
        self._completed[key] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        self.stats.completed += 1
        return blob

    def missing(self, transfer_id: str, source: str = "") -> list[int]:
        transfer = self._transfers.get((source, transfer_id))
        if transfer is None:
            return []
        return [seq for seq in range(transfer.header.count) if seq not in transfer.parts]

    def stalled(self, idle_s: float) -> list[tuple[str, str, list[int]]]:
        """Open transfers with no progress for ``idle_s``: (source, transfer id, missing seqs)."""
        now = self._clock()
        return [
            (source, tid, self.missing(tid, source))
            for (source, tid), t in self._transfers.items()
            if now - t.updated_at >= idle_s
        ]

    def expire(self) -> list[tuple[str, str]]:
        """Drop transfers idle longer than the timeout; return their (source, transfer id)."""
        now = self._clock()
        stale = [key for key, t in self._transfers.items() if now - t.updated_at > self.timeout_s]
        for key in stale:
            self._drop(key)
        self.stats.expired += len(stale)
        return stale

    def _drop(self, key: tuple[str, str]) -> None:
        self._transfers.pop(key, None)
