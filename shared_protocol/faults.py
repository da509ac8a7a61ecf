"""A misbehaving device on purpose: the faults an agent can be told to commit (``[agent] fault``,
``edgesplit local --faulty-agent``), as a spec both sides read.

The agent commits the fault (:mod:`edge_agent.faults`); the launcher checks the flag and writes
it into one agent's config; the server learns of it from the agent's ``hello`` and names it in
the run report. Torch- and numpy-free, so the launcher's checks import nothing heavy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_SCALES", "FAULT_KINDS", "FaultSpec", "fault_kinds_text"]

#: Each kind and what the agent does.
FAULT_KINDS: dict[str, str] = {
    "sign_flip": "sends global - SCALE x (trained - global): its weight update negated and scaled "
                 "(FedAvg-family uploads)",
    "scale": "sends every float tensor of its uploads multiplied by SCALE",
    "random_labels": "trains on its own shard with the labels shuffled, and sends what it learnt honestly",
    "nan": "sends uploads whose float tensors hold NaN (its own frame checks skipped)",
}
#: The scale a kind takes when none is given; a kind not here takes none.
DEFAULT_SCALES: dict[str, float] = {"sign_flip": 4.0, "scale": 1000.0}


def fault_kinds_text() -> str:
    return ", ".join(FAULT_KINDS)


@dataclass(frozen=True)
class FaultSpec:
    """One fault: its ``kind`` (a key of :data:`FAULT_KINDS`) and ``scale`` (None: the kind's
    default; only ``sign_flip`` and ``scale`` take one). ``where`` names the setting in errors."""

    kind: str
    scale: float | None = None
    where: str = "fault"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"{self.where}: unknown fault {self.kind!r}; faults: {fault_kinds_text()}")
        if self.scale is None:
            return
        if self.kind not in DEFAULT_SCALES:
            raise ValueError(f"{self.where}: fault {self.kind!r} takes no scale, got {self.scale!r}; only "
                             f"{' and '.join(DEFAULT_SCALES)} do")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) \
                or self.scale <= 0:
            raise ValueError(f"{self.where}: the scale of fault {self.kind!r} must be a finite number > 0, got {self.scale!r}")

    @property
    def factor(self) -> float:
        """The scale in use (the kind's default when none was given); 1 for a kind without one."""
        return float(self.scale if self.scale is not None else DEFAULT_SCALES.get(self.kind, 1.0))

    def describe(self) -> str:
        """``"sign_flip x4"``, ``"random_labels"``: what a hello and a report say."""
        return f"{self.kind} x{self.factor:g}" if self.kind in DEFAULT_SCALES else self.kind

    @classmethod
    def parse(cls, text: str, where: str = "fault") -> "FaultSpec":
        """``"KIND"`` or ``"KIND:SCALE"``."""
        kind, sep, scale = text.partition(":")
        if not sep:
            return cls(kind, None, where)
        try:
            value = float(scale)
        except ValueError:
            raise ValueError(f"{where}: the scale of fault {kind!r} must be a number, got {scale!r}") from None
        return cls(kind, value, where)
