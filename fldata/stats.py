"""Per-channel normalisation statistics: stored for the built-in datasets
(:func:`dataset_stats`), computed for any other (:func:`compute_stats`)."""

from __future__ import annotations

from typing import Final

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.mapped import drop_mapped_pages

# Per-channel mean/std of the *training* split in [0, 1] units, as fed to the
# model. Fashion-MNIST's figures are for the 32x32 zero-padded images (the
# familiar 0.2860/0.3530 are for 28x28; padding adds 240 black pixels).
_STATS: Final[dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = {
    "fashion-mnist": ((0.2190,), (0.3318,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "cinic10": ((0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587)),
}
# make_synthetic's templates are built to sit around 0.5 with this spread, per
# channel, at the default noise (measured, see tests); one value for any C.
_SYNTHETIC_MEAN: Final[float] = 0.5
_SYNTHETIC_STD: Final[float] = 0.3


def dataset_stats(name: str, in_channels: int | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel ``(mean, std)`` in ``[0, 1]`` pixel units for normalisation.

    Known for ``fashion-mnist`` (of the 32x32 padded images), ``cifar10``,
    ``cifar100``, ``cinic10`` (training splits) and ``synthetic`` (any channel
    count: pass ``in_channels``, default 3). For ``imagefolder`` or anything
    else use :func:`compute_stats` on the training data.
    """
    if name == "synthetic":
        c = 3 if in_channels is None else in_channels
        if c < 1:
            raise ValueError(f"in_channels must be >= 1, got {c}")
        return ((_SYNTHETIC_MEAN,) * c, (_SYNTHETIC_STD,) * c)
    if name not in _STATS:
        raise ValueError(
            f"no stored normalisation statistics for {name!r} (known: "
            f"{', '.join([*_STATS, 'synthetic'])}); use compute_stats(train_dataset)"
        )
    mean, std = _STATS[name]
    if in_channels is not None and in_channels != len(mean):
        raise ValueError(f"{name} has {len(mean)} channel(s), asked for stats of {in_channels}")
    return mean, std


def compute_stats(ds: ArrayDataset) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel ``(mean, std)`` of ``ds`` in ``[0, 1]`` units (population std)."""
    if len(ds) == 0:
        raise ValueError("cannot compute statistics of an empty dataset")
    c = ds.in_channels
    total = np.zeros(c, dtype=np.float64)
    total_sq = np.zeros(c, dtype=np.float64)
    chunk = 4096  # float64 copies of a whole CIFAR split would take 1.2 GB
    for start in range(0, len(ds), chunk):
        x = ds.images[start : start + chunk].astype(np.float64) / 255.0
        total += x.sum(axis=(0, 2, 3))
        total_sq += np.square(x).sum(axis=(0, 2, 3))
        drop_mapped_pages(ds.images)
    count = len(ds) * ds.images.shape[2] * ds.images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)
