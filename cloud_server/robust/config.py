"""The ``[server]`` robustness settings (:class:`RobustnessConfig`), the bounds each
aggregation rule needs, and the error an implausible upload is refused with.

The settings are described in :mod:`cloud_server.robust` and docs/configuration.md; a
configuration a rule can never honour with ``expected_agents`` is refused here, when the
server starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared_protocol.errors import ProtocolError

__all__ = [
    "AGGREGATION_RULES",
    "DIRECTION_MIN_AGENTS",
    "MAD_TO_SD",
    "PLAUSIBLE_MIN_COSINE",
    "QUARANTINE_RELEASES",
    "ImplausibleUploadError",
    "RobustnessConfig",
    "minimum_agents",
    "tolerated",
]

AGGREGATION_RULES = ("mean", "trimmed_mean", "median", "krum", "multi_krum")
QUARANTINE_RELEASES = ("plausible", "never")
MAD_TO_SD = 1.4826  # MAD x this estimates the standard deviation of a normal sample
# The default of ``plausible_min_cosine``: -1, off; why, in RobustnessConfig.
PLAUSIBLE_MIN_COSINE = -1.0
DIRECTION_MIN_AGENTS = 3  # with two, the median is their mean: the larger update sets it, whatever its sign


class ImplausibleUploadError(ProtocolError):
    """An upload that decodes and validates but whose numbers cannot be honest (refused
    at the door). ``reason`` is the specific code: ``out_of_range``, ``implausible_norm``,
    ``implausible_factors``, ``implausible_statistics``..."""

    code = "implausible"

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail




def minimum_agents(rule: str, f: int) -> int:
    """The fewest agents ``rule`` needs to tolerate ``f`` bad ones."""
    if rule in ("krum", "multi_krum"):
        return 2 * f + 3
    if rule in ("trimmed_mean", "median"):
        return 2 * f + 1
    return 1


def tolerated(n: int, tolerate: float) -> int:
    """f for a round of ``n`` agents: ``tolerate`` itself when it is a count (>= 1), else
    ``floor(tolerate * n)``."""
    return int(tolerate) if tolerate >= 1 else int(math.floor(tolerate * n + 1e-9))


@dataclass(frozen=True)
class RobustnessConfig:
    """The ``[server]`` robustness keys (see :mod:`cloud_server.robust` and docs/configuration.md)."""

    aggregation: str = "mean"
    aggregation_tolerate: float = 0
    clip_update_norm: float = 0.0  # 0: no clipping
    plausibility_checks: bool = True
    plausible_global_ratio: float = 10.0
    plausible_peer_ratio: float = 50.0
    plausible_mad: float = 6.0
    # An update whose cosine with the coordinate-wise median of the round's updates (three
    # or more agents) is below this is refused (implausible_direction); -1: off (no cosine is
    # below -1), the figures are still recorded (robustness.update_directions). Off by
    # default: under label skew honest agents point away from the median as far as a
    # sign-flipped agent does after round 1, so no threshold stops the flip without refusing
    # honest agents; at IID every honest cosine is positive and the flipped agent's negative,
    # so a fleet whose data is close to IID may set 0. The lowest honest cosine and the
    # flipped agent's per partition are in bench/experiments/direction_cosines.toml
    # (``summary.by_partition``; docs/configuration.md reads them).
    plausible_min_cosine: float = PLAUSIBLE_MIN_COSINE
    feature_abs_limit: float = 1.0e4  # FedGKT feature maps: |H| above this is out of range
    logit_abs_limit: float = 1.0e4  # FedGKT edge logits: |z_c| above this is out of range
    quarantine_after: int = 3  # 0: no quarantine
    quarantine_release: str = "plausible"
    # "plausible": consecutive rounds in which the checks that refused it judged its uploads and
    # refused none, before a quarantined agent is released (cloud_server/robust/ledger.py).
    quarantine_release_after: int = 1
    server_grad_clip_norm: float = 0.0  # 0: the server's training steps are not clipped
    server_loss_skip_factor: float = 0.0  # 0: no step is skipped for its loss (non-finite ones always are)
    expected_agents: int = 1  # from [server], for the bound check

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_RULES:
            raise ValueError(f"server.aggregation must be one of {AGGREGATION_RULES}, got {self.aggregation!r}")
        t = self.aggregation_tolerate
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 or (t >= 1 and float(t) != int(t)) or (0 < t < 1 and t >= 0.5):
            raise ValueError("server.aggregation_tolerate must be a count of bad agents (an integer >= 1), a fraction "
                             f"in (0, 0.5), or 0 (none), got {t!r}")
        if self.aggregation == "trimmed_mean" and t == 0:
            raise ValueError("server.aggregation = 'trimmed_mean' trims f agents at each end: set "
                             "server.aggregation_tolerate to a count >= 1 or a fraction in (0, 0.5)")
        if self.aggregation != "mean" or t:
            f = tolerated(self.expected_agents, t)
            need = minimum_agents(self.aggregation, f)
            if self.expected_agents < need:
                raise ValueError(
                    f"server.aggregation = {self.aggregation!r} with server.aggregation_tolerate = {t!r} (f = {f}) needs "
                    f"at least {need} agents per round, server.expected_agents is {self.expected_agents}: raise "
                    f"expected_agents, lower aggregation_tolerate, or choose another rule"
                )
        positive = {"plausible_global_ratio": self.plausible_global_ratio, "plausible_peer_ratio": self.plausible_peer_ratio,
                    "plausible_mad": self.plausible_mad, "feature_abs_limit": self.feature_abs_limit,
                    "logit_abs_limit": self.logit_abs_limit}
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"server.{name} must be a finite number > 0, got {value!r}")
        c = self.plausible_min_cosine
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not -1 <= c < 1:
            raise ValueError(f"server.plausible_min_cosine must be a number in [-1, 1) (-1: off), got {c!r}")
        for name in ("clip_update_norm", "server_grad_clip_norm", "server_loss_skip_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"server.{name} must be a finite number >= 0 (0: off), got {value!r}")
        if 0 < self.server_loss_skip_factor <= 1:
            raise ValueError(f"server.server_loss_skip_factor must be 0 (off) or > 1, got {self.server_loss_skip_factor}")
        if not isinstance(self.quarantine_after, int) or self.quarantine_after < 0:
            raise ValueError(f"server.quarantine_after must be an integer >= 0 (0: no quarantine), got {self.quarantine_after!r}")
        r = self.quarantine_release_after
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"server.quarantine_release_after must be an integer >= 1 (judged clean rounds), got {r!r}")
        if self.quarantine_release not in QUARANTINE_RELEASES:
            raise ValueError(f"server.quarantine_release must be one of {QUARANTINE_RELEASES}, got {self.quarantine_release!r}")

    @property
    def plain_mean(self) -> bool:
        """The papers' aggregation: the weighted mean, nothing clipped."""
        return self.aggregation == "mean" and not self.clip_update_norm

