"""Differential privacy's two numeric steps and the settings an agent receives for them.

DP-FedAvg (McMahan et al. 2018; Flower's ``DifferentialPrivacy{Server,Client}SideFixedClipping``
and ``LocalDpMod``) treats each agent's *update* (its trained state minus the global state it
started from, every float entry: parameters and BatchNorm's running statistics) as one vector,
clips it to an L2 norm of at most ``C`` and adds Gaussian noise of standard deviation ``z * C``
to the sum of the clipped updates (``z``: the noise multiplier). Where each step runs is the
mode (:data:`DP_FEDAVG_MODES`):

- ``central``: the server clips every update and adds the noise to their sum;
- ``client_clipping``: the agent clips before sending, the server adds the noise (and clips
  again, which changes nothing for an agent that clipped);
- ``local``: the agent clips and adds noise of standard deviation ``z * C`` to its own update,
  so the server never sees it without noise.

:func:`clip_update` and :func:`gaussian_noise` are the two steps, numpy only, so that both sides
call the same code. Under secure aggregation the agent clips (``local``: and noises) before
masking, and with ``client_clipping`` the server noises the unmasked sum (cloud_server/privacy.py).

:class:`DpAgentSettings` is what an agent needs of the run's privacy settings (the server's
Welcome carries it as ``settings["privacy"]``); DP-SGD on the device (Opacus) is configured
there too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .configs import round_config_from_wire

__all__ = ["DP_FEDAVG_MODES", "DpAgentSettings", "clip_update", "float_names", "gaussian_noise", "update_norm"]

DP_FEDAVG_MODES = ("off", "central", "client_clipping", "local")


def float_names(state: Mapping[str, np.ndarray]) -> list[str]:
    """The entries an update clips and noises: every float tensor (integer counters are not data)."""
    return [n for n, a in state.items() if np.asarray(a).dtype.kind == "f"]


def update_norm(update: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``update``'s entries taken as one vector."""
    return float(math.sqrt(sum(float(np.sum(np.asarray(u, dtype=np.float64) ** 2)) for u in update.values())))


def clip_update(update: Mapping[str, np.ndarray], clip_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """``update`` scaled by ``min(1, clip_norm / ||update||)`` (float64 entries), and its norm before."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    norm = update_norm(update)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {n: np.asarray(u, dtype=np.float64) * scale for n, u in update.items()}, norm


def gaussian_noise(shapes: Mapping[str, Sequence[int]], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Independent ``N(0, std^2)`` draws, float64, one array per entry of ``shapes``."""
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"noise std must be a finite number >= 0, got {std!r}")
    return {n: std * rng.standard_normal(tuple(shape)) for n, shape in shapes.items()}


@dataclass(frozen=True)
class DpAgentSettings:
    """The privacy settings an agent applies (the server's ``[server]`` ``dp_*`` keys, sent in
    the Welcome's ``settings["privacy"]``): DP-FedAvg's clipping and local noise, and DP-SGD."""

    mode: str = "off"  # one of DP_FEDAVG_MODES; the agent acts on client_clipping and local
    clip_norm: float = 0.0  # C
    noise_multiplier: float = 0.0  # z (local mode: the agent's own noise)
    dpsgd: bool = False
    dpsgd_noise_multiplier: float = 0.0
    dpsgd_max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        if self.mode not in DP_FEDAVG_MODES:
            raise ValueError(f"privacy mode must be one of {DP_FEDAVG_MODES}, got {self.mode!r}")
        if self.mode != "off" and not self.clip_norm > 0:
            raise ValueError(f"DP-FedAvg ({self.mode}) needs a clip norm > 0, got {self.clip_norm!r}")
        if self.dpsgd and not self.dpsgd_max_grad_norm > 0:
            raise ValueError(f"DP-SGD needs a max grad norm > 0, got {self.dpsgd_max_grad_norm!r}")
        if self.noise_multiplier < 0 or self.dpsgd_noise_multiplier < 0:
            raise ValueError("noise multipliers must be >= 0")

    @property
    def agent_clips(self) -> bool:
        return self.mode in ("client_clipping", "local")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> "DpAgentSettings":
        return round_config_from_wire(cls, raw, "privacy settings")
