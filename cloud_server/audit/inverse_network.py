"""An inverse network: a small convolutional decoder from maps back to images, trained on
the server's public images passed through the extractor it holds, then applied to the maps
it received (He et al.'s "inverse network" attack on split learning).

The server needs no private image to train it: the public set (the global test set the
server evaluates on) and the extractor are enough. The decoder ends in a sigmoid, so its
output is in ``[0, 1]`` pixel units.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import AttackInputError
from .scoring import PixelSpace

__all__ = ["FeatureDecoder", "InverseNetworkConfig", "decode_features", "train_inverse_network"]


@dataclass(frozen=True)
class InverseNetworkConfig:
    """The decoder and its training on the public set.

    Attributes:
        hidden_channels: width of the decoder's hidden convolutions.
        hidden_layers: 3 x 3 convolutions with ReLU before the output convolution.
        steps: Adam steps, each on one batch of public images.
        batch_size: public images per step.
        lr: Adam's learning rate.
        seed: seeds the decoder's initial weights and the batch order.
    """

    hidden_channels: int = 32
    hidden_layers: int = 2
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_channels", "hidden_layers", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise AttackInputError(f"InverseNetworkConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise AttackInputError(f"InverseNetworkConfig.lr must be > 0, got {self.lr}")


class FeatureDecoder(nn.Module):
    """``hidden_layers`` x (conv3x3 + ReLU), then conv3x3 to the image's channels and a sigmoid.

    Keeps the spatial size: it inverts extractors that keep it (the conv stems the edge
    models upload from).
    """

    def __init__(self, feature_channels: int, image_channels: int, hidden_channels: int = 32, hidden_layers: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = feature_channels
        for _ in range(hidden_layers):
            layers += [nn.Conv2d(channels, hidden_channels, 3, padding=1), nn.ReLU(inplace=True)]
            channels = hidden_channels
        layers.append(nn.Conv2d(channels, image_channels, 3, padding=1))
        self.body = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (N, C_f, H, W)
        return torch.sigmoid(self.body(features))  # (N, C, H, W) in [0, 1]


def train_inverse_network(extractor: nn.Module, public: torch.Tensor, pixels: PixelSpace,
                          config: InverseNetworkConfig = InverseNetworkConfig(),
                          map_noise: Callable[[torch.Tensor], torch.Tensor] | None = None) -> FeatureDecoder:
    """Train a decoder from the extractor's maps of ``public`` back to ``public``; with
    ``map_noise``, from each batch of maps as it transforms them (the agents' noise, drawn
    afresh every step: the decoder learns to see through it).

    Args:
        extractor: the extractor the server holds (copied, run in eval mode, not trained).
        public: the server's public images ``(M, C, H, W)`` in ``[0, 1]``.
        pixels: the normalisation the agents' loaders apply before the extractor.
        config: the decoder and its training.

    Returns:
        The trained decoder, in eval mode.

    Raises:
        AttackInputError: no public images, or an extractor that changes the spatial size.
    """
    if public.dim() != 4 or public.shape[0] == 0:
        raise AttackInputError(f"expected public images (M, C, H, W), got shape {tuple(public.shape)}")
    model = copy.deepcopy(extractor).float().eval()
    with torch.no_grad():
        features = model(pixels.to_model(public.float()))  # (M, C_f, H_f, W_f)
    if features.shape[-2:] != public.shape[-2:]:
        raise AttackInputError(f"the decoder keeps the spatial size; the extractor maps {tuple(public.shape[-2:])} "
                               f"images to {tuple(features.shape[-2:])} maps")
    generator = torch.Generator().manual_seed(config.seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)  # the decoder's default initialisation draws from the global generator
    try:
        decoder = FeatureDecoder(features.shape[1], public.shape[1], config.hidden_channels, config.hidden_layers)
    finally:
        torch.random.set_rng_state(torch_state)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=config.lr)
    targets = public.float()
    batch = min(config.batch_size, targets.shape[0])
    order = torch.randperm(targets.shape[0], generator=generator)
    cursor = 0
    decoder.train()
    for _ in range(config.steps):
        if cursor + batch > order.numel():
            order, cursor = torch.randperm(targets.shape[0], generator=generator), 0
        index = order[cursor : cursor + batch]
        cursor += batch
        inputs = features[index] if map_noise is None else map_noise(features[index])
        loss = (decoder(inputs) - targets[index]).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return decoder.eval()


@torch.no_grad()
def decode_features(decoder: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """Apply a decoder to the received maps ``(N, C_f, H, W)``: reconstructions ``(N, C, H, W)`` in ``[0, 1]``."""
    if features.dim() != 4 or features.shape[0] == 0:
        raise AttackInputError(f"expected received maps (N, C, H, W), got shape {tuple(features.shape)}")
    return decoder.eval()(features.float()).clamp(0.0, 1.0)
