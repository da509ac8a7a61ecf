"""The ResNets' building blocks: 3x3 / 1x1 convolutions, the normalisation layer
(BatchNorm or :func:`group_norm`), the FedML / torchvision initialisation, and the two
residual blocks (:class:`Bottleneck`, :class:`BasicBlock`), registered by name in
:data:`BLOCKS` for :class:`models.resnet.StageLayout`."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn as nn

#: Builds the normalisation layer after a conv from its channel count.
NormLayer = Callable[[int], nn.Module]


#: FedGKD Sec. 5.1: "For all the CV tasks, we set the channels of each group as 16."
GROUP_NORM_CHANNELS = 16


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with 16 channels per group (one group for a 16-channel layer, four for 64):
    FedGKD (Sec. 5.1) replaces BatchNorm by GroupNorm in its ResNet-8 because BN's running
    statistics fail on heterogeneous data."""
    if channels % GROUP_NORM_CHANNELS:
        raise ValueError(f"group_norm needs a multiple of {GROUP_NORM_CHANNELS} channels, got {channels}")
    return nn.GroupNorm(channels // GROUP_NORM_CHANNELS, channels)


def _check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as ``int`` if it is a positive integer, else raise ValueError.

    ``bool`` is rejected although it is an ``int`` subclass: ``num_classes=True``
    is always a config mistake.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution, padding 1, no bias (a BatchNorm always follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (a BatchNorm always follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def _init_weights(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """FedML/torchvision initialisation: He-normal (fan_out) convs, BN = identity.

    Linear layers keep PyTorch's default init, as in FedML. ``generator``: where the
    convolutions' draws come from (None: torch's global RNG; see :mod:`models.seeding`).
    """
    if any(p.is_meta for p in module.parameters()):
        # Built on the meta device by models.seeding, which replays these draws once the memory
        # exists; drawing into meta tensors would only import sympy (an agent stays light).
        return
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=generator)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 residual block with 4x channel expansion.

    The stride sits on the 3x3 conv (torchvision's "ResNet v1.5", as in FedML).
    The shortcut is a strided 1x1 conv + BN whenever the shape changes, which in
    these networks means the first block of every stage.
    """

    expansion: ClassVar[int] = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = conv1x1(in_planes, planes)
        self.bn1 = norm_layer(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = norm_layer(planes)
        self.conv3 = conv1x1(planes, out_planes)
        self.bn3 = norm_layer(out_planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(conv1x1(in_planes, out_planes, stride), norm_layer(out_planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_planes, H, W)
        identity = x if self.downsample is None else self.downsample(x)  # (B, 4*planes, H/s, W/s)
        out = self.relu(self.bn1(self.conv1(x)))  # (B, planes, H, W)
        out = self.relu(self.bn2(self.conv2(out)))  # (B, planes, H/s, W/s)
        out = self.bn3(self.conv3(out))  # (B, 4*planes, H/s, W/s)
        out = out + identity  # not in place: Opacus (DP-SGD) hooks forbid modifying a hooked layer's output
        return self.relu(out)


class BasicBlock(nn.Module):
    """3x3 -> 3x3 residual block, no expansion: He et al.'s CIFAR ResNets (6n + 2 layers),
    the family FedGKD's ResNet-8 (n = 1) belongs to. The shortcut is a strided 1x1 conv +
    norm whenever the shape changes."""

    expansion: ClassVar[int] = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(conv1x1(in_planes, planes, stride), norm_layer(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_planes, H, W)
        identity = x if self.downsample is None else self.downsample(x)  # (B, planes, H/s, W/s)
        out = self.relu(self.bn1(self.conv1(x)))  # (B, planes, H/s, W/s)
        out = self.bn2(self.conv2(out))  # (B, planes, H/s, W/s)
        out = out + identity  # not in place: Opacus (DP-SGD) hooks forbid modifying a hooked layer's output
        return self.relu(out)


BLOCKS: dict[str, type[Bottleneck] | type[BasicBlock]] = {"bottleneck": Bottleneck, "basic": BasicBlock}
