"""FedBE edge step: plain FedAvg local training (Chen & Chao 2021, Algorithm 1's
"Client training", Eq. 1).

FedBE changes only how the server aggregates (Bayesian ensemble on its
unlabeled set, distilled with SWA; ``cloud_server/methods/fedbe.py``): the
agent receives the global model, trains it ``local_epochs`` with cross-entropy
and uploads it with its sample count, exactly as :class:`FedAvgEdge` does, over
FedAvg's messages. This class only registers that step under the name ``fedbe``.
"""

from __future__ import annotations

from .base import register_edge_method
from .fedavg import FedAvgEdge


@register_edge_method
class FedBEEdge(FedAvgEdge):
    name = "fedbe"
