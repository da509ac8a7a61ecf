"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning"): no messages of its own.

FedBE moves exactly what FedAvg moves (:mod:`shared_protocol.methods.fedavg`); its
server distils a Bayesian ensemble of sampled global models on a server-held
unlabeled set. This module is its registry entry.
"""

from __future__ import annotations

from ..registry import BenchRun, MethodSpec, ResultsRow, register_method
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
    # 10 sampled models (the paper's M) plus the mean and the clients, distilled on the server-held
    # unlabeled set: the training split minus the subset the agents take. The server's work per round
    # (ensemble on the unlabeled set, SWA distillation) does not shrink with the agents' data: it is
    # sized per scale. SWA collects every 25 steps after the warm-up as in the paper, over a shorter
    # distillation (300 unlabeled images, 100 steps) for 2 CPU cores.
    bench=(BenchRun(
        "fedbe-resnet56", {"sampled_models": 10, "distill_batch_size": 32, "unlabeled_dataset": "fashion-mnist"},
        per_scale={
            "quick": {"unlabeled_samples": 100, "validation_samples": 100, "distill_steps": 30, "swa_warmup_steps": 15,
                      "swa_cycle_steps": 5},
            "full": {"unlabeled_samples": 300, "validation_samples": 500, "distill_steps": 100, "swa_warmup_steps": 50,
                     "swa_cycle_steps": 25},
        },
        train_samples_key="agent_train_samples", order=3,
        rows=(ResultsRow("FedBE (ResNet-56)", "model", "the distilled global model's averaged statistics"),)),),
))
