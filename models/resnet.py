"""CIFAR-style bottleneck ResNets used by FedGKT, split learning and FedAvg.

Every model here is one of two generic pieces, with the variants given as data
(:class:`StageLayout`), in the style of torchvision's ``ResNet(block, layers)``:

* :class:`ConvStem` -- ``conv3x3(in_channels -> 16) + BN + ReLU``. On the edge
  this is the *extractor*: its ``(B, 16, H, W)`` output is what FedGKT uploads.
* :class:`ResNetTrunk` -- bottleneck stages, global average pool and a linear
  head. It maps the stem's 16-channel map to logits. On the server it is the
  whole model (ResNet-55 / ResNet-109); on the edge it is the *classifier*.

Architectures follow FedML's FedGKT code (``fedml_api/model/cv/resnet_gkt`` and
``resnet56_gkt``) so parameter counts and FLOPs are comparable with the paper:

============  ==========================  ================  ==================
name          layout (bottleneck blocks)   input             params (C=10, 3ch)
============  ==========================  ================  ==================
resnet8       stem + [2] (planes 16)       image             10,586
resnet8_gn    resnet8 with GroupNorm        image             10,586
resnet55      [6, 6, 6] (16/32/64)         16-ch features    590,858
resnet109     [12, 12, 12]                 16-ch features    1,147,274
resnet56      stem + [6, 6, 6]             image             591,322
resnet110     stem + [12, 12, 12]          image             1,147,738
============  ==========================  ================  ==================

The ``_gn`` models put GroupNorm (16 channels a group) where BatchNorm was, as FedGKD
does for federated training under label skew. ``cifar_resnet8_gn`` / ``cifar_resnet20_gn``
are He et al.'s CIFAR ResNets instead (stem + three stages of 1 / 3 *basic* blocks at
16/32/64 channels + fc; 78,042 / 272,474 parameters for 3-channel 10-class inputs), the
ResNet-8 that FedGKD trains, with GroupNorm.

Two deliberate differences from FedML: the server models carry no unused stem
(FedML builds ``conv1``/``bn1`` in the server ResNet and never calls them, which
inflates its parameter count by 464), and ``in_channels`` is a parameter
instead of a hard-coded 3, so Fashion-MNIST (1 channel) needs no fork.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn

from models.registry import register_model
from models.resnet_blocks import (
    BLOCKS,
    BasicBlock,
    Bottleneck,
    NormLayer,
    _check_positive_int,
    _init_weights,
    conv3x3,
    group_norm,
)

__all__ = [
    "FEATURE_CHANNELS",
    "RESNET8_LAYOUT",
    "RESNET56_LAYOUT",
    "RESNET110_LAYOUT",
    "BasicBlock",
    "Bottleneck",
    "ConvStem",
    "ResNet",
    "ResNet8Edge",
    "ResNetTrunk",
    "SplitResNet",
    "StageLayout",
    "cifar_resnet8_gn",
    "cifar_resnet20_gn",
    "group_norm",
    "resnet8",
    "resnet8_gn",
    "resnet55_server",
    "resnet56",
    "resnet109_server",
    "resnet110",
]

#: Channels of the edge extractor's output, i.e. of every server model's input.
#: Part of the FedGKT contract between edge and server: change it on both sides.
FEATURE_CHANNELS = 16


@dataclass(frozen=True)
class StageLayout:
    """Bottleneck stages of a trunk: blocks, width and stride per stage.

    Attributes:
        blocks: Bottleneck blocks per stage, e.g. ``(6, 6, 6)`` for ResNet-56.
        planes: Bottleneck width per stage; the stage outputs ``4 * planes``.
        strides: Stride of each stage's first block.
    """

    blocks: tuple[int, ...]
    planes: tuple[int, ...] = (16, 32, 64)
    strides: tuple[int, ...] = (1, 2, 2)
    block: str = "bottleneck"  # a key of BLOCKS

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("StageLayout needs at least one stage")
        if not len(self.blocks) == len(self.planes) == len(self.strides):
            raise ValueError(
                "blocks, planes and strides must have one entry per stage, got "
                f"{len(self.blocks)}, {len(self.planes)} and {len(self.strides)}"
            )
        if self.block not in BLOCKS:
            raise ValueError(f"StageLayout.block must be one of {sorted(BLOCKS)}, got {self.block!r}")
        for field_name in ("blocks", "planes", "strides"):
            for value in getattr(self, field_name):
                _check_positive_int(f"StageLayout.{field_name} entry", value)

    @property
    def out_channels(self) -> int:
        """Channels entering the pooling layer and the linear head."""
        return self.planes[-1] * BLOCKS[self.block].expansion

    @property
    def conv_layers(self) -> int:
        """Weighted conv layers in the stages (3 per bottleneck, 2 per basic block; shortcuts not counted)."""
        return (3 if self.block == "bottleneck" else 2) * sum(self.blocks)


#: ResNet-8's classifier: one stage of two blocks at width 16 (64 channels out).
RESNET8_LAYOUT = StageLayout(blocks=(2,), planes=(16,), strides=(1,))
#: He et al.'s CIFAR ResNet-8 (6n + 2, n = 1): one basic block per stage at 16/32/64.
CIFAR_RESNET8_LAYOUT = StageLayout(blocks=(1, 1, 1), block="basic")
#: He et al.'s CIFAR ResNet-20 (n = 3).
CIFAR_RESNET20_LAYOUT = StageLayout(blocks=(3, 3, 3), block="basic")
#: ResNet-56 / server ResNet-55.
RESNET56_LAYOUT = StageLayout(blocks=(6, 6, 6))
#: ResNet-110 / server ResNet-109.
RESNET110_LAYOUT = StageLayout(blocks=(12, 12, 12))


class ConvStem(nn.Module):
    """``conv3x3(in_channels -> out_channels) + BN + ReLU``, stride 1.

    Keeps the spatial size, so a 32x32 image becomes a ``(16, 32, 32)`` map.
    """

    def __init__(self, in_channels: int = 3, out_channels: int = FEATURE_CHANNELS, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.in_channels = _check_positive_int("in_channels", in_channels)
        self.out_channels = _check_positive_int("out_channels", out_channels)
        self.conv = conv3x3(self.in_channels, self.out_channels)
        self.bn = norm_layer(self.out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """He-normal convolutions, identity norms (``_init_weights``); ``generator`` as in :mod:`models.seeding`."""
        _init_weights(self, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.relu(self.bn(self.conv(x)))  # (B, out_channels, H, W)


class ResNetTrunk(nn.Module):
    """Bottleneck stages + global average pool + linear head.

    Maps a feature map ``(B, in_planes, H, W)`` to logits ``(B, num_classes)``.
    Any ``H, W`` works (adaptive pooling); each stride-2 stage halves them.
    """

    def __init__(self, layout: StageLayout, num_classes: int = 10, in_planes: int = FEATURE_CHANNELS,
                 norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.layout = layout
        self.num_classes = _check_positive_int("num_classes", num_classes)
        self.in_planes = _check_positive_int("in_planes", in_planes)

        stages: OrderedDict[str, nn.Module] = OrderedDict()
        channels = self.in_planes
        for index, (blocks, planes, stride) in enumerate(zip(layout.blocks, layout.planes, layout.strides)):
            # Only the first block of a stage changes width or resolution.
            block = BLOCKS[layout.block]
            stage_blocks: list[nn.Module] = [block(channels, planes, stride, norm_layer)]
            channels = planes * block.expansion
            stage_blocks += [block(channels, planes, norm_layer=norm_layer) for _ in range(blocks - 1)]
            stages[f"layer{index + 1}"] = nn.Sequential(*stage_blocks)
        self.stages = nn.Sequential(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(layout.out_channels, self.num_classes)
        self.init_weights()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """He-normal convolutions, identity norms (``_init_weights``); ``generator`` as in :mod:`models.seeding`."""
        _init_weights(self, generator)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (B, in_planes, H, W)
        x = self.stages(features)  # (B, out_channels, H / prod(strides), W / prod(strides))
        x = torch.flatten(self.avgpool(x), 1)  # (B, out_channels)
        return self.fc(x)  # (B, num_classes)


class SplitResNet(nn.Module):
    """A ResNet split into ``extractor`` (the stem) and ``classifier`` (the trunk).

    The split point is where FedGKT and split learning cut the network; full
    models keep the same structure so their state-dict names line up with the
    edge model's.
    """

    def __init__(self, layout: StageLayout, num_classes: int = 10, in_channels: int = 3,
                 norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        self.extractor = ConvStem(in_channels, FEATURE_CHANNELS, norm_layer)
        self.classifier = ResNetTrunk(layout, num_classes, in_planes=FEATURE_CHANNELS, norm_layer=norm_layer)

    @property
    def num_classes(self) -> int:
        """Width of the logits."""
        return self.classifier.num_classes

    @property
    def in_channels(self) -> int:
        """Image channels the extractor expects."""
        return self.extractor.in_channels

    def extract(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        """Feature maps ``(B, 16, H, W)`` as uploaded by the edge."""
        return self.extractor(x)

    def classify(self, features: torch.Tensor) -> torch.Tensor:  # (B, 16, H, W)
        """Logits ``(B, num_classes)`` from extractor features."""
        return self.classifier(features)

    # The linear-head view (models.heads): forward == head(embed(feature_map(x))).

    @property
    def head(self) -> nn.Linear:
        """The trunk's final linear classifier."""
        return self.classifier.fc

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        """The last stage's output ``(B, C, h, w)``, before the pool."""
        return self.classifier.stages(self.extract(x))  # (B, C, h, w)

    def embed(self, feature_map: torch.Tensor) -> torch.Tensor:  # (B, C, h, w)
        """The pooled vector the head sees, ``(B, C)``."""
        return torch.flatten(self.classifier.avgpool(feature_map), 1)  # (B, C)


class ResNet(SplitResNet):
    """A full image classifier (ResNet-56 / ResNet-110 for FedAvg): ``forward(x) -> logits``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_channels, H, W)
        return self.classify(self.extract(x))  # (B, num_classes)


class ResNet8Edge(SplitResNet):
    """FedGKT's edge model (FedML ``resnet8_56``): stem + two bottlenecks + fc.

    ``forward`` returns both the logits, for the edge's own CE + KD loss, and
    the extractor output that is uploaded to the server.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__(RESNET8_LAYOUT, num_classes=num_classes, in_channels=in_channels, norm_layer=norm_layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, in_channels, H, W)
        features = self.extract(x)  # (B, 16, H, W)
        logits = self.classify(features)  # (B, num_classes)
        return logits, features


# --- registered builders -----------------------------------------------------


@register_model("resnet8", input_kind="image")
def resnet8(num_classes: int = 10, in_channels: int = 3) -> ResNet8Edge:
    """ResNet-8 edge model (FedGKT): forward(x) -> (logits, features)."""
    return ResNet8Edge(num_classes=num_classes, in_channels=in_channels)


@register_model("resnet8_gn", input_kind="image")
def resnet8_gn(num_classes: int = 10, in_channels: int = 3) -> ResNet8Edge:
    """ResNet-8 (FedML's) with GroupNorm (16 channels a group) instead of BatchNorm, as FedGKD's Sec. 5.1 does."""
    return ResNet8Edge(num_classes=num_classes, in_channels=in_channels, norm_layer=group_norm)


@register_model("cifar_resnet8_gn", input_kind="image")
def cifar_resnet8_gn(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """He et al.'s CIFAR ResNet-8 (3 stages of one basic block) with GroupNorm: FedGKD's model (its Sec. 5.1)."""
    return ResNet(CIFAR_RESNET8_LAYOUT, num_classes=num_classes, in_channels=in_channels, norm_layer=group_norm)


@register_model("cifar_resnet20_gn", input_kind="image")
def cifar_resnet20_gn(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """He et al.'s CIFAR ResNet-20 (3 stages of three basic blocks) with GroupNorm: a mentor beside cifar_resnet8_gn."""
    return ResNet(CIFAR_RESNET20_LAYOUT, num_classes=num_classes, in_channels=in_channels, norm_layer=group_norm)


@register_model("resnet55_server", input_kind="features", feature_channels=FEATURE_CHANNELS)
def resnet55_server(num_classes: int = 10, in_channels: int = 3) -> ResNetTrunk:
    """ResNet-55 server model (FedGKT): 16-channel features -> logits.

    ``in_channels`` (the images' channels) is validated but does not change the
    model: the server only ever sees the extractor's 16-channel maps.
    """
    _check_positive_int("in_channels", in_channels)
    return ResNetTrunk(RESNET56_LAYOUT, num_classes=num_classes, in_planes=FEATURE_CHANNELS)


@register_model("resnet109_server", input_kind="features", feature_channels=FEATURE_CHANNELS)
def resnet109_server(num_classes: int = 10, in_channels: int = 3) -> ResNetTrunk:
    """ResNet-109 server model (FedGKT): 16-channel features -> logits.

    ``in_channels`` is validated only; see :func:`resnet55_server`.
    """
    _check_positive_int("in_channels", in_channels)
    return ResNetTrunk(RESNET110_LAYOUT, num_classes=num_classes, in_planes=FEATURE_CHANNELS)


@register_model("resnet56", input_kind="image")
def resnet56(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-56 full model (FedML bottleneck variant): image -> logits."""
    return ResNet(RESNET56_LAYOUT, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet110", input_kind="image")
def resnet110(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-110 full model (FedML bottleneck variant): image -> logits."""
    return ResNet(RESNET110_LAYOUT, num_classes=num_classes, in_channels=in_channels)
