"""FedGKT's maps sent once (``reuse_maps``): what the server holds of each agent's maps across
rounds, the reuse claims it takes as rows of them, and the claims it cannot serve (asked for
in full). See docs/protocol.md, "Maps go up once".

A mixin of :class:`cloud_server.methods.fedgkt.FedGktServer`: it reads the server's config,
staging, staged uploads and async replay, which the server makes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np

from shared_protocol.errors import MapsNotHeldError, ShapeMismatchError
from shared_protocol.messages import Message, RoundEnd
from shared_protocol.methods.fedgkt import GktMapsRequest, GktReusedMaps, GktRoundConfig

from ..feature_store import AgentRows, HeldMaps, StagedArray, StagedBatch, gather_batches, materialise, reused_whole
from ..robust_config import ImplausibleUploadError

log = logging.getLogger("cloud_server.fedgkt")

__all__ = ["FedGktReuse"]


class FedGktReuse:
    """The held maps of :class:`~cloud_server.methods.fedgkt.FedGktServer`."""

    ctx: Any  # ServerContext
    config: Any  # FedGktConfig
    staging: Any  # ArrayStaging
    held: dict[tuple[str, str], HeldMaps]
    maps_wanted: dict[tuple[str, str], tuple[str, int, dict[int, str]]]
    replay: dict[str, AgentRows]
    figures: dict[int, dict[str, Any]]
    feature_shape: tuple[int, ...] | None

    def _init_held_maps(self) -> None:
        # (agent, split) -> its last accepted maps, held in the staging across rounds (not
        # checkpointed: a resumed server holds none, names none, and so gets them in full).
        self.held: dict[tuple[str, str], HeldMaps] = {}
        # (agent, split) -> (instance, round, {seq: why}) of the reuse claims it could not serve:
        # asked for in full (train) or left out of the evaluation (test).
        self.maps_wanted: dict[tuple[str, str], tuple[str, int, dict[int, str]]] = {}

    def _with_held_maps(self, cfg: GktRoundConfig, agent: str) -> GktRoundConfig:
        """``agent``'s round config: the digests of its maps the server holds (``held_maps``)."""
        if not self._holds_maps:
            return cfg
        return replace(cfg, held_maps={split: held.digest for (a, split), held in sorted(self.held.items()) if a == agent})

    def _hold_trained(self, data: dict[str, AgentRows], digests: dict[str, str]) -> None:
        """After a round's training: hold each agent's trained-on maps that came with one digest."""
        if self._holds_maps:
            for agent, rows in data.items():
                if digests.get(agent):
                    self._hold(agent, "train", digests[agent], rows)

    def _maps_requests(self, agent: str, end: RoundEnd, split: str, missing: list[int]) -> list[Message]:
        """For the ``missing`` batches that were claims the server could not serve: the request
        for them in full ([] when none)."""
        wanted = self._wanted(agent, end.instance, end.round, split)
        in_full = [seq for seq in missing if seq in wanted]
        if not in_full:
            return []
        return [GktMapsRequest(run=self.ctx.run_id, round=end.round, sender="server", split=split, seqs=in_full,
                               reason=wanted[in_full[0]][:500])]

    @property
    def _holds_maps(self) -> bool:
        """Whether agents' maps are held across rounds: reuse on and the extractors frozen (a
        trained extractor gives other maps every round)."""
        edge = self.config.edge
        return edge.reuse_maps and not edge.train_extractor

    def _in_use(self, staged: StagedArray) -> bool:
        return any(h.rows.staged is staged for h in self.held.values()) or \
            any(rows[0].staged is staged for rows in self.replay.values())

    def _release_rows(self, staged: StagedArray) -> None:
        """Release a gathered array unless held maps or async replay still use it."""
        if not self._in_use(staged):
            self.staging.release(staged)

    def _hold(self, agent: str, split: str, digest: str, rows: AgentRows) -> None:
        """Keep ``rows`` as ``agent``'s ``split`` maps (digest ``digest``), replacing what was held."""
        old = self.held.get((agent, split))
        if old is not None and old.rows.staged is rows[0].staged:
            return  # the held maps, reused as they are
        self.held[(agent, split)] = HeldMaps(digest, rows[0], rows[2].numpy().astype(np.int64, copy=False), rows[3])
        if old is not None:
            self._release_rows(old.rows.staged)

    def drop_held_maps(self, agent: str | None = None) -> None:
        """Forget the maps held for ``agent`` (None: every agent), as a restart would: the
        next claims to reuse them are refused and the maps asked for again."""
        for key in [k for k in self.held if agent is None or k[0] == agent]:
            self._release_rows(self.held.pop(key).rows.staged)

    def _want_maps(self, agent: str, msg: GktReusedMaps, why: str) -> None:
        instance, round_, wanted = self.maps_wanted.get((agent, msg.split), (msg.instance, msg.round, {}))
        if (instance, round_) != (msg.instance, msg.round):
            wanted = {}
        wanted[msg.seq] = why
        self.maps_wanted[(agent, msg.split)] = (msg.instance, msg.round, wanted)
        self._count(msg.round, msg.split, "requested_batches", 1)
        log.warning("round %d: %s's %s batch %d reuses maps the server does not hold (%s); asking for them in full",
                    msg.round, agent, msg.split, msg.seq, why)

    def _wanted(self, agent: str, instance: str, round_: int, split: str) -> dict[int, str]:
        held = self.maps_wanted.get((agent, split))
        if held is None or held[:2] != (instance, round_):
            return {}
        return dict(held[2])

    def _count(self, round_: int, split: str, what: str, value: int) -> None:
        """The round's figures of maps sent once (report.json ``rounds[].method``)."""
        key = f"{'maps' if split == 'train' else 'test_maps'}_{what}"
        figures = self.figures.setdefault(round_, {})
        figures[key] = figures.get(key, 0) + value

    def _agent_rows(self, agent: str, split: str, batches: list[StagedBatch]) -> AgentRows:
        """One agent's batches of ``split`` as rows: the held maps as they are when the batches
        reuse all of them in order, else gathered (reused batches copied from the held maps).
        :class:`MapsNotHeldError` when maps a batch reused were dropped since it arrived."""
        held = self.held.get((agent, split))
        if any(b.held is not None and (b.held is not held or b.held.rows.staged.released) for b in batches):
            raise MapsNotHeldError(f"the held {split} maps some batches reused were dropped before they were used")
        whole = reused_whole(batches)
        if whole is not None:
            return whole
        return gather_batches([materialise(b, self.staging) for b in batches], self.staging)

    def _on_reused(self, agent: str, msg: GktReusedMaps) -> None:
        """A batch that reuses held maps: staged as their rows, with the batch's logits; a claim
        the server cannot serve is not staged, and its maps are asked for in full."""
        if msg.logits.shape[1] != self.ctx.num_classes:
            raise ShapeMismatchError(f"edge logits have {msg.logits.shape[1]} classes, run has {self.ctx.num_classes}")
        cfg = self.ctx.robustness
        peak = float(np.max(np.abs(msg.logits)))
        if self.ctx.robustness.plausibility_checks and not peak <= cfg.logit_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} edge logits reach |z| = {peak:.4g}, above "
                                                         f"server.logit_abs_limit = {cfg.logit_abs_limit:g}")
        try:
            rows = self.reused_rows(agent, msg)
        except MapsNotHeldError as exc:
            self._want_maps(agent, msg, f"{exc.code}: {exc}")
            return
        self._stage(agent, msg, reused=(self.held[(agent, msg.split)], rows))
        n = len(msg.sample_ids)
        self._count(msg.round, msg.split, "reused_batches", 1)
        self._count(msg.round, msg.split, "reused_samples", n)
        self._count(msg.round, msg.split, "reused_fp32_bytes", 4 * n * math.prod(self.feature_shape or ()))

    def reused_rows(self, agent: str, msg: GktReusedMaps) -> np.ndarray:
        """The rows of the maps ``agent``'s claim reuses; :class:`MapsNotHeldError` (a specific
        reason) when the server holds none for the split, or other ones."""
        held = self.held.get((agent, msg.split)) if self._holds_maps else None
        if held is None:
            raise MapsNotHeldError(f"no {msg.split} maps of {agent} are held (none sent yet, a restarted or resumed "
                                   "server, or dropped)" if self._holds_maps else "this run does not hold maps (reuse_maps "
                                   "= false or train_extractor = true)")
        return held.rows_of(msg.maps_digest, msg.sample_ids)
