"""The audit attacks what was uploaded: where the agents' activation guard clipped and noised
their maps (shared_protocol/activation_guard.py; the server knows its parameters, it sent
them), the attacks model the same clipping, and the inverse network is trained on public maps
clipped and noised the same way (a decoder that learned to denoise), not on clean ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from shared_protocol.activation_guard import ActivationGuard

__all__ = ["AsUploaded", "as_uploaded", "guard_of", "public_map_noise"]


def guard_of(method_config: Mapping[str, Any]) -> ActivationGuard:
    """The guard a run's ``[fedgkt]`` / ``[splitnn]`` table set (all off when it set none)."""
    return ActivationGuard(float(method_config.get("map_clip_norm", 0.0)), float(method_config.get("map_noise_multiplier", 0.0)),
                           float(method_config.get("nopeek_alpha", 0.0)))


def _clip_rows(maps: torch.Tensor, clip_norm: float) -> torch.Tensor:
    norms = maps.flatten(1).norm(dim=1).clamp_min(1e-12)  # (B,)
    return maps * (clip_norm / norms).clamp(max=1.0).view(-1, *([1] * (maps.dim() - 1)))


class AsUploaded(nn.Module):
    """An extractor followed by the agents' per-sample clipping: its output is what went up,
    less the noise."""

    def __init__(self, extractor: nn.Module, clip_norm: float) -> None:
        super().__init__()
        self.extractor = extractor
        self.clip_norm = float(clip_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return _clip_rows(self.extractor(x), self.clip_norm)  # (B, C_f, H_f, W_f)


def as_uploaded(extractor: nn.Module, guard: ActivationGuard) -> nn.Module:
    return AsUploaded(extractor, guard.map_clip_norm) if guard.clips else extractor


def public_map_noise(guard: ActivationGuard, seed: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Fresh ``N(0, (z C)^2)`` noise on a batch of (already clipped) public maps, or None when
    the agents added none."""
    if not guard.noisy:
        return None
    generator = torch.Generator().manual_seed(seed)
    std = guard.noise_std

    def noised(maps: torch.Tensor) -> torch.Tensor:
        return maps + std * torch.randn(maps.shape, generator=generator, dtype=maps.dtype)

    return noised
