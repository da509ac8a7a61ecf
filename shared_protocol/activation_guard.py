"""What protects the activations an agent uploads (FedGKT's feature maps, split learning's
activations): the agent's half of the settings, sent with every round, read by both methods.

* ``map_clip_norm`` C and ``map_noise_multiplier`` z: each uploaded map is scaled to an L2
  norm of at most C, then Gaussian noise of standard deviation ``z * C`` is added to it, drawn
  once per released map from a key the agent keeps (``edge_agent/activation_guard.py``).
* ``nopeek_alpha``: the agent's training loss gains ``alpha * dCor(images, maps)`` (NoPeek), so
  the extractor learns maps that correlate less with the images. Only an extractor that trains
  can learn anything from it.

torch-free: the wire and the server's checks use it without the edge's torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ActivationGuard"]


@dataclass(frozen=True)
class ActivationGuard:
    """The activation defences of one round; all off by default (zeros)."""

    map_clip_norm: float = 0.0  # C; 0: maps go up as extracted
    map_noise_multiplier: float = 0.0  # z; the noise's standard deviation is z * C
    nopeek_alpha: float = 0.0  # weight of the distance-correlation loss; 0: off

    def __post_init__(self) -> None:
        for key in ("map_clip_norm", "map_noise_multiplier", "nopeek_alpha"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
        if self.map_noise_multiplier > 0 and self.map_clip_norm == 0:
            raise ValueError(f"map_noise_multiplier = {self.map_noise_multiplier} needs map_clip_norm > 0: the noise is "
                             "scaled to the clipping norm (noise std = map_noise_multiplier * map_clip_norm); set "
                             "map_clip_norm, or map_noise_multiplier = 0")

    @property
    def clips(self) -> bool:
        return self.map_clip_norm > 0

    @property
    def noisy(self) -> bool:
        return self.map_noise_multiplier > 0

    @property
    def nopeek(self) -> bool:
        return self.nopeek_alpha > 0

    @property
    def active(self) -> bool:
        return self.clips or self.nopeek

    @property
    def noise_std(self) -> float:
        return self.map_noise_multiplier * self.map_clip_norm

    def describe(self) -> dict[str, Any]:
        """What is on and with which parameters (for run reports); ``{}`` when nothing is."""
        out: dict[str, Any] = {}
        if self.clips:
            out["map_clip_norm"] = self.map_clip_norm
        if self.noisy:
            out["map_noise_multiplier"] = self.map_noise_multiplier
            out["noise_std"] = self.noise_std
        if self.nopeek:
            out["nopeek_alpha"] = self.nopeek_alpha
        return out

    @classmethod
    def of(cls, config: Any) -> "ActivationGuard":
        """The guard a round config (``GktRoundConfig``, ``SplitRoundConfig``) carries in its flat keys."""
        return cls(float(config.map_clip_norm), float(config.map_noise_multiplier), float(config.nopeek_alpha))
