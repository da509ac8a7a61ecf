"""FedGKT's plausibility checks of uploaded maps (cloud_server/robust.py): at the door,
each batch's range; at the close, each agent's statistics against the other agents'.

A mixin of :class:`cloud_server.methods.fedgkt.FedGktServer`: it reads the server's
``ctx`` (robustness settings and ledger) and keeps ``refused_seqs`` and
``upload_stats``, which the server makes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared_protocol.messages import RoundEnd
from shared_protocol.methods.fedgkt import GktFeatures

from ..robust_config import MAD_TO_SD, ImplausibleUploadError

__all__ = ["FedGktPlausibility"]


class FedGktPlausibility:
    """The plausibility checks of :class:`~cloud_server.methods.fedgkt.FedGktServer`."""

    ctx: Any  # ServerContext
    refused_seqs: dict[str, tuple[str, int, set[tuple[str, int]]]]
    upload_stats: dict[str, tuple[str, int, np.ndarray, int, float, int]]

    def _check_plausible(self, agent: str, msg: GktFeatures) -> None:
        """At the door: maps and logits within the range a ResNet-8 extractor and classifier
        produce (``[server] feature_abs_limit`` / ``logit_abs_limit``; honest ones stay orders
        of magnitude below), refused as ``out_of_range`` with the figure; then the batch's
        per-channel statistics are added to the agent's round (compared with the other agents'
        when the round completes)."""
        cfg = self.ctx.robustness
        features = np.asarray(msg.features, dtype=np.float32)  # (N, C, H, W)
        peak = float(np.max(np.abs(features))) if features.size else 0.0
        if not peak <= cfg.feature_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} feature maps reach |H| = {peak:.4g}, above "
                                                         f"server.feature_abs_limit = {cfg.feature_abs_limit:g}")
        peak = float(np.max(np.abs(msg.logits))) if msg.logits.size else 0.0
        if not peak <= cfg.logit_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} edge logits reach |z| = {peak:.4g}, above "
                                                         f"server.logit_abs_limit = {cfg.logit_abs_limit:g}")
        self.ctx.ledger.examined(msg.round, "out_of_range", [agent])
        if msg.split != "train":
            return
        held = self.upload_stats.get(agent)
        channels = features.shape[1]
        if held is None or held[:2] != (msg.instance, msg.round):
            held = (msg.instance, msg.round, np.zeros(channels), 0, 0.0, 0)
        f64 = features.astype(np.float64)
        sumsq = held[2] + np.einsum("nchw,nchw->c", f64, f64)  # (C,)
        logits = np.asarray(msg.logits, dtype=np.float64)
        self.upload_stats[agent] = (msg.instance, msg.round, sumsq, held[3] + features.size // max(channels, 1),
                                    held[4] + float(np.sum(logits * logits)), held[5] + logits.size)

    def _implausible_statistics(self, round_: int, agents: list[str]) -> tuple[list[str], dict[str, str]]:
        """(the agents judged: three or more with statistics this round, else none; agent ->
        detail, for the agents whose maps' RMS in some channel, or
        whose logits' RMS, is far above the other agents' (above ``plausible_peer_ratio`` x their
        median and median + ``plausible_mad`` x 1.4826 MAD, and the channel above
        ``plausible_peer_ratio`` x the median channel's RMS of all agents: a channel dead for the
        others is not a yardstick))."""
        cfg = self.ctx.robustness
        stats = {a: self.upload_stats[a] for a in agents if a in self.upload_stats and self.upload_stats[a][1] == round_}
        if len(stats) < 3:
            return [], {}
        names = sorted(stats)
        rms = np.stack([np.sqrt(stats[a][2] / max(stats[a][3], 1)) for a in names])  # (A, C)
        logit_rms = np.array([math.sqrt(stats[a][4] / max(stats[a][5], 1)) for a in names])  # (A,)
        floor = cfg.plausible_peer_ratio * float(np.median(rms))
        out: dict[str, str] = {}
        for i, agent in enumerate(names):
            others = np.delete(rms, i, axis=0)  # (A - 1, C)
            med = np.median(others, axis=0)
            mad = np.median(np.abs(others - med), axis=0)
            limit = np.maximum.reduce([cfg.plausible_peer_ratio * med, med + cfg.plausible_mad * MAD_TO_SD * mad,
                                       np.full_like(med, floor)])
            over = np.nonzero(~(rms[i] <= limit))[0]
            if len(over):
                c = int(over[np.argmax(rms[i][over] / limit[over])])
                out[agent] = (f"feature maps' RMS in channel {c} is {rms[i, c]:.4g}, the other agents' median "
                              f"{med[c]:.4g} (limit {limit[c]:.4g}); {len(over)} of {rms.shape[1]} channels over")
                continue
            lo = np.delete(logit_rms, i)
            lmed = float(np.median(lo))
            lmad = float(np.median(np.abs(lo - lmed)))
            llimit = max(cfg.plausible_peer_ratio * lmed, lmed + cfg.plausible_mad * MAD_TO_SD * lmad)
            if not logit_rms[i] <= llimit:
                out[agent] = (f"edge logits' RMS {logit_rms[i]:.4g}, the other agents' median {lmed:.4g} "
                              f"(limit {llimit:.4g})")
        return names, out

    def _screen(self, round_: int, ends: dict[str, RoundEnd]) -> dict[str, str]:
        """Agent -> why its round's maps are not used: a batch refused at the door, or statistics
        far from the other agents'. A quarantined agent's maps are screened like the others' (and
        label-checked) and left out after (:meth:`FedGktServer.complete`): a judged round is what
        releases it (cloud_server/robust_ledger.py)."""
        ledger = self.ctx.ledger
        out: dict[str, str] = {}
        for agent in sorted(ends):
            refused = self.refused_seqs.get(agent)
            if refused is not None and refused[:2] == (ends[agent].instance, ends[agent].round):
                out[agent] = f"{len(refused[2])} upload(s) refused as implausible (robustness.refused)"
        if self.ctx.robustness.plausibility_checks:
            judged, refusals = self._implausible_statistics(round_, [a for a in sorted(ends) if a not in out])
            ledger.examined(round_, "implausible_statistics", judged)
            for agent, detail in refusals.items():
                ledger.refuse(round_, agent, "implausible_statistics", detail)
                out[agent] = f"implausible_statistics: {detail}"
        for agent in ends:
            self.upload_stats.pop(agent, None)
            if agent in self.refused_seqs and self.refused_seqs[agent][1] <= round_:
                self.refused_seqs.pop(agent)
        return out
