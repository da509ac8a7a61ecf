"""A deeper cut of FedGKT's ResNet-8 and the server models that take its maps.

``resnet8_stage1`` is ``resnet8`` cut after its (only) bottleneck stage instead of after the
conv stem: the extractor is stem + stage, ``(B, 64, H, W)`` out, and the classifier is the
pool and the linear head. Same weights, same FLOPs; what crosses the wire is four times
wider and two bottleneck blocks further from the image. ``resnet55_server_stage1`` /
``resnet109_server_stage1`` are the server trunks built for those 64-channel maps (their
first block's input is 64 channels, which is its output width: an identity shortcut).

Modules are built in the order their initial values are drawn (:mod:`models.seeding`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.registry import register_model
from models.resnet import FEATURE_CHANNELS, RESNET8_LAYOUT, RESNET56_LAYOUT, RESNET110_LAYOUT, ConvStem, ResNetTrunk
from models.resnet_blocks import BLOCKS, NormLayer, _check_positive_int, _init_weights

__all__ = ["STAGE1_CHANNELS", "PooledHead", "ResNet8Stage1Edge", "StemThenStage"]

#: Channels of ResNet-8's stage output: the deeper cut's maps.
STAGE1_CHANNELS = RESNET8_LAYOUT.out_channels


class StemThenStage(nn.Module):
    """ResNet-8's conv stem then its bottleneck stage: ``(B, C, H, W) -> (B, 64, H, W)``."""

    def __init__(self, in_channels: int = 3, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.stem = ConvStem(in_channels, FEATURE_CHANNELS, norm_layer)
        block = BLOCKS[RESNET8_LAYOUT.block]
        planes, blocks = RESNET8_LAYOUT.planes[0], RESNET8_LAYOUT.blocks[0]
        width = planes * block.expansion
        self.stage = nn.Sequential(block(FEATURE_CHANNELS, planes, 1, norm_layer),
                                   *[block(width, planes, norm_layer=norm_layer) for _ in range(blocks - 1)])
        self.init_weights()

    @property
    def in_channels(self) -> int:
        return self.stem.in_channels

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The stage's convolutions as :class:`ResNetTrunk` initialises them (the stem does its own)."""
        _init_weights(self.stage, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.stage(self.stem(x))  # (B, 64, H, W)


class PooledHead(nn.Module):
    """Global average pool + linear: the classifier left on the device after the deeper cut."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.num_classes = _check_positive_int("num_classes", num_classes)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, self.num_classes)

    def forward(self, maps: torch.Tensor) -> torch.Tensor:  # (B, 64, h, w)
        return self.fc(torch.flatten(self.avgpool(maps), 1))  # (B, num_classes)


class ResNet8Stage1Edge(nn.Module):
    """``resnet8`` cut after its stage: ``forward(x) -> (logits, maps (B, 64, H, W))``."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.extractor = StemThenStage(in_channels, norm_layer)
        self.classifier = PooledHead(STAGE1_CHANNELS, num_classes)

    @property
    def num_classes(self) -> int:
        return self.classifier.num_classes

    @property
    def in_channels(self) -> int:
        return self.extractor.in_channels

    def extract(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.extractor(x)  # (B, 64, H, W)

    def classify(self, maps: torch.Tensor) -> torch.Tensor:  # (B, 64, H, W)
        return self.classifier(maps)

    @property
    def head(self) -> nn.Linear:
        return self.classifier.fc

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.extract(x)  # (B, 64, H, W): the stage's output, before the pool

    def embed(self, feature_map: torch.Tensor) -> torch.Tensor:  # (B, 64, h, w)
        return torch.flatten(self.classifier.avgpool(feature_map), 1)  # (B, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, in_channels, H, W)
        maps = self.extract(x)
        return self.classify(maps), maps


@register_model("resnet8_stage1", input_kind="image", feature_channels=STAGE1_CHANNELS, cut="stage1")
def resnet8_stage1(num_classes: int = 10, in_channels: int = 3) -> ResNet8Stage1Edge:
    """ResNet-8 cut after its bottleneck stage (64-channel maps up): forward(x) -> (logits, maps)."""
    return ResNet8Stage1Edge(num_classes=num_classes, in_channels=in_channels)


@register_model("resnet55_server_stage1", input_kind="features", feature_channels=STAGE1_CHANNELS, cut="stage1")
def resnet55_server_stage1(num_classes: int = 10, in_channels: int = 3) -> ResNetTrunk:
    """ResNet-55 server model for resnet8_stage1's 64-channel maps."""
    _check_positive_int("in_channels", in_channels)
    return ResNetTrunk(RESNET56_LAYOUT, num_classes=num_classes, in_planes=STAGE1_CHANNELS)


@register_model("resnet109_server_stage1", input_kind="features", feature_channels=STAGE1_CHANNELS, cut="stage1")
def resnet109_server_stage1(num_classes: int = 10, in_channels: int = 3) -> ResNetTrunk:
    """ResNet-109 server model for resnet8_stage1's 64-channel maps."""
    _check_positive_int("in_channels", in_channels)
    return ResNetTrunk(RESNET110_LAYOUT, num_classes=num_classes, in_planes=STAGE1_CHANNELS)
