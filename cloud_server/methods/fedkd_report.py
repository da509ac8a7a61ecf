"""FedKD's own figures in the run report: per round, the bytes its SVD factors moved
against a dense mentee update and against FedAvg of a mentor-sized model, and Eq. 8's
ranks of the aggregate and of the agents' uploads.

A mixin of :class:`cloud_server.methods.fedkd.FedKdServer`, which keeps the round
history (``history``) and the model sizes this reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shared_protocol import svd
from shared_protocol.messages import RoundEnd

from .fedkd_factors import _eq8_rank, _ranks

if TYPE_CHECKING:
    from .fedkd import _RoundLog, _Staged

__all__ = ["FedKdReport"]


class FedKdReport:
    """``round_report`` of :class:`~cloud_server.methods.fedkd.FedKdServer` and the history entry it reads."""

    history: list[dict[str, Any]]
    version: int
    global_state: dict[str, np.ndarray]
    mentee_dense_bytes: int
    mentor_dense_bytes: int
    threshold: Any  # FedKdServer.threshold(round_) -> T(t)

    def _record(self, round_: int, round_log: _RoundLog, used: dict[str, _Staged], ends: dict[str, RoundEnd],
                packed: dict[str, svd.SvdTensor]) -> dict[str, Any]:
        """The round's FedKD-specific costs; bytes are float32 tensor payloads (frames add headers)."""
        down_svd = sum(p.payload_bytes for p in packed.values())
        agents = {}
        for agent, s in used.items():
            metrics, uploads = ends[agent].metrics, ends[agent].uploads
            fallback = uploads.get("dense_fallback_ranks")
            agents[agent] = {
                "ranks": s.ranks,
                "dense_fallback_ranks": dict(fallback) if isinstance(fallback, dict) else {},
                "svd_bytes": s.svd_bytes,
                "dense_bytes": s.dense_bytes,
                "frame_bytes": int(uploads.get("frame_bytes", 0)),
                **{k: metrics[k] for k in ("mentor_loss", "mentee_loss") if k in metrics},
            }
        up_svd = sum(a["svd_bytes"] for a in agents.values())
        return {
            "round": round_,
            "threshold": round_log.threshold,
            "version": self.version,
            "agents": agents,
            "aggregate": {
                "ranks": _ranks(packed),
                "dense_fallback_ranks": {name: p.eq8_rank for name, p in packed.items() if p.mode == "dense" and p.eq8_rank is not None},
                "energy": {name: p.energy for name, p in packed.items() if p.mode == "factored"},
                "svd_bytes": down_svd,
                "dense_bytes": self.mentee_dense_bytes,
            },
            # Per agent and round, both directions: what FedKD sent vs a dense mentee update
            # vs FedAvg of a model as large as the mentor.
            "bytes_per_agent": {
                "fedkd_svd": (up_svd / len(agents)) + down_svd,
                "dense_mentee": 2 * self.mentee_dense_bytes,
                "fedavg_mentor": 2 * self.mentor_dense_bytes,
            },
            "sync": {"agents": round_log.sync_agents, "bytes": round_log.sync_bytes},
        }

    def round_report(self, round_: int) -> dict[str, Any]:
        """The round's entry in ``report.json`` (``record["method"]``), from :attr:`history`.

        Bytes are float32 tensor payloads per agent and round, both directions
        (upload + aggregate): FedKD's factors vs the dense mentee update vs FedAvg of
        a mentor-sized model (its float state up and down); ``sync_bytes`` is the
        whole mentee sent in this round's RoundStarts (all agents). ``ranks`` has one
        entry per matrix of the mentee (vectors always travel dense): its 2-D view,
        ``max_factored_rank`` (the largest K whose factors are smaller than the
        matrix), Eq. 8's K of the aggregate (``down``) and of the agents' uploads
        (min / max / mean), and how many of those went dense because K exceeded it.
        """
        record = next((h for h in reversed(self.history) if h["round"] == round_), None)
        if record is None:
            return {"threshold": self.threshold(round_), "agents_used": 0}  # no update was used
        bytes_ = record["bytes_per_agent"]
        uploads = list(record["agents"].values())
        aggregate = record["aggregate"]
        ranks: dict[str, dict[str, Any]] = {}
        for name, array in self.global_state.items():
            dims = svd.matrix_shape(array.shape)
            if dims is None:
                continue
            p, q = dims
            limit = (p * q - 1) // (p + q + 1)  # K * (P + Q + 1) < P * Q
            up = [_eq8_rank(u, name, limit, min(p, q)) for u in uploads]
            known = [k for k in up if k is not None]
            ranks[name] = {
                "matrix": f"{p}x{q}", "max_factored_rank": limit,
                "down": _eq8_rank(aggregate, name, limit, min(p, q)),
                "down_dense": name not in aggregate["ranks"],
                "up_min": min(known) if known else None, "up_max": max(known) if known else None,
                "up_mean": round(float(np.mean(known)), 2) if known else None,
                "up_dense": sum(1 for u in uploads if name not in u["ranks"]),
            }
        return {
            "threshold": record["threshold"],
            "agents_used": len(uploads),
            "up_svd_bytes": round(float(np.mean([u["svd_bytes"] for u in uploads])), 1),
            "down_svd_bytes": aggregate["svd_bytes"],
            "fedkd_bytes": round(bytes_["fedkd_svd"], 1),
            "dense_mentee_bytes": bytes_["dense_mentee"],
            "fedavg_mentor_bytes": bytes_["fedavg_mentor"],
            "saved_vs_dense_mentee": round(1.0 - bytes_["fedkd_svd"] / bytes_["dense_mentee"], 4),
            "saved_vs_fedavg_mentor": round(1.0 - bytes_["fedkd_svd"] / bytes_["fedavg_mentor"], 4),
            "sync_bytes": record["sync"]["bytes"],
            "ranks": ranks,
        }
