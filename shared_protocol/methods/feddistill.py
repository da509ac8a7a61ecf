"""FedDistill (Song et al., "FedDistill: Global Model Distillation for Local Model
De-Biasing in Non-IID Federated Learning"): the round config only.

FedDistill moves exactly what FedAvg moves (the global model down, each
agent's trained model up; :mod:`shared_protocol.methods.fedavg`'s messages),
so it has no message types of its own. What it adds is the loss weights of
Eqs. 3 and 10, which travel in ``RoundStart.config["feddistill"]`` next to
FedAvg's round config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..configs import round_config_from_wire
from ..registry import MethodSpec, register_method
from .fedavg import WHOLE_MODEL_FLAGS

#: The key of ``RoundStart.config`` that holds :class:`FedDistillRoundConfig`.
ROUND_CONFIG_KEY = "feddistill"


@dataclass(frozen=True)
class FedDistillRoundConfig:
    """The loss weights an agent needs for one FedDistill round.

    ``alpha_*`` weight the three parts of the group-distillation loss GD (Eq. 3):
    true class (TC-KD, Eq. 4), rich-sample classes (RC-KD, Eq. 5), few-sample
    classes (FC-KD, Eq. 6). ``beta_*`` weight the three terms of the local
    objective (Eq. 10): L_L = GD(global || local) (Eq. 7), L_E = CE of the local
    features through the global classifier (Eq. 8), L_FC = GD(global || global
    features through the local classifier) (Eq. 9).

    ``few_sample_threshold`` is gamma: a class whose share of the agent's own
    training samples exceeds it is a rich-sample class, otherwise a few-sample
    class. ``None`` means the paper's 1/|C|, which the agent computes from the
    run's number of classes. Every field is required on the wire; the defaults
    live in the server's config (``cloud_server.methods.feddistill.FedDistillConfig``).
    """

    alpha_t: float
    alpha_r: float
    alpha_f: float
    beta_l: float
    beta_e: float
    beta_fc: float
    few_sample_threshold: float | None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "few_sample_threshold" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"feddistill.{f.name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"feddistill.{f.name} must be >= 0, got {value}")
        if self.few_sample_threshold is not None and self.few_sample_threshold > 1:
            raise ValueError(f"feddistill.few_sample_threshold is a share of samples in [0, 1], got {self.few_sample_threshold}")

    def threshold(self, num_classes: int) -> float:
        """gamma for a run with ``num_classes`` classes (the paper's 1/|C| unless set)."""
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        return 1.0 / num_classes if self.few_sample_threshold is None else float(self.few_sample_threshold)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> "FedDistillRoundConfig":
        """Parse an agent's copy of the config; anything wrong is a :class:`ValueRangeError`."""
        return round_config_from_wire(cls, raw, "feddistill round config")


# -- the registry's entry ------------------------------------------------------------ #

register_method(MethodSpec(
    name="feddistill",
    summary="FedDistill: group distillation (true / rich / few classes) with the global model",
    server="cloud_server.methods.feddistill",
    edge="edge_agent.methods.feddistill",
    config="cloud_server.methods.feddistill:FedDistillConfig",
    messages=("shared_protocol.methods.fedavg", "shared_protocol.secagg_messages", __name__),  # it travels on FedAvg's messages
    flags=WHOLE_MODEL_FLAGS,
    docs="docs/methods/feddistill.md",
))
