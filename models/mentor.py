"""FedKD's mentor and mentee: a smaller mentor architecture and the hidden-state view
of any split ResNet that the adaptive hidden loss (Eq. 5) needs.

FedKD (Wu et al. 2022) gives every agent a private *mentor* (large, never leaves
the device) and a copy of the shared *mentee* (small; its updates are what
travels). Here the mentee is the edge ResNet-8 (``resnet8``) and the mentor any
full ResNet of the registry: ``resnet56`` by default, or the ``resnet20``
registered below, which trains about 3x faster on a CPU and is what the tests
and the benchmark use on a 2-core machine.

``resnet20`` is the FedML bottleneck family at depth 20 (stem + [2, 2, 2]
bottlenecks of width 16/32/64 + fc: 1 + 18 + 1 weighted layers), the same
family as ``resnet56`` ([6, 6, 6]); it is *not* He et al.'s basic-block
ResNet-20. 220,090 parameters for 1-channel 10-class inputs.

Hidden states for Eq. 5 (the paper's are a transformer's hidden states and
attention heatmaps); :func:`forward_with_hidden` returns, for any model with
the linear-head view of :mod:`models.heads` (the split ResNets, the ConvNets):

* ``hidden``: the penultimate features ``(B, D)`` (what the linear head
  sees; D = 64 for ResNet-8, 256 for ResNet-20/56, 84 for SimpleCNN, 64 for
  ConvNet), which the mentee maps to the mentor's D with the learnable ``W_h``;
* ``feature_map``: the last conv stage's output ``(B, C, h, w)``, from which the
  edge method derives spatial attention maps (the CNN counterpart of
  attention heatmaps, as in Zagoruyko & Komodakis' attention transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.heads import head_view, map_features_and_logits
from models.registry import register_model
from models.resnet import ResNet, StageLayout, group_norm

__all__ = ["RESNET20_LAYOUT", "HiddenOutputs", "forward_with_hidden", "hidden_dim", "resnet20", "resnet20_gn"]

#: Bottleneck stages of the ResNet-20 mentor: two blocks per stage.
RESNET20_LAYOUT = StageLayout(blocks=(2, 2, 2))


@register_model("resnet20", input_kind="image")
def resnet20(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-20 full model (FedML bottleneck variant, [2, 2, 2]): image -> logits; a CPU-sized FedKD mentor."""
    return ResNet(RESNET20_LAYOUT, num_classes=num_classes, in_channels=in_channels)


@register_model("resnet20_gn", input_kind="image")
def resnet20_gn(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-20 (FedML's) with GroupNorm (16 channels a group) instead of BatchNorm: the FedKD mentor beside ``resnet8_gn``."""
    return ResNet(RESNET20_LAYOUT, num_classes=num_classes, in_channels=in_channels, norm_layer=group_norm)


@dataclass(frozen=True)
class HiddenOutputs:
    """What the FedKD losses need from one forward pass."""

    logits: torch.Tensor  # (B, num_classes)
    hidden: torch.Tensor  # (B, D) penultimate features (the linear head's input)
    feature_map: torch.Tensor  # (B, C, h, w) last conv stage output, before pooling


def hidden_dim(model: nn.Module) -> int:
    """D of :attr:`HiddenOutputs.hidden` for ``model``."""
    return int(head_view(model).head.in_features)


def forward_with_hidden(model: nn.Module, x: torch.Tensor) -> HiddenOutputs:
    """Logits, penultimate features and last feature map of ``model`` on ``x``.

    The same computation as the model's own forward, stopped at the points Eq. 5
    compares (:func:`models.heads.map_features_and_logits`); works for the edge
    ResNet-8 (whose forward returns a tuple), the full ResNets and the ConvNets alike.
    """
    feature_map, hidden, logits = map_features_and_logits(model, x)  # (B, C, h, w), (B, D), (B, K)
    return HiddenOutputs(logits=logits, hidden=hidden, feature_map=feature_map)
