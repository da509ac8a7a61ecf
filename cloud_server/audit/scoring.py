"""How a reconstruction is scored: PSNR and SSIM against the private images, in pixel space.

Every score here compares images in ``[0, 1]`` pixel units, ``(N, C, H, W)``, never the
normalised tensors the models see: an attack that works on normalised inputs maps its
result back with :class:`PixelSpace` first. SSIM is ``pytorch_msssim.ssim`` (Wang et al.'s
Gaussian-window SSIM, 11 x 11, sigma 1.5), computed per image; PSNR is torchmetrics'
``peak_signal_noise_ratio`` (``10 log10(1 / MSE)`` at data range 1) per image, capped at
:data:`MAX_PSNR_DB` so that an exact reconstruction has a finite score.

:func:`mean_image_baseline` is what an attacker who learnt nothing scores: predict the mean
of the images it already holds (the server's public set) for every private image. An attack
is only worth reporting by how far it rises above that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pytorch_msssim import ssim
from torchmetrics.functional.image import peak_signal_noise_ratio

from fldata.stats import dataset_stats

from .errors import AttackInputError

__all__ = ["MAX_PSNR_DB", "ImageAttackOutcome", "ImageScores", "PixelSpace", "mean_image_baseline", "score_attack",
           "score_images"]

#: The PSNR reported for a reconstruction whose error is below float32's resolution.
MAX_PSNR_DB = 100.0
# pytorch_msssim's window: images must be at least this large on each side.
_SSIM_WINDOW = 11
# Images may sit this far outside [0, 1] (float rounding of an un-normalisation) before a score refuses them.
_RANGE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class PixelSpace:
    """The per-channel normalisation the models were fed: ``model = (pixel - mean) / std``.

    Attributes:
        mean: per-channel mean in ``[0, 1]`` pixel units.
        std: per-channel standard deviation, each ``> 0``.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise AttackInputError(f"PixelSpace needs one mean and one std per channel, got {len(self.mean)} and {len(self.std)}")
        if any(not s > 0 for s in self.std):
            raise AttackInputError(f"PixelSpace std values must be > 0, got {self.std}")

    @classmethod
    def of_dataset(cls, name: str, in_channels: int | None = None) -> PixelSpace:
        """The statistics the loaders normalise ``name`` with (:func:`fldata.stats.dataset_stats`)."""
        mean, std = dataset_stats(name, in_channels)
        return cls(tuple(mean), tuple(std))

    @classmethod
    def identity(cls, channels: int) -> PixelSpace:
        """No normalisation: the models see pixels in ``[0, 1]``."""
        return cls((0.0,) * channels, (1.0,) * channels)

    @property
    def channels(self) -> int:
        return len(self.mean)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if like.dim() != 4 or like.shape[1] != self.channels:
            raise AttackInputError(f"expected images (N, {self.channels}, H, W), got {tuple(like.shape)}")
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        return mean, std

    def to_model(self, pixels: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) in [0, 1]
        """Normalise pixels as the loaders do; differentiable."""
        mean, std = self._stats(pixels)
        return (pixels - mean) / std  # (N, C, H, W)

    def to_pixels(self, normalised: torch.Tensor) -> torch.Tensor:  # (N, C, H, W)
        """Undo the normalisation and clamp to ``[0, 1]``."""
        mean, std = self._stats(normalised)
        return (normalised * std + mean).clamp(0.0, 1.0)  # (N, C, H, W)

    def bounds(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised values of pixels 0 and 1, per channel, shaped to broadcast over ``like``."""
        mean, std = self._stats(like)
        return -mean / std, (1.0 - mean) / std


@dataclass(frozen=True)
class ImageScores:
    """How close reconstructions are to the private images.

    Attributes:
        psnr_db: mean PSNR over the images, in dB (each capped at :data:`MAX_PSNR_DB`).
        ssim: mean SSIM over the images (1 is identical).
        psnr_db_per_image: each image's PSNR.
        ssim_per_image: each image's SSIM.
    """

    psnr_db: float
    ssim: float
    psnr_db_per_image: tuple[float, ...]
    ssim_per_image: tuple[float, ...]

    @property
    def num_images(self) -> int:
        return len(self.psnr_db_per_image)

    def to_dict(self) -> dict[str, float | int]:
        """The summary a report stores (means and the image count)."""
        return {"psnr_db": self.psnr_db, "ssim": self.ssim, "num_images": self.num_images}


def _check_pixels(name: str, images: torch.Tensor) -> None:
    if images.dim() != 4 or images.shape[0] == 0:
        raise AttackInputError(f"{name}: expected a non-empty batch (N, C, H, W), got shape {tuple(images.shape)}")
    if not torch.isfinite(images).all():
        raise AttackInputError(f"{name}: contains non-finite values")
    low, high = float(images.min()), float(images.max())
    if low < -_RANGE_TOLERANCE or high > 1.0 + _RANGE_TOLERANCE:
        raise AttackInputError(f"{name}: expected pixels in [0, 1], got values in [{low:.4g}, {high:.4g}] "
                               "(un-normalise with PixelSpace.to_pixels first)")


def score_images(reconstructed: torch.Tensor, private: torch.Tensor) -> ImageScores:
    """PSNR and SSIM of each reconstruction against its private image, both ``(N, C, H, W)`` in ``[0, 1]``.

    Raises:
        AttackInputError: shapes differ, a batch is empty, values lie outside ``[0, 1]``, or
            the images are smaller than SSIM's 11 x 11 window.
    """
    _check_pixels("reconstructed", reconstructed)
    _check_pixels("private", private)
    if reconstructed.shape != private.shape:
        raise AttackInputError(f"reconstructed {tuple(reconstructed.shape)} and private {tuple(private.shape)} differ in shape")
    if min(private.shape[-2:]) < _SSIM_WINDOW:
        raise AttackInputError(f"SSIM needs images of at least {_SSIM_WINDOW} x {_SSIM_WINDOW}, got {tuple(private.shape[-2:])}")
    x = reconstructed.detach().to(torch.float64).clamp(0.0, 1.0)
    y = private.detach().to(torch.float64).clamp(0.0, 1.0)
    # Per image (reduction over each image's own dims); an exact match is +inf, hence the cap.
    psnr = peak_signal_noise_ratio(x, y, data_range=1.0, reduction="none", dim=(1, 2, 3))  # (N,)
    psnr = psnr.nan_to_num(posinf=MAX_PSNR_DB).clamp_max(MAX_PSNR_DB).tolist()
    ssim_values = ssim(x, y, data_range=1.0, size_average=False).tolist()  # (N,)
    return ImageScores(psnr_db=_mean(psnr), ssim=_mean(ssim_values),
                       psnr_db_per_image=tuple(psnr), ssim_per_image=tuple(ssim_values))


def mean_image_baseline(public: torch.Tensor, private: torch.Tensor) -> ImageScores:
    """The score of predicting the mean of ``public`` (``(M, C, H, W)`` in ``[0, 1]``) for every private image."""
    _check_pixels("public", public)
    if public.shape[1:] != private.shape[1:]:
        raise AttackInputError(f"public images {tuple(public.shape[1:])} and private {tuple(private.shape[1:])} differ in shape")
    guess = public.detach().to(torch.float64).mean(0, keepdim=True).expand_as(private)  # (N, C, H, W)
    return score_images(guess, private)


@dataclass(frozen=True)
class ImageAttackOutcome:
    """One attack's reconstructions scored, beside the mean-image baseline on the same images.

    Attributes:
        attack: the attack's name (a key of :data:`cloud_server.audit.registry.ATTACKS`).
        scores: the reconstructions' scores.
        baseline: the mean-image baseline's scores on the same private images.
        wall_s: the attack's wall time, in seconds.
    """

    attack: str
    scores: ImageScores
    baseline: ImageScores
    wall_s: float

    @property
    def gain_db(self) -> float:
        """How far the attack rises above the baseline, in dB of PSNR."""
        return self.scores.psnr_db - self.baseline.psnr_db

    def to_dict(self) -> dict[str, float | int | str]:
        """The row a report stores."""
        return {"attack": self.attack, "psnr_db": self.scores.psnr_db, "ssim": self.scores.ssim,
                "baseline_psnr_db": self.baseline.psnr_db, "baseline_ssim": self.baseline.ssim,
                "num_images": self.scores.num_images, "wall_s": self.wall_s}


def score_attack(attack: str, reconstructed: torch.Tensor, private: torch.Tensor, public: torch.Tensor,
                 wall_s: float) -> ImageAttackOutcome:
    """Score ``reconstructed`` against ``private`` and the baseline from ``public`` (all in ``[0, 1]``)."""
    return ImageAttackOutcome(attack, score_images(reconstructed, private), mean_image_baseline(public, private), wall_s)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)
