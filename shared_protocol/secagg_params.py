"""Secure aggregation's parameters (shared_protocol/secagg.py), readable without its crypto
libraries: a server reads its config, and an agent its Welcome, before either runs a round."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import SecAggError

#: The methods whose server step is a (weighted) sum of the agents' models.
SUMMING_METHODS = ("fedavg", "fedgkd", "feddistill")
RING_BITS = (32, 64)


@dataclass(frozen=True)
class SecAggParams:
    """What both sides need to run a secure-aggregation round (Welcome settings ``secagg``)."""

    ring_bits: int = 32
    fraction_bits: int = 20
    threshold: float = 0.5  # t = floor(threshold * roster size) + 1 shares rebuild a seed
    stage_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.ring_bits not in RING_BITS:
            raise ValueError(f"server.secagg_ring_bits must be one of {RING_BITS}, got {self.ring_bits!r}")
        if not isinstance(self.fraction_bits, int) or not 1 <= self.fraction_bits <= self.ring_bits - 8:
            raise ValueError(f"server.secagg_fraction_bits must be an integer in [1, {self.ring_bits - 8}] "
                             f"(the ring has {self.ring_bits} bits; the rest hold the integer part), got {self.fraction_bits!r}")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"server.secagg_threshold must be in [0, 1) (t = floor(threshold * agents) + 1), got {self.threshold!r}")
        if not self.stage_timeout_s > 0:
            raise ValueError(f"server.secagg_stage_timeout_s must be > 0 seconds, got {self.stage_timeout_s!r}")

    def shares_needed(self, roster_size: int) -> int:
        return max(2, min(roster_size, math.floor(self.threshold * roster_size) + 1))

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return np.uint32 if self.ring_bits == 32 else np.uint64

    def bound(self, roster_size: int) -> int:
        """The largest magnitude one agent's fixed-point entry may take: the sum of the
        roster's entries then never leaves the ring's signed range."""
        return (2 ** (self.ring_bits - 1) - 1) // max(1, roster_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> "SecAggParams":
        if not isinstance(raw, dict) or set(raw) - set(cls.__dataclass_fields__):
            raise SecAggError(f"secagg settings must be a table of {sorted(cls.__dataclass_fields__)}, got {raw!r}")
        try:
            return cls(**raw)
        except (TypeError, ValueError) as exc:
            raise SecAggError(f"secagg settings invalid: {exc}") from None


