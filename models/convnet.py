"""The small plain CNNs the KD papers train: convolutions with ReLU and max pooling, then
fully connected layers, no normalisation layer at all (so nothing to average or recompute
about batch statistics, and none of GroupNorm's slower convergence).

One generic :class:`ConvNet` with the variants given as data (:class:`ConvLayout`), in the
style of :mod:`models.resnet`:

=========  =====================================================  ===========================
name       layout                                                 paper
=========  =====================================================  ===========================
simplecnn  conv5x5(6) pool, conv5x5(16) pool, fc 120, fc 84, fc   FedDistill (Table I: CIFAR-10
                                                                  and MNIST "SimpleCNN"; Sec.
                                                                  IV-A follows MOON, its [13])
convnet    conv3x3(32) pool, conv3x3(64) pool, conv3x3(64), fc    FedBE (Sec. 5.1, Table 1
           64, fc                                                 "ConvNet": "3 convolutional
                                                                  and 2 fully-connected layers")
=========  =====================================================  ===========================

The layer widths are those of the authors' released code (MOON's ``SimpleCNN``, FedBE's
``CNNCifar``); the papers' text names the models only. Every conv is unpadded, stride 1,
with a bias; each ``pool`` is a 2x2 max pool after the ReLU.

Every image in EdgeSplit is 32 x 32 (fldata pads Fashion-MNIST's 28 x 28 by 2 pixels), where
the networks are exactly the authors' CIFAR ones (16 x 5 x 5 and 64 x 4 x 4 values at the
flatten). So that a registered model still builds and runs on other sizes (tests, a future
dataset), an adaptive average pool to that ``pooled_size`` sits before the flatten, as in
torchvision's VGG / AlexNet: the identity on 32 x 32 images. Images below ``min_image_size``
leave no map to pool and are refused.

The model is a stack (``feature_map``) and a vector (``embed``) before one linear ``head``,
the view :mod:`models.heads` gives every method (FedDistill's E and FC, FedKD's hidden
states): for these CNNs the "features" are the last hidden fc layer's output (84 / 64
values), the input of the final linear layer.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn

from models.registry import register_model

__all__ = ["CONVNET_LAYOUT", "SIMPLECNN_LAYOUT", "ConvLayout", "ConvNet", "convnet", "simplecnn"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ConvLayout:
    """A plain CNN: one entry per conv in ``channels`` / ``kernels`` / ``pools``.

    Attributes:
        channels: Output channels of each conv.
        kernels: Kernel size of each conv (square, no padding, stride 1).
        pools: Whether a 2x2 max pool follows the conv's ReLU.
        pooled_size: The last map is average-pooled to ``pooled_size x pooled_size``
            before the flatten (the identity at that map size).
        hidden: Widths of the fully connected layers (each with a ReLU) before the linear head.
    """

    channels: tuple[int, ...]
    kernels: tuple[int, ...]
    pools: tuple[bool, ...]
    pooled_size: int
    hidden: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.channels:
            raise ValueError("ConvLayout needs at least one conv")
        if not len(self.channels) == len(self.kernels) == len(self.pools):
            raise ValueError(f"channels, kernels and pools need one entry per conv, got "
                             f"{len(self.channels)}, {len(self.kernels)} and {len(self.pools)}")
        for value in (*self.channels, *self.kernels, self.pooled_size, *self.hidden):
            _positive("ConvLayout entry", value)
        if not all(isinstance(p, bool) for p in self.pools):
            raise ValueError(f"ConvLayout.pools must be booleans, got {self.pools!r}")

    def map_size(self, image_size: int) -> int:
        """Side of the last conv map for ``image_size x image_size`` images (< 1: nothing left)."""
        size = image_size
        for kernel, pool in zip(self.kernels, self.pools):
            size -= kernel - 1
            if pool:
                size //= 2
        return size

    @property
    def min_image_size(self) -> int:
        """The smallest image side that leaves a map of at least 1 x 1."""
        size = 1
        while self.map_size(size) < 1:
            size += 1
        return size


#: FedDistill's SimpleCNN (MOON's): 2 convs of 5x5 (6, 16 channels) each followed by a max
#: pool, then fc 120 and fc 84; 16 x 5 x 5 at the flatten on 32 x 32 images.
SIMPLECNN_LAYOUT = ConvLayout(channels=(6, 16), kernels=(5, 5), pools=(True, True), pooled_size=5, hidden=(120, 84))
#: FedBE's ConvNet: 3 convs of 3x3 (32, 64, 64), a max pool after the first two, then fc 64;
#: 64 x 4 x 4 at the flatten on 32 x 32 images.
CONVNET_LAYOUT = ConvLayout(channels=(32, 64, 64), kernels=(3, 3, 3), pools=(True, True, False), pooled_size=4, hidden=(64,))


class ConvNet(nn.Module):
    """A plain CNN from a :class:`ConvLayout`: ``forward(x) -> logits``.

    ``feature_map`` / ``embed`` / ``head`` are the three parts ``forward`` chains
    (:mod:`models.heads`)."""

    def __init__(self, layout: ConvLayout, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.layout = layout
        self.num_classes = _positive("num_classes", num_classes)
        self.in_channels = _positive("in_channels", in_channels)
        layers: list[nn.Module] = []
        channels = self.in_channels
        for out, kernel, pool in zip(layout.channels, layout.kernels, layout.pools):
            layers += [nn.Conv2d(channels, out, kernel_size=kernel), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(layout.pooled_size)
        fcs: list[nn.Module] = []
        width = channels * layout.pooled_size**2
        for out in layout.hidden:
            fcs += [nn.Linear(width, out), nn.ReLU(inplace=True)]
            width = out
        self.hidden = nn.Sequential(*fcs)
        self.fc = nn.Linear(width, self.num_classes)
        # PyTorch's default initialisation, as in the authors' code.

    @property
    def head(self) -> nn.Linear:
        """The final linear classifier."""
        return self.fc

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        """The last conv stage's output ``(B, C, h, w)`` (after its ReLU / pool)."""
        if min(x.shape[-2:]) < self.layout.min_image_size:
            raise ValueError(f"{type(self).__name__} needs images of at least {self.layout.min_image_size} x "
                             f"{self.layout.min_image_size}, got {tuple(x.shape[-2:])}")
        return self.features(x)  # (B, C, h, w)

    def embed(self, feature_map: torch.Tensor) -> torch.Tensor:  # (B, C, h, w)
        """What the head sees: pooled, flattened and through the hidden fc layers, ``(B, D)``."""
        pooled = torch.flatten(self.pool(feature_map), 1)  # (B, C * s * s)
        return self.hidden(pooled)  # (B, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.fc(self.embed(self.feature_map(x)))  # (B, num_classes)


@register_model("simplecnn", input_kind="image")
def simplecnn(num_classes: int = 10, in_channels: int = 3) -> ConvNet:
    """FedDistill's SimpleCNN (its Table I; MOON's): 2 convs 5x5 (6, 16) + fc 120, 84 + head; no normalisation."""
    return ConvNet(SIMPLECNN_LAYOUT, num_classes=num_classes, in_channels=in_channels)


@register_model("convnet", input_kind="image")
def convnet(num_classes: int = 10, in_channels: int = 3) -> ConvNet:
    """FedBE's ConvNet (its Table 1): 3 convs 3x3 (32, 64, 64) + fc 64 + head; no normalisation."""
    return ConvNet(CONVNET_LAYOUT, num_classes=num_classes, in_channels=in_channels)
