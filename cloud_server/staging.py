"""Staging of per-round model uploads, shared by the methods that average models.

FedAvg (and its family) and FedKD hold one upload per agent per round -- a
model, or an SVD-factored update -- until the round completes, and then use
only the uploads whose ``RoundEnd`` vouches for them: the same agent process
(``instance``), the same round and the same sample count. An upload without a
matching ``RoundEnd`` (or a ``RoundEnd`` without an upload) is excluded with a
reason the coordinator puts into the round record.

:class:`ModelUploadStage` is a plain ``dict`` (agent id -> staged upload), so a
method reads and clears it like one; it adds :meth:`ModelUploadStage.take_usable`,
which splits a round's agents into used and excluded. A method's staged
record subclasses :class:`StagedUpload` and adds what it carries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared_protocol.messages import RoundEnd

__all__ = ["StagedUpload", "ModelUploadStage"]


@dataclass
class StagedUpload:
    """What every staged model upload has: who sent it (process and round) and on how many samples."""

    instance: str
    round: int
    num_samples: int


S = TypeVar("S", bound=StagedUpload)


class ModelUploadStage(dict[str, S], Generic[S]):
    """Agent id -> that agent's staged upload of the current round.

    ``what`` names the upload in exclusion reasons and logs (e.g. ``"model upload"``).
    """

    def __init__(self, what: str, logger: logging.Logger) -> None:
        super().__init__()
        self.what = what
        self.log = logger

    def unusable_reason(self, agent: str, end: RoundEnd) -> str | None:
        """Why ``agent``'s staged upload may not be used with its ``end``; None if it may."""
        staged = self.get(agent)
        noun = self.what.split()[-1]  # "model upload" -> "upload"
        if staged is None:
            return f"no {self.what}"
        if staged.instance != end.instance or staged.round != end.round:
            return f"{noun} came from another agent process or round"
        if staged.num_samples != end.num_samples:
            return f"{noun} says {staged.num_samples} samples, round_end says {end.num_samples}"
        return None

    def take_usable(self, round_: int, ends: Mapping[str, RoundEnd]) -> tuple[dict[str, S], dict[str, str]]:
        """Remove the uploads of ``ends``' agents from the stage: ``(used, excluded)``, with
        ``used`` in agent-id order (agent -> upload) and ``excluded`` agent -> reason.
        Excluded uploads are dropped: a round's upload is never used in another round."""
        used: dict[str, S] = {}
        excluded: dict[str, str] = {}
        for agent in sorted(ends):
            why = self.unusable_reason(agent, ends[agent])
            if why is not None:
                excluded[agent] = why
                self.log.warning("round %d: not using %s's %s: %s", round_, agent, self.what.split()[-1], why)
                self.pop(agent, None)
                continue
            used[agent] = self.pop(agent)
        return used, excluded
