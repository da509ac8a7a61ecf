"""The run's live snapshot: what the coordinator's metrics (:mod:`cloud_server.metrics`) rebuild
on the coordinator's thread and the HTTP thread serves, as Prometheus series, as the status
page (:mod:`cloud_server.status_page`) and as its JSON. Plain frozen dataclasses, no
Prometheus client: the page reads them without the metrics extra's imports."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AgentView", "LiveState", "OpenRoundView", "RoundPoint"]


@dataclass(frozen=True)
class AgentView:
    """One agent on the page and in the live series."""

    online: bool
    dropped: bool
    status: str  # its last status message
    round: int  # the round it works on (0: none)
    rejections: int  # messages of its own rejected (toward max_rejections_per_agent)
    reassembly_bytes: int  # bytes of its uploads held while they arrive
    last_round: int = 0  # the round its costs below are from (0: none yet)
    costs: dict[str, Any] = field(default_factory=dict)  # that round's AgentRoundCosts as JSON


@dataclass(frozen=True)
class OpenRoundView:
    round: int
    participants: int
    done: int
    missing: int
    waiting_for: tuple[str, ...]
    started_at: float  # time.monotonic(): the times below are read when asked, so a snapshot
    deadline_at: float  # taken before a long server step still counts down (inf: no deadline)

    @property
    def open_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def deadline_left_s(self) -> float | None:
        """None: no round-wide deadline (async)."""
        return self.deadline_at - time.monotonic() if math.isfinite(self.deadline_at) else None

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "participants": self.participants, "done": self.done, "missing": self.missing,
                "waiting_for": list(self.waiting_for), "open_s": self.open_s, "deadline_left_s": self.deadline_left_s}


@dataclass(frozen=True)
class RoundPoint:
    """A closed round on the page's curves."""

    round: int
    status: str
    accuracy: float | None
    local_accuracy: float | None
    cumulative_wire_bytes: int  # training's bytes over this and the earlier rounds, as report.json's wire_total
    duration_s: float


@dataclass(frozen=True)
class LiveState:
    run: str
    method: str
    schedule: str
    status: str
    planned_rounds: int
    completed_round: int
    open_rounds: tuple[OpenRoundView, ...]
    agents: dict[str, AgentView]
    rejected: dict[str, int]
    rejected_chunks: dict[str, int]
    history: tuple[RoundPoint, ...]
    updated_at: float  # time.time()
    # What the server is working on now, in words ("" between works): read when the page is
    # served, so a long server step shows while the snapshot above waits for it to end.
    server_phase: str = ""
    # After the run: until when the page is still served (time.time(); None: not said).
    serving_until: float | None = None

    @property
    def round_in_progress(self) -> int:
        return min((r.round for r in self.open_rounds), default=0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["open_rounds"] = [r.to_json() for r in self.open_rounds]
        out["round_in_progress"] = self.round_in_progress
        return out
