"""FedKD's ``[fedkd]`` table: :class:`FedKdConfig` (Eq. 9's threshold schedule among it)
and the keys of the agents' half (``FedKdRoundConfig``) written in the table itself."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import models.mentor  # noqa: F401  (registers the mentor architectures, e.g. resnet20)
from models import get_model_spec
from shared_protocol import svd
from shared_protocol.configs import EmbeddedRoundConfig, config_from_table
from shared_protocol.methods.fedkd import SYNC_CODECS, UPLOAD_KINDS, FedKdRoundConfig

__all__ = ["EDGE_KEYS", "WEIGHTINGS", "FedKdConfig"]

WEIGHTINGS = ("samples", "uniform")


# How the [fedkd] table names the fields of the FedKdRoundConfig that FedKdConfig holds: by
# their own names; the round's global version and threshold are the server's, per round, and
# updates always travel SVD-factored.
EDGE_KEYS = EmbeddedRoundConfig(FedKdRoundConfig, "edge", derived=("global_version", "threshold", "upload", "upload_codec"))


@dataclass(frozen=True)
class FedKdConfig:
    """``[fedkd]``. Defaults: T_start = 0.95, T_end = 0.98 (the authors' code, ``wuch15/FedKD`` parameters.py: the
    paper's text leaves them to its Supplementary Information), ResNet-56 mentor and
    ResNet-8 mentee; ``resnet20`` is a mentor three times cheaper for CPUs.

    ``schedule_rounds`` is the round in which T reaches T_end (Eq. 9's t = 1);
    0 (the default) means the run's last round (``[server] rounds``).
    """

    # One line per key of the [fedkd] table (docs/configuration.md is rendered from it by
    # bench/render_results.py; keys sharing a line are comma-separated).
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "mentor_model, mentee_model": "each agent's private mentor, and the shared mentee (`resnet20`: a cheaper mentor "
                                      "for CPUs)",
        "threshold_start, threshold_end, schedule_rounds": "the uploads' SVD energy threshold rises from start to end "
                                                           "(Eq. 9) by round `schedule_rounds` (0: the last)",
        "upload, gradient_lr": "`update`: the round's mentee change, factored; `gradient`: the mean gradient at the "
                               "global mentee, which the server steps along by `gradient_lr`",
        "weighting": "`samples` (FedAvg) or `uniform` (Algorithm 1's g / N)",
        "local_epochs, batch_size, optimizer, mentor_lr, mentee_lr, momentum, weight_decay":
            "the agents' local training, sent with every round",
        "hidden_loss, attention_loss": "sent to agents: Eq. 5's MSE of the hidden states, and that of the attention maps",
        "sync_codec": "the whole mentee, for agents that do not hold the current one",
        "mentor_distillation, mentee_distillation, adaptive_weight":
            "ablations (Figs. 2-3), sent only when off: `false`, the mentor (mentee) learns from the labels only; "
            "`adaptive_weight = false` weights the distillation and hidden terms 1, not 1 / (L^t_t + L^t_s)",
    }

    mentee_model: str = "resnet8"
    mentor_model: str = "resnet56"
    threshold_start: float = 0.95
    threshold_end: float = 0.98
    schedule_rounds: int = 0  # 0: the run's rounds
    upload: str = "update"  # update | gradient
    gradient_lr: float = 0.1  # eta_s of the server's step in gradient mode
    weighting: str = "samples"  # samples (FedAvg) | uniform (Algorithm 1's g / N)
    # The agents' local training, sent as RoundStart.config: local_epochs, batch_size, optimizer,
    # mentor_lr, mentee_lr, momentum, weight_decay, hidden_loss, attention_loss and the ablation
    # switches mentor_distillation, mentee_distillation, adaptive_weight; all written in
    # the [fedkd] table itself (EDGE_KEYS). Its upload follows ``upload``, its threshold Eq. 9.
    edge: FedKdRoundConfig = field(default_factory=FedKdRoundConfig)
    sync_codec: str = "zstd"  # the whole mentee, for agents that do not hold the current one

    def __post_init__(self) -> None:
        for role in ("mentee_model", "mentor_model"):
            if get_model_spec(getattr(self, role)).input_kind != "image":
                raise ValueError(f"fedkd.{role} must take images, {getattr(self, role)!r} takes feature maps")
        svd.check_threshold(self.threshold_start)
        svd.check_threshold(self.threshold_end)
        if isinstance(self.schedule_rounds, bool) or not isinstance(self.schedule_rounds, int) or self.schedule_rounds < 0:
            raise ValueError(f"fedkd.schedule_rounds must be an int >= 0 (0: the run's rounds), got {self.schedule_rounds!r}")
        if self.upload not in UPLOAD_KINDS:
            raise ValueError(f"fedkd.upload must be one of {UPLOAD_KINDS}, got {self.upload!r}")
        if self.gradient_lr <= 0:
            raise ValueError(f"fedkd.gradient_lr must be > 0, got {self.gradient_lr}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"fedkd.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.sync_codec not in SYNC_CODECS:
            raise ValueError(f"fedkd.sync_codec must be one of {SYNC_CODECS}, got {self.sync_codec!r}")
        object.__setattr__(self, "edge", replace(self.edge, upload=self.upload))  # the agents upload what the server takes

    def horizon(self, run_rounds: int) -> int:
        """The round in which T reaches T_end: ``schedule_rounds``, or the run's ``run_rounds`` if that is 0."""
        horizon = self.schedule_rounds or run_rounds
        if horizon < 1:
            raise ValueError("fedkd: Eq. 9's schedule runs over the run's rounds, which are not known here "
                             "(ServerContext.rounds = 0); set [fedkd] schedule_rounds")
        return horizon

    def threshold(self, round_: int, run_rounds: int = 0) -> float:
        """T(t) of Eq. 9 for ``round_`` (t = 0 in round 1, 1 from the horizon on: see :meth:`horizon`)."""
        horizon = self.horizon(run_rounds)
        return svd.threshold_at(svd.round_progress(min(round_, horizon), horizon), self.threshold_start, self.threshold_end)

    def round_config(self, round_: int, global_version: int, run_rounds: int = 0) -> FedKdRoundConfig:
        return replace(self.edge, global_version=global_version, threshold=self.threshold(round_, run_rounds))

    def to_table(self) -> dict[str, Any]:
        """The flat ``[fedkd]`` table this config reads back from (reports, checkpoints)."""
        return EDGE_KEYS.table_of(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "FedKdConfig":
        return config_from_table(cls, raw, "fedkd", embedded=EDGE_KEYS)
