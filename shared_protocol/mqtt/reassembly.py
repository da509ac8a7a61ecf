"""Putting inbound chunks back together safely (:class:`Reassembler`).

The :class:`Reassembler` accepts chunks in any order, drops duplicates (QoS 1
delivers at least once), copies each chunk's body into its place in the blob as it
arrives (the one copy on receive, made without holding the interpreter lock, so
the network thread's copying does not stall the process's other threads; the
received payload is let go at once), hashes in seq order as the chunks arrive,
counts memory as bytes arrive and bounds it per sender, for unexpected senders
together and in total, checks a transfer's declared length against what the
receiver expects from its sender, expires transfers that stall, ignores a sender
that keeps sending invalid transfers, can list the seqs still missing, and hands a
blob up (a read-only view) only after its digest (XXH3-128) matches.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

from .chunk_format import DIGEST_NAME, ChunkHeader, blob_hasher
from ..errors import (
    ProtocolError,
    BudgetError,
    ChunkError,
    HashMismatchError,
    LengthMismatchError,
    SenderIgnoredError,
    SizeLimitError,
)
from ..sender_policy import SenderLimits, _Invalid


@dataclass
class _Transfer:
    header: ChunkHeader  # the first chunk seen: count, total and stride every later chunk must match
    started_at: float
    updated_at: float
    # The blob digest, fed as chunks arrive in order, so completing a blob does not hash it all at once.
    hasher: xxhash.xxh3_128
    buffer: np.ndarray  # the blob, filled in place as chunks arrive (uninitialised until then)
    parts: set[int] = field(default_factory=set)  # seqs received
    held_bytes: int = 0  # bytes received: what this transfer holds now (the buffer's untouched pages take no memory)
    digest: bytes | None = None  # from the last chunk, once it arrived
    hashed_upto: int = 0  # seqs [0, hashed_upto) are in the hasher


@dataclass
class ReassemblyStats:
    completed: int = 0
    duplicates: int = 0
    rejected: int = 0  # chunks refused, whatever the reason (see rejected_by_reason)
    expired: int = 0  # incomplete transfers dropped after the timeout
    evicted: int = 0  # incomplete transfers dropped to make room for their sender's newer ones
    rejected_by_reason: Counter[str] = field(default_factory=Counter)  # error code -> chunks


class Reassembler:
    """Collects chunks per (source, transfer id) until a blob is complete.

    ``source`` is the topic (or sender) a chunk came from, so one sender cannot
    write into another's transfer. Not thread-safe: one network thread feeds it.

    Memory is counted as chunk bytes arrive, not reserved from the length a first
    chunk declares, and bounded three ways: per sender (:class:`SenderLimits`), for
    all senders the receiver has no expectation for together (``unexpected_total_bytes``),
    and in total (``max_total_bytes``). A receiver states what it expects from a sender
    with :meth:`expect` (the server: from each agent, this round); a transfer declaring
    more is refused before anything is held. Without an expectation a sender gets
    ``unexpected`` (the server passes a small one; by default ``max_transfer_bytes``).

    When a sender's own bound is full, its least recently active incomplete transfer
    is dropped (``evicted``): a stalled or never-completing transfer cannot block the
    sender's live one. When the total is full, unexpected senders' transfers give way;
    then the expected transfer nearest completion still goes on (so partial transfers
    cannot deadlock), and any other chunk is refused (``over_budget``) but its transfer
    stays open, so the seq is listed as missing and asked for again (:meth:`stalled`)
    once there is room. A sender without an expectation that sends
    ``max_invalid_transfers`` invalid transfers is ignored for ``ignore_s``
    (``ignored_sender``: only single-chunk messages of its get through meanwhile);
    :attr:`on_ignore` is called once when that starts.
    """

    MAX_TRACKED_SENDERS = 4096

    def __init__(
        self,
        max_transfer_bytes: int = 256 * 1024 * 1024,
        max_total_bytes: int = 1024 * 1024 * 1024,
        timeout_s: float = 120.0,
        remember_completed: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        max_transfers_per_source: int = 16,
        *,
        unexpected: SenderLimits | None = None,
        unexpected_total_bytes: int | None = None,
        max_invalid_transfers: int = 20,
        ignore_s: float = 600.0,
    ) -> None:
        if max_transfer_bytes <= 0 or max_total_bytes < max_transfer_bytes:
            raise ValueError(
                f"need 0 < max_transfer_bytes <= max_total_bytes, got {max_transfer_bytes} and {max_total_bytes}"
            )
        if max_invalid_transfers < 1 or ignore_s < 0:
            raise ValueError(f"need max_invalid_transfers >= 1 and ignore_s >= 0, got {max_invalid_transfers}, {ignore_s}")
        self.max_transfer_bytes = max_transfer_bytes
        self.max_total_bytes = max_total_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._transfers: dict[tuple[str, str], _Transfer] = {}
        self._completed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember_completed
        self.max_transfers_per_source = max_transfers_per_source
        self.unexpected = unexpected or SenderLimits(max_transfer_bytes, max_transfer_bytes, max_transfers_per_source)
        self.unexpected_total_bytes = unexpected_total_bytes if unexpected_total_bytes is not None else max_total_bytes
        if self.unexpected_total_bytes < self.unexpected.max_transfer_bytes:
            raise ValueError(
                f"unexpected_total_bytes ({self.unexpected_total_bytes}) must be >= the unexpected senders' "
                f"max_transfer_bytes ({self.unexpected.max_transfer_bytes})"
            )
        self.max_invalid_transfers = max_invalid_transfers
        self.ignore_s = ignore_s
        self._expected: dict[str, SenderLimits] = {}
        self._blocked: dict[str, str] = {}  # source -> why (its owner dropped it)
        self._invalid: OrderedDict[str, _Invalid] = OrderedDict()
        self._held_by_source: Counter[str] = Counter()
        self._held_unexpected = 0
        self._held_total = 0
        self.on_ignore: Callable[[str, dict[str, int]], None] | None = None
        self.stats = ReassemblyStats()

    # -- what the receiver expects ------------------------------------------ #

    def expect(self, source: str, limits: SenderLimits | None) -> None:
        """State what ``source`` may send (None: forget it; it is unexpected again).
        Open transfers keep going; the limits apply to what arrives next."""
        if limits is None:
            self._expected.pop(source, None)
        else:
            self._expected[source] = limits
            self._invalid.pop(source, None)
        self._recount()

    def block(self, source: str, why: str) -> None:
        """Ignore every chunk from ``source`` from now on (its owner dropped the sender)."""
        self._blocked[source] = why
        for key in [k for k in self._transfers if k[0] == source]:
            self._drop(key)

    def limits_for(self, source: str) -> SenderLimits:
        return self._expected.get(source, self.unexpected)

    def is_expected(self, source: str) -> bool:
        return source in self._expected

    def ignored(self, source: str) -> bool:
        if source in self._blocked:
            return True
        entry = self._invalid.get(source)
        return entry is not None and self._clock() < entry.ignored_until

    def _refuse(self, exc: ProtocolError, source: str, invalid: bool) -> ProtocolError:
        """Count a refused chunk by its code; an invalid transfer also counts toward ignoring
        its sender (only senders without an expectation: on a broker without ACLs anyone may
        publish on an expected sender's topic, so its owner decides about it)."""
        self.stats.rejected += 1
        self.stats.rejected_by_reason[exc.code] += 1
        if invalid and source not in self._expected and not self.ignored(source):
            entry = self._invalid.get(source)
            if entry is None:
                entry = self._invalid[source] = _Invalid()
                while len(self._invalid) > self.MAX_TRACKED_SENDERS:
                    self._invalid.popitem(last=False)
            self._invalid.move_to_end(source)
            entry.counts[exc.code] += 1
            if sum(entry.counts.values()) >= self.max_invalid_transfers and self._clock() >= entry.ignored_until:
                counts = dict(entry.counts)
                entry.counts.clear()
                entry.ignored_until = self._clock() + self.ignore_s
                for key in [k for k in self._transfers if k[0] == source]:
                    self._drop(key)
                if self.on_ignore is not None:
                    self.on_ignore(source, counts)
        return exc

    # -- accounting ----------------------------------------------------------- #

    @property
    def held_bytes(self) -> int:
        """Bytes of incomplete transfers held now (all senders)."""
        return self._held_total

    @property
    def reserved_bytes(self) -> int:
        """Alias of :attr:`held_bytes` (memory is taken as bytes arrive, never reserved ahead)."""
        return self._held_total

    def held_by(self, source: str) -> int:
        return self._held_by_source.get(source, 0)

    def open_transfers(self, source: str | None = None) -> list[tuple[str, str]]:
        return [k for k in self._transfers if source is None or k[0] == source]

    def _recount(self) -> None:
        self._held_unexpected = sum(t.held_bytes for (src, _), t in self._transfers.items() if src not in self._expected)

    # -- chunks --------------------------------------------------------------- #

    def add(self, payload: bytes | bytearray | memoryview, source: str = "") -> memoryview | None:
        """Add one chunk payload; return the whole blob (read-only) when this chunk completes it."""
        header, body = self.parse(payload, source)
        return self.add_chunk(header, body, source)

    def parse(self, payload: bytes | bytearray | memoryview, source: str = "") -> tuple[ChunkHeader, memoryview]:
        """:meth:`ChunkHeader.parse`, refusing (and counting) chunks that do not parse and chunks
        from a blocked or ignored sender (see :meth:`add_chunk`)."""
        if source in self._blocked:
            raise self._refuse(SenderIgnoredError(f"chunk from {source or '?'}, which its receiver dropped"), source, invalid=False)
        try:
            return ChunkHeader.parse(payload)
        except ChunkError as exc:
            if self.ignored(source):
                raise self._refuse(SenderIgnoredError(f"chunk from ignored sender {source or '?'}"), source, invalid=False) from None
            raise self._refuse(exc, source, invalid=True) from None

    def add_chunk(self, header: ChunkHeader, body: bytes | memoryview, source: str = "") -> memoryview | None:
        """Add one parsed chunk (see :meth:`ChunkHeader.parse`): ``body`` is copied into its place
        and not kept; the whole blob, read-only, when this chunk completes it.

        A sender that is ignored for its invalid transfers still gets a whole message that comes
        in one chunk through (on a broker without ACLs others may publish on its topic: an agent
        must still be able to say hello); nothing of it that takes more than one chunk is held."""
        if source in self._blocked or (header.count > 1 and self.ignored(source)):
            raise self._refuse(SenderIgnoredError(f"chunk from ignored sender {source or '?'}"), source, invalid=False)
        key = (source, header.transfer_id)
        if key in self._completed:
            self.stats.duplicates += 1
            return None
        now = self._clock()
        transfer = self._transfers.get(key)
        if transfer is None:
            transfer = self._open(key, header, now)
        elif (header.count, header.total_bytes, header.chunk_bytes) != (
            transfer.header.count,
            transfer.header.total_bytes,
            transfer.header.chunk_bytes,
        ):
            raise self._refuse(
                ChunkError(f"chunk {header.seq} of transfer {header.transfer_id} disagrees with earlier chunks "
                           f"(count/length/stride {header.count}/{header.total_bytes}/{header.chunk_bytes}, first "
                           f"chunk said {transfer.header.count}/{transfer.header.total_bytes}/{transfer.header.chunk_bytes})"),
                source, invalid=True,
            )
        if header.seq in transfer.parts:
            self.stats.duplicates += 1
            return None
        if len(body) != header.body_bytes:
            self._drop(key)
            raise self._refuse(
                LengthMismatchError(
                    f"transfer {header.transfer_id}: chunk {header.seq} carries {len(body)} bytes, its place in the "
                    f"{header.total_bytes}-byte blob holds {header.body_bytes}"
                ),
                source, invalid=True,
            )
        self._make_room(key, len(body))
        start = header.seq * header.chunk_bytes
        transfer.buffer[start : start + len(body)] = np.frombuffer(body, np.uint8)  # the one copy on receive
        transfer.parts.add(header.seq)
        self._hold(source, transfer, len(body))
        if header.digest is not None:
            transfer.digest = header.digest
        transfer.updated_at = now
        while transfer.hashed_upto in transfer.parts:
            start = transfer.hashed_upto * header.chunk_bytes
            transfer.hasher.update(transfer.buffer[start : start + header.chunk_bytes])
            transfer.hashed_upto += 1
        if len(transfer.parts) < header.count:
            return None
        self._drop(key)
        if transfer.hasher.digest() != transfer.digest:
            raise self._refuse(
                HashMismatchError(f"transfer {header.transfer_id}: the {DIGEST_NAME} of the reassembled blob does not "
                                  f"match the one its last chunk carries"),
                source, invalid=True,
            )
        self._completed[key] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        self.stats.completed += 1
        return memoryview(transfer.buffer).toreadonly()

    def _open(self, key: tuple[str, str], header: ChunkHeader, now: float) -> _Transfer:
        source = key[0]
        limits = self.limits_for(source)
        cap = min(limits.max_transfer_bytes, self.max_transfer_bytes)
        if header.total_bytes > cap:
            expected = "expected from this sender" if source in self._expected else "the limit"
            raise self._refuse(
                SizeLimitError(f"transfer {header.transfer_id} on {source or '?'} declares {header.total_bytes} bytes, "
                               f"{expected} is {cap}"),
                source, invalid=True,
            )
        mine = self.open_transfers(source)
        while len(mine) >= limits.max_open_transfers:
            # The least recently active goes: a sender's live transfer is never the one that stalls.
            self._evict(min(mine, key=lambda k: self._transfers[k].updated_at))
            mine = self.open_transfers(source)
        try:
            # Address space only: pages are taken as the chunks are written into them.
            buffer = np.empty(header.total_bytes, np.uint8)
        except MemoryError:
            raise self._refuse(BudgetError(f"transfer {header.transfer_id} on {source or '?'}: no room for its "
                                           f"{header.total_bytes} bytes"), source, invalid=False) from None
        transfer = _Transfer(header, now, now, blob_hasher(), buffer)
        self._transfers[key] = transfer
        return transfer

    def _make_room(self, key: tuple[str, str], nbytes: int) -> None:
        """Evict or refuse so that ``nbytes`` more of transfer ``key`` fit every bound."""
        source = key[0]
        limits = self.limits_for(source)
        # Candidates are listed only when a bound is full: a chunk that fits costs no scan of the open transfers.
        if self.held_by(source) + nbytes > limits.max_held_bytes:
            self._evict_until(lambda: self.held_by(source) + nbytes <= limits.max_held_bytes,
                              [k for k in self._transfers if k[0] == source and k != key])
        if source not in self._expected and self._held_unexpected + nbytes > self.unexpected_total_bytes:
            self._evict_until(lambda: self._held_unexpected + nbytes <= self.unexpected_total_bytes,
                              [k for k in self._transfers if k[0] not in self._expected and k != key])
        if self._held_total + nbytes > self.max_total_bytes:
            self.expire()
            # Senders nobody expects give way first.
            self._evict_until(lambda: self._held_total + nbytes <= self.max_total_bytes,
                              [k for k in self._transfers if k[0] not in self._expected and k != key])
        if self._held_total + nbytes > self.max_total_bytes and source in self._expected:
            # The expected transfer nearest completion always goes on: it frees its bytes when it
            # completes, so partial transfers cannot hold the budget against each other for ever.
            # The total is exceeded by at most what that one transfer still misses.
            def missing(t: _Transfer) -> int:
                return t.header.total_bytes - t.held_bytes

            mine = missing(self._transfers[key])
            if all(mine <= missing(t) for k, t in self._transfers.items() if k != key and k[0] in self._expected):
                return
        if self._held_total + nbytes > self.max_total_bytes:
            if source not in self._expected:
                self._drop(key)  # nobody asks a stranger to resend: keep nothing of it
            raise self._refuse(
                BudgetError(f"chunk of transfer {key[1]} on {source or '?'}: {nbytes} more bytes would exceed the "
                            f"{self.max_total_bytes}-byte reassembly budget ({self._held_total} held); it will be "
                            f"asked for again"),
                source, invalid=False,
            )

    def _evict_until(self, fits: Callable[[], bool], candidates: list[tuple[str, str]]) -> None:
        candidates.sort(key=lambda k: self._transfers[k].updated_at)
        for victim in candidates:
            if fits():
                return
            self._evict(victim)

    def _evict(self, key: tuple[str, str]) -> None:
        self.stats.evicted += 1
        self._drop(key)

    def _hold(self, source: str, transfer: _Transfer, nbytes: int) -> None:
        transfer.held_bytes += nbytes
        self._held_by_source[source] += nbytes
        self._held_total += nbytes
        if source not in self._expected:
            self._held_unexpected += nbytes

    def missing(self, transfer_id: str, source: str = "") -> list[int]:
        transfer = self._transfers.get((source, transfer_id))
        if transfer is None:
            return []
        return [seq for seq in range(transfer.header.count) if seq not in transfer.parts]

    def reply_topic(self, transfer_id: str, source: str = "") -> str:
        """Where the sender of an open transfer takes resend requests ("" if it named none)."""
        transfer = self._transfers.get((source, transfer_id))
        return transfer.header.reply_topic if transfer is not None else ""

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
        transfer = self._transfers.pop(key, None)
        if transfer is None or not transfer.held_bytes:
            return
        source = key[0]
        self._held_total -= transfer.held_bytes
        self._held_by_source[source] -= transfer.held_bytes
        if self._held_by_source[source] <= 0:
            del self._held_by_source[source]
        if source not in self._expected:
            self._held_unexpected -= transfer.held_bytes
