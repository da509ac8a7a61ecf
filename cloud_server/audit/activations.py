"""Inverting uploaded activations (FedGKT's feature maps H, split learning's activations) by
optimisation: with the extractor's weights (white box), or with its architecture only.

Both attacks search pixel space: an image in ``[0, 1]`` is normalised as the agent's loader
normalised it (:class:`~cloud_server.audit.scoring.PixelSpace`), run through an extractor
in eval mode (the mode the agents extract their uploads in), and moved to make the
extractor's output match the received maps, with a small total-variation prior.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import AttackInputError
from .image_prior import ImageVariable, total_variation
from .scoring import PixelSpace

__all__ = [
    "ArchitectureOnlyConfig",
    "WhiteBoxConfig",
    "invert_features_architecture_only",
    "invert_features_white_box",
]


@dataclass(frozen=True)
class WhiteBoxConfig:
    """Optimisation of the images through the known extractor.

    Attributes:
        steps: Adam steps.
        lr: Adam's initial learning rate (pixel units), decayed to a hundredth.
        tv_weight: weight of the total-variation prior against the relative feature error.
        seed: seeds the starting images (uniform noise around mid-grey).
    """

    steps: int = 400
    lr: float = 0.05
    tv_weight: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AttackInputError(f"WhiteBoxConfig.steps must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise AttackInputError(f"WhiteBoxConfig.lr must be > 0, got {self.lr}")
        if self.tv_weight < 0:
            raise AttackInputError(f"WhiteBoxConfig.tv_weight must be >= 0, got {self.tv_weight}")


@dataclass(frozen=True)
class ArchitectureOnlyConfig:
    """UnSplit-style joint optimisation of the images and a surrogate extractor's weights.

    Attributes:
        steps: joint steps; each moves the images, then the surrogate.
        image_lr: Adam's initial learning rate for the images.
        weight_lr: Adam's learning rate for the surrogate's weights.
        tv_weight: weight of the total-variation prior; without the true weights the prior
            is what picks a natural image among the many the maps allow.
        seed: seeds the surrogate's initial weights and the starting images.
    """

    steps: int = 600
    image_lr: float = 0.05
    weight_lr: float = 0.01
    tv_weight: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AttackInputError(f"ArchitectureOnlyConfig.steps must be >= 1, got {self.steps}")
        if not self.image_lr > 0 or not self.weight_lr > 0:
            raise AttackInputError(f"ArchitectureOnlyConfig learning rates must be > 0, got {self.image_lr} and {self.weight_lr}")
        if self.tv_weight < 0:
            raise AttackInputError(f"ArchitectureOnlyConfig.tv_weight must be >= 0, got {self.tv_weight}")


def _check_features(features: torch.Tensor, image_shape: tuple[int, int, int]) -> None:
    if features.dim() != 4 or features.shape[0] == 0:
        raise AttackInputError(f"expected received maps (N, C, H, W), got shape {tuple(features.shape)}")
    if not torch.isfinite(features).all():
        raise AttackInputError("the received maps contain non-finite values")
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise AttackInputError(f"image_shape must be (C, H, W), got {image_shape}")


def _relative_error(produced: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Relative to the target's energy, so one learning rate and TV weight fit any feature scale.
    return (produced - target).square().mean() / target.square().mean().clamp_min(1e-12)


def _start_images(n: int, image_shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 0.5 + 0.1 * (torch.rand((n, *image_shape), generator=generator) - 0.5)  # (N, C, H, W)


def _frozen_eval_copy(extractor: nn.Module) -> nn.Module:
    model = copy.deepcopy(extractor).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def invert_features_white_box(extractor: nn.Module, features: torch.Tensor, pixels: PixelSpace,
                              image_shape: tuple[int, int, int], config: WhiteBoxConfig = WhiteBoxConfig()) -> torch.Tensor:
    """Reconstruct the images whose maps the server received, through the extractor it holds.

    Args:
        extractor: the agent's extractor as the server holds it (copied, used in eval mode).
        features: the received maps ``(N, C_f, H_f, W_f)``, decoded as the server stores them.
        pixels: the normalisation the agent's loader applied before the extractor.
        image_shape: ``(C, H, W)`` of one private image.
        config: the optimisation.

    Returns:
        The reconstructions ``(N, C, H, W)`` in ``[0, 1]`` pixel units.

    Raises:
        AttackInputError: maps that are empty or non-finite, or that the extractor cannot produce
            (its output on an image of ``image_shape`` has another shape).
    """
    _check_features(features, image_shape)
    model = _frozen_eval_copy(extractor)
    target = features.detach().float()
    image = ImageVariable(_start_images(target.shape[0], image_shape, config.seed), config.lr, config.steps)
    _check_output_shape(model, image.pixels, pixels, target)
    for _ in range(config.steps):
        produced = model(pixels.to_model(image.pixels))  # (N, C_f, H_f, W_f)
        loss = _relative_error(produced, target) + config.tv_weight * total_variation(image.pixels)
        image.step(loss)
    return image.result()


def invert_features_architecture_only(surrogate: nn.Module, features: torch.Tensor, pixels: PixelSpace,
                                      image_shape: tuple[int, int, int],
                                      config: ArchitectureOnlyConfig = ArchitectureOnlyConfig()) -> torch.Tensor:
    """Reconstruct images from maps of an extractor whose weights the server does not hold
    (UnSplit, Erdogan et al.): the images and a surrogate of the extractor's architecture are
    optimised together so that the surrogate maps the images onto the received maps.

    Args:
        surrogate: a module of the extractor's architecture; its weights are re-drawn from
            ``config.seed`` (whatever they were is not used) and trained in eval mode.
        features: the received maps ``(N, C_f, H_f, W_f)``.
        pixels: the normalisation the agent's loader applied before the extractor.
        image_shape: ``(C, H, W)`` of one private image.
        config: the optimisation.

    Returns:
        The reconstructions ``(N, C, H, W)`` in ``[0, 1]`` pixel units.

    Raises:
        AttackInputError: as :func:`invert_features_white_box`.
    """
    _check_features(features, image_shape)
    model = copy.deepcopy(surrogate).float().eval()
    _redraw_weights(model, config.seed)
    target = features.detach().float()
    image = ImageVariable(_start_images(target.shape[0], image_shape, config.seed), config.image_lr, config.steps)
    _check_output_shape(model, image.pixels, pixels, target)
    weights = [p for p in model.parameters() if p.requires_grad]
    weight_optimizer = torch.optim.Adam(weights, lr=config.weight_lr)
    for _ in range(config.steps):
        loss = _relative_error(model(pixels.to_model(image.pixels)), target) + config.tv_weight * total_variation(image.pixels)
        weight_optimizer.zero_grad(set_to_none=True)
        image.step(loss)  # also leaves the loss's gradient on the surrogate's weights
        weight_optimizer.step()
    return image.result()


def _redraw_weights(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(True)
            if p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator) * (2.0 / fan_in) ** 0.5)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def _check_output_shape(model: nn.Module, images: torch.Tensor, pixels: PixelSpace, target: torch.Tensor) -> None:
    with torch.no_grad():
        produced = model(pixels.to_model(images[:1].detach()))
    if produced.shape[1:] != target.shape[1:]:
        raise AttackInputError(f"the extractor maps an image of {tuple(images.shape[1:])} to {tuple(produced.shape[1:])}, "
                               f"the received maps are {tuple(target.shape[1:])}")
