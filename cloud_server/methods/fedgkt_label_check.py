"""FedGKT's label-agreement check (cloud_server/robust_validation.py): before the server
trains on a round's maps, its current model scores each agent's (maps, labels); an agent whose
labels it agrees with far less than with the other agents' (and below
``[server] plausible_min_label_agreement``) is refused as ``implausible_labels``.

The server trains on the labels the agents send: one agent of three on shuffled labels cost the
server model 16 points (tests/test_robust_mqtt.py), and its maps and logits are in range. From
round 2 on (``LABEL_CHECK_FROM_ROUND``: the model has trained on the earlier rounds' maps) the
server model predicts honest agents' labels on their own maps far above chance, on the classes
it has seen them with, and a shuffled agent's near chance: its maps carry the true classes, its
labels do not.

Also recorded, not judged: the agreement of the agent's own edge logits with its labels. An
agent that trains on shuffled labels fits them poorly, but one that only relabels its upload,
or sends logits made from its labels, passes it: a figure for the report, no defence.

Cost: one forward pass of the server model over the round's maps (about a third of one server
epoch's FLOPs), only when the check is on. A mixin of
:class:`cloud_server.methods.fedgkt.FedGktServer`: it reads the server's ``ctx``, ``model``,
``device`` and ``figures``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..feature_store import AgentRows
from ..robust_validation import LABEL_CHECK_FROM_ROUND, LABEL_MIN_OTHERS, implausible_labels

log = logging.getLogger("cloud_server.fedgkt")

__all__ = ["FedGktLabelCheck"]


class FedGktLabelCheck:
    """The label-agreement check of :class:`~cloud_server.methods.fedgkt.FedGktServer`."""

    ctx: Any  # ServerContext
    model: torch.nn.Module
    device: torch.device
    figures: dict[int, dict[str, Any]]
    # agent -> the server model's agreement with its labels when it was last judged (async mode's
    # peers: each arrival is judged alone, against the other agents' latest figures).
    label_agreement_latest: dict[str, float]
    label_agreement_round: tuple[int, dict[str, dict[str, Any]]]  # (round, agent -> its figures that round)

    CHUNK_ROWS = 512

    def _agreement(self, rows: AgentRows) -> tuple[float, float]:
        """(the server model's, the edge logits') agreement with one agent's labels: the fraction
        of its samples whose label is the argmax. The server model in eval mode (running
        BatchNorm statistics, as it is evaluated), left as it was."""
        features, edge_logits, labels, _ids = rows
        n = len(labels)
        if n == 0:
            return float("nan"), float("nan")
        was_training = self.model.training
        self.model.eval()
        agree = 0
        try:
            with torch.no_grad():
                for chunk in torch.arange(n).split(self.CHUNK_ROWS):
                    maps = features[chunk].to(self.device, torch.float32)  # (b, 16, H, W)
                    agree += int((self.model(maps).argmax(1).cpu() == labels[chunk].cpu()).sum())
        finally:
            self.model.train(was_training)
        edge = float((edge_logits.argmax(1).cpu() == labels.cpu()).float().mean())
        return agree / n, edge

    def _check_labels(self, round_: int, data: dict[str, AgentRows]) -> dict[str, str]:
        """Agent -> why its maps are not trained on this round (``implausible_labels``, to the
        ledger); the round's figures go to the ledger (``robustness.label_agreement``), and the
        agents it could judge (``examined``: a quarantined agent's maps are judged too, and only
        a judged clean round releases it). Nothing
        when the check is off (``plausible_min_label_agreement`` 0), the plausibility checks are
        off, or before ``LABEL_CHECK_FROM_ROUND``."""
        defence = self.ctx.defence
        if not (defence.checks_labels and self.ctx.robustness.plausibility_checks) or round_ < LABEL_CHECK_FROM_ROUND or not data:
            return {}
        figures = {agent: self._agreement(rows) for agent, rows in sorted(data.items())}
        server = {a: f[0] for a, f in figures.items()}
        peers = {a: v for a, v in self.label_agreement_latest.items() if a not in server}
        refusals = implausible_labels(server, defence.plausible_min_label_agreement, defence.plausible_mad, peers)
        judged = [a for a, v in server.items() if v == v] if len({**peers, **server}) > LABEL_MIN_OTHERS else []  # NaN: no samples
        self.label_agreement_latest.update(server)
        # Async mode judges each arrival alone: the round's section gathers them.
        held_round, held = self.label_agreement_round
        if held_round != round_:
            held = {}
        held.update({a: {"server": _rounded(s), "edge": _rounded(e), "samples": len(data[a][2])} for a, (s, e) in figures.items()})
        self.label_agreement_round = (round_, held)
        ledger = self.ctx.ledger
        ledger.examined(round_, "implausible_labels", judged)
        ledger.record(round_, "label_agreement", {
            "threshold": defence.plausible_min_label_agreement, "agents": dict(sorted(held.items())),
            **({"peers": {a: round(v, 6) for a, v in sorted(peers.items())}} if peers else {})})
        out = {}
        for agent, (reason, detail) in refusals.items():
            ledger.refuse(round_, agent, reason, detail)
            out[agent] = f"{reason}: {detail}"
        return out


def _rounded(value: float) -> float | None:
    """Strict JSON: NaN (an agent with no samples) is written as null."""
    return round(value, 6) if value == value else None
