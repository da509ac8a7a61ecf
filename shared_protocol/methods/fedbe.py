"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning"): no messages of its own.

FedBE moves exactly what FedAvg moves (:mod:`shared_protocol.methods.fedavg`); its
server distils a Bayesian ensemble of sampled global models on a server-held
unlabeled set. This module is its registry entry.
"""

from __future__ import annotations

from ..registry import MethodSpec, register_method
from .fedavg import WHOLE_MODEL_FLAGS

register_method(MethodSpec(
    name="fedbe",
    summary="FedBE: Bayesian ensemble of sampled global models distilled with SWA on a server-held unlabeled set",
    server="cloud_server.methods.fedbe",
    edge="edge_agent.methods.fedbe",
    config="cloud_server.methods.fedbe:FedBEConfig",
    messages=("shared_protocol.methods.fedavg", "shared_protocol.secagg_messages"),  # it travels on FedAvg's messages
    flags=WHOLE_MODEL_FLAGS,
    docs="docs/methods/fedbe.md",
))
