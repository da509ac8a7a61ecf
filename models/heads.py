"""The "feature extractor + linear classifier" view of a full model.

Several methods treat a classification model as ``E`` (input -> a feature
vector in R^d) followed by a linear classifier ``FC(E(x)) = W^T E(x) + b``
(FedDistill's Fig. 4: global features through the local classifier and the
other way round). For the split ResNets here that cut is the pooled input of
the trunk's last ``nn.Linear``: everything before it is ``E``, the linear head
is ``FC``. This is a different cut from :class:`models.resnet.SplitResNet`'s
``extractor`` / ``classifier`` (stem vs. trunk), which is where FedGKT and
split learning divide the network between edge and server.

Nothing here changes a model or its forward; these are read-only views.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.resnet import SplitResNet

__all__ = ["features_and_logits", "linear_head"]


def _split(model: nn.Module) -> SplitResNet:
    if not isinstance(model, SplitResNet):
        raise TypeError(f"need a split ResNet (stem + trunk with a linear head), got {type(model).__name__}")
    return model


def linear_head(model: nn.Module) -> nn.Linear:
    """The model's final linear classifier (maps :func:`features_and_logits` features to logits)."""
    return _split(model).classifier.fc


def features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features (B, D), logits (B, num_classes))`` of a split ResNet on images ``x``.

    The same computation as the model's own forward, stopped before the linear
    head to expose its input: ``logits == linear_head(model)(features)``. Works
    for the full ResNets (whose forward returns logits) and the edge ResNet-8
    (whose forward returns ``(logits, stem features)``) alike.
    """
    net = _split(model)
    trunk = net.classifier
    stem = net.extract(x)  # (B, 16, H, W)
    pooled = torch.flatten(trunk.avgpool(trunk.stages(stem)), 1)  # (B, D)
    return pooled, trunk.fc(pooled)  # (B, D), (B, num_classes)
