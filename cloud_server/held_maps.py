"""Maps held across rounds so that an agent sends them once (FedGKT's ``reuse_maps``).

:class:`HeldMaps` is one agent's accepted maps of one split, kept in the staging
(:mod:`cloud_server.feature_store`) after the round that used them; a later upload batch
that reuses them is staged as rows of them (:class:`~cloud_server.feature_store.StagedBatch`
with ``held``), taken as they are when a round reuses all of them in order
(:func:`reused_whole`) or copied into the round's gathered rows (:func:`materialise`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared_protocol.errors import MapsNotHeldError

from .feature_store import AgentRows, ArrayStaging, RowSource, StagedBatch

__all__ = ["HeldMaps", "materialise", "reused_whole"]


@dataclass
class HeldMaps:
    """One agent's maps of one split, kept across rounds so that the agent sends them once:
    the rows its last accepted upload gave (de-duplicated, in upload order), their labels and
    sample ids, and the digest the agent gave them (its extractor and codec). The staged array
    belongs to the holder (released when the maps are replaced or dropped)."""

    digest: str
    rows: RowSource  # (n, 16, H, W) float16
    labels: np.ndarray  # (n,) int64
    sample_ids: np.ndarray  # (n,) int64
    _sorted_ids: np.ndarray = field(init=False, repr=False)
    _order: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._order = np.argsort(self.sample_ids, kind="stable")
        self._sorted_ids = self.sample_ids[self._order]

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        return self.rows.staged.nbytes

    def rows_of(self, digest: str, sample_ids: np.ndarray) -> np.ndarray:
        """The rows holding ``sample_ids``' maps, in their order; :class:`MapsNotHeldError` when the
        maps were made with another ``digest`` or some of the ids were never received."""
        if digest != self.digest:
            raise MapsNotHeldError(f"maps digest {digest[:12]}... is not the held maps' {self.digest[:12]}... "
                                   "(another extractor or codec)")
        at = np.searchsorted(self._sorted_ids, sample_ids)
        at = np.minimum(at, len(self._sorted_ids) - 1)
        known = self._sorted_ids[at] == sample_ids if len(self._sorted_ids) else np.zeros(len(sample_ids), bool)
        if not known.all():
            raise MapsNotHeldError(f"{int((~known).sum())} of {len(sample_ids)} sample ids (e.g. "
                                   f"{int(sample_ids[~known][0])}) are not among the {len(self)} held")
        return self._order[at]



def reused_whole(batches: list[StagedBatch]) -> AgentRows | None:
    """When every batch reuses the same held maps and together they name exactly the held
    rows in the held order (an agent re-sending its shard as before), those maps as they are,
    with the batches' logits: no copy. Else None."""
    held = batches[0].held if batches else None
    if held is None or any(b.held is not held for b in batches):
        return None
    ids = np.concatenate([b.sample_ids for b in batches])
    if len(ids) != len(held) or not np.array_equal(ids, held.sample_ids):
        return None
    logits = torch.from_numpy(np.concatenate([b.logits for b in batches]))
    return held.rows, logits, torch.from_numpy(held.labels), held.sample_ids


def materialise(batch: StagedBatch, staging: ArrayStaging) -> StagedBatch:
    """A reused batch as if its maps had been sent: its rows of the held maps staged anew
    (a full batch is returned as it is)."""
    if batch.held is None or batch.rows is None:
        return batch
    return StagedBatch(staging.stage(batch.held.rows.staged.array[batch.rows]), batch.logits, batch.labels, batch.sample_ids)
