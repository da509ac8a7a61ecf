"""What a receiver takes from each sender: the :class:`SenderLimits` it states for the
senders it expects (:class:`~shared_protocol.mqtt.reassembly.Reassembler` applies them, blocks
the senders their owner dropped, and ignores for a while a sender nobody expects that keeps
sending invalid transfers)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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
