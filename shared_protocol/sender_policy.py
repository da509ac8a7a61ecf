"""What a receiver takes from each sender: the :class:`SenderLimits` it states for the
senders it expects, and the bookkeeping (:class:`SenderPolicy`, a part of
:class:`~shared_protocol.reassembly.Reassembler`) that applies them, blocks the
senders their owner dropped, and ignores for a while a sender nobody expects that
keeps sending invalid transfers."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .errors import ProtocolError

if TYPE_CHECKING:
    from .reassembly import ReassemblyStats, _Transfer


@dataclass(frozen=True)
class SenderLimits:
    """What a receiver takes from one sender (one source topic) at a time.

    ``max_transfer_bytes`` bounds the length a transfer may declare: checked on the
    first chunk seen, before anything is held. ``max_held_bytes`` bounds the bytes of
    that sender's incomplete transfers held at once, counted as chunks arrive.
    ``max_open_transfers`` bounds how many it may have open.
    """

    max_transfer_bytes: int
    max_held_bytes: int
    max_open_transfers: int = 16

    def __post_init__(self) -> None:
        if self.max_transfer_bytes < 1 or self.max_open_transfers < 1:
            raise ValueError(
                f"SenderLimits needs max_transfer_bytes >= 1 and max_open_transfers >= 1, got "
                f"{self.max_transfer_bytes} and {self.max_open_transfers}"
            )
        if self.max_held_bytes < self.max_transfer_bytes:
            # Otherwise a transfer the sender may declare could never complete.
            raise ValueError(
                f"SenderLimits.max_held_bytes ({self.max_held_bytes}) must be >= max_transfer_bytes "
                f"({self.max_transfer_bytes})"
            )


@dataclass
class _Invalid:
    """Invalid transfers seen from one sender without an expectation."""

    counts: Counter[str] = field(default_factory=Counter)
    ignored_until: float = 0.0


class SenderPolicy:
    """Expectations, blocking and ignoring for :class:`~shared_protocol.reassembly.Reassembler`."""

    MAX_TRACKED_SENDERS = 4096

    # Set up by Reassembler.__init__ (reassembly.py), like _drop and _recount.
    unexpected: SenderLimits
    max_invalid_transfers: int
    ignore_s: float
    on_ignore: Callable[[str, dict[str, int]], None] | None
    stats: ReassemblyStats
    _clock: Callable[[], float]
    _transfers: dict[tuple[str, str], _Transfer]
    _expected: dict[str, SenderLimits]
    _blocked: dict[str, str]
    _invalid: OrderedDict[str, _Invalid]

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
