"""FedDistill server step (Song et al., group distillation): FedAvg's server plus
the loss weights for the agents.

The server does what FedAvg does (sample-weighted mean of the uploaded models,
:func:`cloud_server.aggregation.weighted_mean`, through
:class:`~cloud_server.methods.fedavg.FedAvgServer`); all of FedDistill happens
in the agents' local loss (``edge_agent/methods/feddistill.py``). The server's
part is to send the weights of Eqs. 3 and 10 in every RoundStart
(``config["feddistill"]``) and to report the agents' mean loss terms per round.

Defaults: the paper tunes alpha_t, alpha_r, alpha_f on {0.0, 0.1, ..., 1.0},
beta_L on {0.5, 0.8, 1.0, 1.1, 1.2, 1.4} and beta_E, beta_FC on {0.1, ..., 0.5},
and does not print the values it kept; the defaults below follow its
sensitivity study (Sec. IV-D, Fig. 9, Table V) as explained in
``docs/methods/feddistill.md``. gamma = 1/|C| is stated in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from models.cost import forward_flops_per_sample
from models.heads import linear_head
from shared_protocol.messages import RoundEnd
from shared_protocol.methods.feddistill import ROUND_CONFIG_KEY, FedDistillRoundConfig

from .base import RoundOutcome, ServerContext, register_server_method
from .fedavg import FedAvgConfig, FedAvgServer

#: Per-round means over the agents (sample-weighted) that go into the report's round record.
_REPORTED_METRICS = ("loss_ce", "loss_local_gd", "loss_extractor_ce", "loss_classifier_gd", "few_sample_classes")


@dataclass(frozen=True)
class FedDistillConfig(FedAvgConfig):
    """``[feddistill]``: FedAvg's keys (model, local training, codecs) plus the loss weights.

    alpha_t = 0.0 -- Fig. 9a: accuracy falls as alpha_t grows from 0 to 1; Table V's
                     best rows have no TC-KD.
    alpha_r = 0.5 -- Fig. 9c: both 0.0 and 1.0 are worse; RC-KD "should be suppressed".
    alpha_f = 1.0 -- Fig. 9b: accuracy rises up to 0.8 and still (less) up to 1.0.
    beta_l  = 1.4 -- Fig. 9d: the last-10-round mean accuracy grows with beta_L
                     (1.4 is the top of the searched grid).
    beta_e  = 0.3, beta_fc = 0.3 -- the middle of the searched {0.1, ..., 0.5}; the
                     paper states no preferred value.
    few_sample_threshold = None -- gamma = 1/|C| (paper, Sec. IV-A).
    """

    TABLE: ClassVar[str] = "feddistill"
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "alpha_t, alpha_r, alpha_f": "group-distillation weights of TC-KD, RC-KD, FC-KD (Eq. 3)",
        "beta_l, beta_e, beta_fc": "weights of `L_L`, `L_E`, `L_FC` in the local loss (Eq. 10)",
        "few_sample_threshold": "gamma: a class is rich on an agent iff its share of the agent's samples exceeds it; "
                                "unset: 1/|C|",
    }

    alpha_t: float = 0.0
    alpha_r: float = 0.5
    alpha_f: float = 1.0
    beta_l: float = 1.4
    beta_e: float = 0.3
    beta_fc: float = 0.3
    few_sample_threshold: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.distill_round_config()  # validates the loss weights

    def distill_round_config(self) -> FedDistillRoundConfig:
        return FedDistillRoundConfig(
            alpha_t=self.alpha_t, alpha_r=self.alpha_r, alpha_f=self.alpha_f,
            beta_l=self.beta_l, beta_e=self.beta_e, beta_fc=self.beta_fc,
            few_sample_threshold=self.few_sample_threshold,
        )


@register_server_method
class FedDistillServer(FedAvgServer):
    name = "feddistill"
    config_class = FedDistillConfig

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        try:
            self.head = linear_head(self.model)
        except TypeError as exc:
            raise ValueError(f"feddistill.model {self.config.model!r} has no linear classifier head to split at: {exc}") from None
        if not isinstance(self.config, FedDistillConfig):
            raise TypeError(f"{type(self).__name__}.config_class must build a FedDistillConfig, got {type(self.config).__name__}")
        self.distill = self.config.distill_round_config()
        self._round_figures: dict[int, dict[str, Any]] = {}

    def extra_round_config(self, round_: int, agent: str) -> dict[str, Any]:
        return {ROUND_CONFIG_KEY: self.distill.to_dict()}

    def model_info(self) -> dict[str, Any]:
        info = super().model_info()
        # An agent's training step also runs the frozen global model forward on every
        # sample, and the two cross-head passes (see FedDistillEdge).
        shape = (self.ctx.in_channels, 32, 32)
        extra = forward_flops_per_sample(self.model, shape) + 4 * 2 * self.head.in_features * self.head.out_features
        info["edge"]["train_flops_per_sample"] += extra
        return info

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        outcome = super().complete(round_, ends, evaluate)
        figures: dict[str, Any] = {}
        for key in _REPORTED_METRICS:
            pairs = [(float(ends[a].metrics[key]), ends[a].num_samples) for a in outcome.used_agents
                     if isinstance(ends[a].metrics.get(key), (int, float)) and ends[a].num_samples > 0]
            total = sum(n for _, n in pairs)
            if total:
                figures[key] = sum(v * n for v, n in pairs) / total
        self._round_figures = {round_: figures}  # only the latest round is asked for
        return outcome

    def round_report(self, round_: int) -> dict[str, Any]:
        """The used agents' sample-weighted mean loss terms of Eq. 10 and number of few-sample classes."""
        return dict(self._round_figures.get(round_, {}))


# -- edgesplit local: this method's [feddistill] table --

# FedAvg's keys (model, local epochs, codecs); the loss weights keep FedDistillConfig's defaults.
from .fedavg import launcher_table  # noqa: E402,F401
