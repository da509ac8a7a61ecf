"""Inverting uploaded activations (FedGKT's feature maps H, split learning's activations) by
optimisation: with the extractor's weights (white box), or with its architecture only.

Both attacks search pixel space: an image in ``[0, 1]`` is normalised as the agent's loader
normalised it (:class:`~cloud_server.audit.scoring.PixelSpace`), run through an extractor
in eval mode (the mode the agents extract their uploads in), and moved to make the
extractor's output match the received maps, with a small total-variation prior.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from models.seeding import draw_initial_values

from .errors import AttackInputError
from .image_prior import ImageVariable, total_variation
from .scoring import PixelSpace

__all__ = [
    "BEST_MAP_FIT",
    "ArchitectureOnlyConfig",
    "WhiteBoxConfig",
    "invert_features_architecture_only",
    "invert_features_white_box",
    "white_box_candidates",
]

# Added to the surrogate's seed: a run seeds its agents' initial models with its own seed, and the
# surrogate must not start from the very weights it stands in for.
_SURROGATE_SEED_SALT = 0x5A77_0F5E
#: The low and high quantiles of pixel values the architecture-only attack calibrates on.
_CALIBRATION_QUANTILES = (0.001, 0.999)
# torch.quantile refuses inputs of more elements than this.
_QUANTILE_SAMPLE = 1 << 24


@dataclass(frozen=True)
class WhiteBoxConfig:
    """Optimisation of the images through the known extractor.

    Attributes:
        steps: Adam steps (for each learning rate).
        lr: Adam's initial learning rate (pixel units), decayed to a hundredth.
        more_lrs: further initial learning rates, each a whole optimisation of its own; every
            image keeps the reconstruction whose maps through the extractor fit the received
            ones best (the attacker can tell: it holds both). One rate does not suit every
            extractor: too small and the images stall in a poor fit of the maps. On noised
            maps the closest fit can be the one that fitted the noise:
            :func:`white_box_candidates` also returns each rate's own reconstruction.
        tv_weight: weight of the total-variation prior against the relative feature error.
        batch_statistics: run the extractor as in training, its normalisation layers using the
            batch's own statistics (split learning's uploads during training); the received
            maps are then one whole batch, in order. Otherwise eval mode (FedGKT's uploads,
            every evaluation's).
        seed: seeds the starting images (uniform noise around mid-grey).
    """

    steps: int = 400
    lr: float = 0.05
    more_lrs: tuple[float, ...] = (0.2,)
    tv_weight: float = 1e-4
    batch_statistics: bool = False
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
    """Joint optimisation of the images and a surrogate extractor's weights.

    Attributes:
        warmup_steps: Adam steps fitting the surrogate to the first estimate before the joint steps.
        steps: joint steps; each moves the images and the surrogate's weights.
        image_lr: Adam's initial learning rate for the images.
        weight_lr: Adam's learning rate for the surrogate's weights.
        tv_weight: weight of the total-variation prior against the relative feature error.
        seed: seeds the surrogate's initial weights (salted, so that they are never the
            initialisation a run with the same seed gives its agents).
    """

    warmup_steps: int = 300
    steps: int = 1000
    image_lr: float = 0.03
    weight_lr: float = 0.03
    tv_weight: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.steps < 1:
            raise AttackInputError(f"ArchitectureOnlyConfig needs warmup_steps >= 0 and steps >= 1, "
                                   f"got {self.warmup_steps} and {self.steps}")
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


#: :func:`white_box_candidates`' key of the per-image best fit of the maps.
BEST_MAP_FIT = "best map fit"


def invert_features_white_box(extractor: nn.Module, features: torch.Tensor, pixels: PixelSpace,
                              image_shape: tuple[int, int, int], config: WhiteBoxConfig = WhiteBoxConfig()) -> torch.Tensor:
    """Reconstruct the images whose maps the server received, through the extractor it holds:
    per image, the learning rate's reconstruction whose maps fit the received ones best (see
    :func:`white_box_candidates`)."""
    return white_box_candidates(extractor, features, pixels, image_shape, config)[BEST_MAP_FIT]


def white_box_candidates(extractor: nn.Module, features: torch.Tensor, pixels: PixelSpace,
                         image_shape: tuple[int, int, int], config: WhiteBoxConfig = WhiteBoxConfig()) -> dict[str, torch.Tensor]:
    """Reconstruct the images whose maps the server received, through the extractor it holds:
    each learning rate's reconstruction (``"lr <rate>"``) and, per image, the one of them whose
    maps fit best (:data:`BEST_MAP_FIT`). The audit scores every candidate and reports the best,
    as it reports the strongest of its attacks.

    Args:
        extractor: the agent's extractor as the server holds it (copied, used in eval mode
            unless ``config.batch_statistics``).
        features: the received maps ``(N, C_f, H_f, W_f)``, decoded as the server stores them.
        pixels: the normalisation the agent's loader applied before the extractor.
        image_shape: ``(C, H, W)`` of one private image.
        config: the optimisation.

    Returns:
        Candidate name -> reconstructions ``(N, C, H, W)`` in ``[0, 1]`` pixel units.

    Raises:
        AttackInputError: maps that are empty or non-finite, or that the extractor cannot produce
            (its output on an image of ``image_shape`` has another shape).
    """
    _check_features(features, image_shape)
    model = _frozen_eval_copy(extractor).train(config.batch_statistics)
    target = features.detach().float()
    candidates: dict[str, torch.Tensor] = {}
    best: torch.Tensor | None = None
    best_fit = torch.full((target.shape[0],), math.inf)
    for lr in (config.lr, *config.more_lrs):
        image = ImageVariable(_start_images(target.shape[0], image_shape, config.seed), lr, config.steps)
        _check_output_shape(model, image.pixels, pixels, target)
        for _ in range(config.steps):
            produced = model(pixels.to_model(image.pixels))  # (N, C_f, H_f, W_f)
            loss = _relative_error(produced, target) + config.tv_weight * total_variation(image.pixels)
            image.step(loss)
        result = image.result()  # (N, C, H, W)
        candidates[f"lr {lr:g}"] = result
        with torch.no_grad():
            fit = _fit_per_image(model(pixels.to_model(result)), target)  # (N,)
        better = fit < best_fit
        best = result if best is None else torch.where(better[:, None, None, None], result, best)
        best_fit = torch.minimum(fit, best_fit)
    assert best is not None
    candidates[BEST_MAP_FIT] = best
    return candidates


def _fit_per_image(produced: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each image's relative error between its produced and received maps ``(N,)``."""
    diff = (produced - target).flatten(1).norm(dim=1)
    return diff / target.flatten(1).norm(dim=1).clamp_min(1e-12)


def invert_features_architecture_only(surrogate: nn.Module, features: torch.Tensor, pixels: PixelSpace,
                                      public: torch.Tensor,
                                      config: ArchitectureOnlyConfig = ArchitectureOnlyConfig()) -> torch.Tensor:
    """Reconstruct images from maps of an extractor whose weights the server does not hold.

    The server knows the extractor's architecture and holds public images, nothing else.
    Three steps:

    1. A first estimate from the maps alone: at every position the map is a function of the
       image's neighbourhood there, and the leading principal directions of the maps'
       channel vectors (one per image channel) follow the local pixel values.
    2. UnSplit (Erdogan et al.): a surrogate of the architecture, with weights of its own, is
       fitted to map the estimate onto the received maps, then the images and the surrogate
       are optimised together.
    3. The maps fix the images only up to an affine map of each channel's values (a convolution
       absorbs any scale and offset of its input), so each channel's extreme values are mapped
       to the public images', with the sign that lies closer to the public mean image.

    Mixing between the channels of a colour image is not resolved by step 3.

    Args:
        surrogate: a module of the extractor's architecture; its weights and normalisation
            statistics are re-drawn from ``config.seed`` (whatever they were is not used).
        features: the received maps ``(N, C_f, H, W)``; the extractor must keep the spatial size.
        pixels: the normalisation the agent's loader applied before the extractor.
        public: the server's public images ``(M, C, H, W)`` in ``[0, 1]``: their pixel statistics only.
        config: the optimisation.

    Returns:
        The reconstructions ``(N, C, H, W)`` in ``[0, 1]`` pixel units.

    Raises:
        AttackInputError: as :func:`invert_features_white_box`, or maps whose spatial size is
            not the public images'.
    """
    if public.dim() != 4 or public.shape[0] == 0:
        raise AttackInputError(f"expected public images (M, C, H, W), got shape {tuple(public.shape)}")
    image_shape = (int(public.shape[1]), int(public.shape[2]), int(public.shape[3]))
    _check_features(features, image_shape)
    if features.shape[-2:] != public.shape[-2:] or features.shape[1] < public.shape[1]:
        raise AttackInputError(f"maps {tuple(features.shape[1:])} do not keep the spatial size of images {image_shape}, "
                               "or have fewer channels than the images")
    target = features.detach().float()
    model = copy.deepcopy(surrogate).float().eval()
    _redraw_weights(model, config.seed)
    _check_output_shape(model, public[:1].float(), pixels, target)
    reference = public.detach().float()
    first = _match_public_statistics(_principal_images(target, image_shape[0]), reference)
    weight_optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=config.weight_lr)
    first_model = pixels.to_model(first)
    for _ in range(config.warmup_steps):
        loss = _relative_error(model(first_model), target)
        weight_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        weight_optimizer.step()
    image = ImageVariable(first, config.image_lr, config.steps)
    for _ in range(config.steps):
        loss = _relative_error(model(pixels.to_model(image.pixels)), target) + config.tv_weight * total_variation(image.pixels)
        weight_optimizer.zero_grad(set_to_none=True)
        image.step(loss)  # also leaves the loss's gradient on the surrogate's weights
        weight_optimizer.step()
    return _match_public_statistics(image.result(), reference)


def _principal_images(features: torch.Tensor, channels: int) -> torch.Tensor:  # (N, C_f, H, W)
    """The maps' channel vectors projected on their ``channels`` leading principal directions."""
    n, c_f, h, w = features.shape
    vectors = features.permute(0, 2, 3, 1).reshape(-1, c_f).double()  # (N H W, C_f)
    centred = vectors - vectors.mean(0)
    _, directions = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
    leading = directions[:, -channels:].flip(1)  # (C_f, C)
    return (centred @ leading).float().reshape(n, h, w, channels).permute(0, 3, 1, 2)  # (N, C, H, W)


def _match_public_statistics(images: torch.Tensor, public: torch.Tensor) -> torch.Tensor:  # (N, C, H, W)
    """Each channel's values mapped affinely so that their extreme quantiles over the batch are
    the public images' (:data:`_CALIBRATION_QUANTILES`), with the sign whose result lies
    closer to the public mean image. Extremes, not the mean and spread: those follow the
    classes in the batch (a label-skewed agent's images are darker or brighter than the
    public set on average), while most images of a kind span the same range."""
    mean_image = public.mean(0, keepdim=True)  # (1, C, H, W)
    matched = torch.empty_like(images)
    for c in range(images.shape[1]):
        public_low, public_high = _quantiles(public[:, c])
        candidates = []
        for sign in (1.0, -1.0):
            values = sign * images[:, c]  # (N, H, W)
            low, high = _quantiles(values)
            candidates.append(((values - low) / (high - low).clamp_min(1e-12) * (public_high - public_low) + public_low).clamp(0.0, 1.0))
        distances = [float((candidate - mean_image[:, c]).square().mean()) for candidate in candidates]
        matched[:, c] = candidates[0] if distances[0] <= distances[1] else candidates[1]
    return matched


def _quantiles(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The :data:`_CALIBRATION_QUANTILES` of ``values`` (a strided sample of at most
    :data:`_QUANTILE_SAMPLE` of them, torch.quantile's input limit)."""
    flat = values.detach().flatten()
    flat = flat[:: max(1, -(-flat.numel() // _QUANTILE_SAMPLE))]
    low, high = torch.quantile(flat.double(), torch.tensor(_CALIBRATION_QUANTILES, dtype=torch.float64))
    return low.to(values.dtype), high.to(values.dtype)


def _redraw_weights(model: nn.Module, seed: int) -> None:
    """The architecture's own initialisation (normalisation statistics reset), drawn from ``seed``."""
    draw_initial_values(model, torch.Generator().manual_seed(_SURROGATE_SEED_SALT + seed))
    for p in model.parameters():
        p.requires_grad_(True)


def _check_output_shape(model: nn.Module, images: torch.Tensor, pixels: PixelSpace, target: torch.Tensor) -> None:
    with torch.no_grad():
        produced = model(pixels.to_model(images[:1].detach()))
    if produced.shape[1:] != target.shape[1:]:
        raise AttackInputError(f"the extractor maps an image of {tuple(images.shape[1:])} to {tuple(produced.shape[1:])}, "
                               f"the received maps are {tuple(target.shape[1:])}")
