"""Registry of model builders, keyed by name.

Both sides of a run name their architectures in configs and on the wire
("resnet8", "resnet55_server", ...); this module turns such a name into a
freshly initialised ``nn.Module``. A builder is registered once, with the kind
of input it expects, so callers (cost meters, tests, the server) can make a
correctly shaped dummy batch without knowing the architecture.

A duplicate name is an error rather than a silent override: two methods that
register the same name would otherwise train different networks under one
label, and the run report would not show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol, TypeVar

import torch
import torch.nn as nn

__all__ = [
    "InputKind",
    "ModelBuilder",
    "ModelSpec",
    "build_model",
    "check_cut_pair",
    "get_model_spec",
    "list_models",
    "register_model",
]

#: What a model's forward takes: a raw image batch ``(B, in_channels, H, W)``,
#: or the edge extractor's feature maps ``(B, feature_channels, H, W)``.
InputKind = Literal["image", "features"]


class ModelBuilder(Protocol):
    """Signature every registered builder has."""

    def __call__(self, num_classes: int = 10, in_channels: int = 3) -> nn.Module: ...


_BuilderT = TypeVar("_BuilderT", bound=Callable[..., nn.Module])


@dataclass(frozen=True)
class ModelSpec:
    """A registered architecture.

    Attributes:
        name: Registry key.
        builder: ``builder(num_classes, in_channels) -> nn.Module``.
        input_kind: ``"image"`` for models fed raw images, ``"features"`` for
            server models fed the edge extractor's output.
        feature_channels: Channels of the feature-map input (for ``"features"``
            models), or of the maps an edge model's extractor uploads (split models).
        cut: Where the edge network is cut: ``"stem"`` (after the conv stem) or
            ``"stage1"`` (after ResNet-8's bottleneck stage, :mod:`models.resnet_cut`).
        description: One line for listings and run reports.
    """

    name: str
    builder: ModelBuilder
    input_kind: InputKind
    feature_channels: int
    description: str
    cut: str = "stem"

    def input_shape(self, in_channels: int = 3, image_size: int = 32) -> tuple[int, int, int]:
        """Per-sample input shape ``(C, H, W)`` for this model.

        The edge extractor keeps the spatial size (stride-1 stem), so a server
        model sees the image's ``H x W`` with ``feature_channels`` channels.
        """
        channels = in_channels if self.input_kind == "image" else self.feature_channels
        return (channels, image_size, image_size)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(
    name: str,
    *,
    input_kind: InputKind = "image",
    feature_channels: int = 16,
    description: str = "",
    cut: str = "stem",
) -> Callable[[_BuilderT], _BuilderT]:
    """Decorator registering ``builder(num_classes, in_channels)`` under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered, or ``input_kind``
            is unknown.
    """
    if not name:
        raise ValueError("model name must be a non-empty string")
    if input_kind not in ("image", "features"):
        raise ValueError(f"input_kind must be 'image' or 'features', got {input_kind!r}")

    def decorator(builder: _BuilderT) -> _BuilderT:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        doc_line = (builder.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = ModelSpec(
            name=name,
            builder=builder,
            input_kind=input_kind,
            feature_channels=feature_channels,
            description=description or (doc_line[0] if doc_line else ""),
            cut=cut,
        )
        return builder

    return decorator


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec for ``name``.

    Raises:
        ValueError: no model of that name; the message lists the known names.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; registered models: {list_models()}")
    return spec


def check_cut_pair(edge_model: str, server_model: str, table: str) -> None:
    """The server model ``server_model`` takes the maps ``edge_model``'s extractor uploads
    (the same cut, the same channels); a ValueError naming ``table``'s keys otherwise."""
    edge, server = get_model_spec(edge_model), get_model_spec(server_model)
    if server.input_kind != "features":
        raise ValueError(f"{table}.server_model must take feature maps, {server_model!r} takes images")
    if (edge.cut, edge.feature_channels) != (server.cut, server.feature_channels):
        fits = [n for n in list_models() if _REGISTRY[n].input_kind == "features" and _REGISTRY[n].cut == edge.cut]
        raise ValueError(f"{table}.server_model {server_model!r} takes {server.feature_channels}-channel maps cut after "
                         f"the {server.cut}, but {table}.edge_model {edge_model!r} uploads {edge.feature_channels}-channel "
                         f"maps cut after the {edge.cut}: set server_model to one of {fits}")


def build_model(name: str, num_classes: int = 10, in_channels: int = 3, generator: torch.Generator | None = None) -> nn.Module:
    """Build a freshly initialised model by registry name.

    ``in_channels`` is the channel count of the images in the federation.
    Server models ignore it for their input (they always take the edge
    extractor's feature maps) but still validate it, so one config drives
    every model of a run.

    ``generator``: draw the initial weights from it (:func:`models.seeding.build_seeded`),
    not from torch's global RNG, which every thread of the process shares; a generator
    seeded with ``s`` gives the weights ``torch.manual_seed(s)`` and no generator give.

    Raises:
        ValueError: unknown name, or invalid ``num_classes`` / ``in_channels``.
    """
    spec = get_model_spec(name)
    if generator is None:
        return spec.builder(num_classes=num_classes, in_channels=in_channels)
    from models.seeding import build_seeded

    return build_seeded(lambda: spec.builder(num_classes=num_classes, in_channels=in_channels), generator)


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)
