"""Batches of normalised images as numpy arrays, for backends without torch.

The counterpart of :mod:`fldata.torch_data`: the same normalisation
(``pixel * scale - shift`` in float32, with the statistics
:class:`fldata.torch_data.TorchArrayDataset` would pick) and the same CIFAR-style
augmentation (random crop from a zero-padded image, horizontal flip), drawn from
numpy generators. Batches are ``(images (B, C, H, W) float32, labels (B,) int64,
sample_ids (B,) int64)``. Shuffle order differs from torch's loader (another
generator); per-sample state is keyed by sample id, so that does not matter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.mapped import gather_rows
from fldata.stats import compute_stats, dataset_stats

__all__ = ["Normalizer", "default_stats", "iterate_batches", "num_batches"]

_KNOWN_STATS = ("fashion-mnist", "cifar10", "cifar100", "cinic10", "synthetic")


def default_stats(ds: ArrayDataset) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The statistics the torch loader uses by default (published ones, else the data's own)."""
    if ds.name in _KNOWN_STATS:
        return dataset_stats(ds.name, ds.in_channels)
    return compute_stats(ds)


class Normalizer:
    """``uint8 (B, C, H, W) -> float32 (pixel / 255 - mean) / std``, bit-identical to the torch loader."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or any(not s > 0 for s in std):
            raise ValueError(f"need one positive std per mean, got mean={tuple(mean)} std={tuple(std)}")
        c = len(mean)
        std32 = np.asarray(std, dtype=np.float32).reshape(c, 1, 1)
        # Same float32 operations, in the same order, as TorchArrayDataset.
        self.scale = (np.float32(1.0) / (np.float32(255.0) * std32)).astype(np.float32)
        self.shift = (np.asarray(mean, dtype=np.float32).reshape(c, 1, 1) / std32).astype(np.float32)

    @classmethod
    def for_dataset(cls, ds: ArrayDataset) -> "Normalizer":
        return cls(*default_stats(ds))

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return (images.astype(np.float32) * self.scale - self.shift).astype(np.float32, copy=False)


def _crop_flip(images: np.ndarray, rng: np.random.Generator, padding: int) -> np.ndarray:
    n, c, h, w = images.shape
    out = np.empty_like(images)
    padded = np.pad(images, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    offsets = rng.integers(0, 2 * padding + 1, size=(n, 2))
    flips = rng.random(n) < 0.5
    for i in range(n):
        top, left = offsets[i]
        crop = padded[i, :, top : top + h, left : left + w]
        out[i] = crop[:, :, ::-1] if flips[i] else crop
    return out


def num_batches(n: int, batch_size: int) -> int:
    return (n + batch_size - 1) // batch_size


def iterate_batches(
    ds: ArrayDataset,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    augment: bool = False,
    normalizer: Normalizer | None = None,
    crop_padding: int = 4,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(images, labels, sample_ids)`` batches; the same arguments give the same batches."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    norm = normalizer or Normalizer.for_dataset(ds)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(ds)) if shuffle else np.arange(len(ds))
    augment_rng = np.random.default_rng([seed, 0x5EED_A06])
    for start in range(0, len(ds), batch_size):
        idx = np.sort(order[start : start + batch_size]) if not shuffle else order[start : start + batch_size]
        raw = gather_rows(ds.images, idx)  # (B, C, H, W) uint8; a mapped shard's pages given back
        if augment:
            raw = _crop_flip(raw, augment_rng, crop_padding)
        yield norm(raw), ds.labels[idx].astype(np.int64), ds.sample_ids[idx].astype(np.int64)
