"""The "feature extractor + linear classifier" view of a full model.

Several methods treat a classification model as ``E`` (input -> a feature
vector in R^d) followed by a linear classifier ``FC(E(x)) = W^T E(x) + b``
(FedDistill's Fig. 4: global features through the local classifier and the
other way round; FedKD's Eq. 5: hidden states and attention maps of mentor and
mentee). A model offers that view by having three parts whose chain is its own
forward (:class:`LinearHeadModel`):

* ``feature_map(x)``: the last convolutional stage's output ``(B, C, h, w)``;
* ``embed(feature_map)``: the vector the head sees ``(B, D)``;
* ``head``: the final ``nn.Linear`` (D -> num_classes).

The split ResNets (:class:`models.resnet.SplitResNet`: the pooled trunk output)
and the plain CNNs (:class:`models.convnet.ConvNet`: the last hidden fc layer's
output) both have them. This is a different cut from ``SplitResNet``'s
``extractor`` / ``classifier`` (stem vs. trunk), which is where FedGKT and
split learning divide the network between edge and server.

Nothing here changes a model or its forward; these are read-only views.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

__all__ = ["LinearHeadModel", "features_and_logits", "head_view", "linear_head", "map_features_and_logits"]


@runtime_checkable
class LinearHeadModel(Protocol):
    """A classifier whose forward is ``head(embed(feature_map(x)))`` (logits first if a tuple)."""

    @property
    def head(self) -> nn.Linear: ...

    def feature_map(self, x: torch.Tensor) -> torch.Tensor: ...

    def embed(self, feature_map: torch.Tensor) -> torch.Tensor: ...


def head_view(model: nn.Module) -> LinearHeadModel:
    """``model`` as a :class:`LinearHeadModel`, or TypeError naming what it lacks."""
    if not isinstance(model, LinearHeadModel):
        raise TypeError(f"need a model with a linear head view (feature_map / embed / head: a split ResNet or a ConvNet), "
                        f"got {type(model).__name__}")
    return model


def linear_head(model: nn.Module) -> nn.Linear:
    """The model's final linear classifier (maps :func:`features_and_logits` features to logits)."""
    return head_view(model).head


def map_features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(feature map (B, C, h, w), features (B, D), logits (B, num_classes))`` of ``model`` on ``x``:
    the model's own forward, with its two intermediate results exposed."""
    view = head_view(model)
    feature_map = view.feature_map(x)  # (B, C, h, w)
    features = view.embed(feature_map)  # (B, D)
    return feature_map, features, view.head(features)  # ..., (B, num_classes)


def features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features (B, D), logits (B, num_classes))`` of ``model`` on images ``x``.

    The same computation as the model's own forward, stopped before the linear
    head to expose its input: ``logits == linear_head(model)(features)``. Works
    for the full ResNets (whose forward returns logits), the edge ResNet-8
    (whose forward returns ``(logits, stem features)``) and the ConvNets alike.
    """
    _, features, logits = map_features_and_logits(model, x)
    return features, logits
