"""Synthetic data: a small, seeded, learnable image classification set
(:func:`make_synthetic`) for tests, demos and machines without datasets."""

from __future__ import annotations

from typing import Final

import numpy as np

from fldata.array_dataset import SPLIT_ID_OFFSETS, ArrayDataset, _check_split_size

# Separate RNG streams per quantity keep a smaller set a prefix of a larger one
# with the same seed (numpy's Generator fills arrays sequentially).
_STREAM_TEMPLATES, _STREAM_LABELS, _STREAM_NOISE, _STREAM_SHIFT, _STREAM_GAIN = range(5)
_SPLIT_CODES: Final[dict[str, int]] = {"train": 0, "test": 1, "valid": 2}


def _synthetic_templates(num_classes: int, in_channels: int, size: int, seed: int) -> np.ndarray:
    """One fixed pattern per class, float32 ``(K, C, S, S)`` in about ``[0.05, 0.95]``.

    Each template mixes a smooth random colour field (upsampled 4x4 grid) with
    an oriented sinusoidal grating whose angle and frequency depend on the
    class. Both survive small shifts, so a CNN with global pooling learns them.
    """
    rng = np.random.default_rng([seed, _STREAM_TEMPLATES])
    coarse = rng.uniform(0.0, 1.0, size=(num_classes, in_channels, 4, 4))
    # Bilinear-ish upsampling via separable linear interpolation.
    grid = np.linspace(0.0, 3.0, size)
    lo = np.floor(grid).astype(int).clip(0, 2)
    frac = grid - lo
    rows = coarse[:, :, lo, :] * (1 - frac)[None, None, :, None] + coarse[:, :, lo + 1, :] * frac[None, None, :, None]
    field = rows[:, :, :, lo] * (1 - frac) + rows[:, :, :, lo + 1] * frac  # (K, C, S, S)

    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    angles = np.pi * (np.arange(num_classes) + rng.uniform(0.0, 0.5, num_classes)) / num_classes
    freqs = rng.uniform(2.0, 6.0, num_classes) / size  # cycles per pixel
    phases = rng.uniform(0.0, 2 * np.pi, (num_classes, in_channels))
    proj = np.cos(angles)[:, None, None] * xx + np.sin(angles)[:, None, None] * yy  # (K, S, S)
    grating = np.sin(2 * np.pi * freqs[:, None, None, None] * proj[:, None] + phases[:, :, None, None])
    templates = 0.5 * field + 0.5 * (0.5 + 0.4 * grating)
    return (0.05 + 0.9 * templates).astype(np.float32)


def make_synthetic(
    num_samples: int,
    num_classes: int = 10,
    in_channels: int = 3,
    size: int = 32,
    seed: int = 0,
    noise: float = 0.3,
    split: str = "train",
    max_shift: int = 2,
) -> ArrayDataset:
    """A small, seeded, learnable image classification set.

    Each class has one fixed template (``seed`` decides them, so train and test
    splits with the same seed share templates). A sample is its class template
    rolled by up to ``max_shift`` pixels, scaled by a random gain in
    ``[0.8, 1.2]``, plus Gaussian noise of std ``noise`` (in ``[0, 1]`` pixel
    units), clipped and quantised to ``uint8``. Labels cycle through a fresh
    permutation of the classes every ``num_classes`` samples, so classes are
    balanced to within one sample.

    Deterministic in all arguments; the first ``n`` samples of a larger set
    equal a set of ``n`` made with the same other arguments.

    Train it without flip augmentation: a horizontal flip mirrors a grating's
    orientation into another class's.
    """
    for arg, value, minimum in (
        ("num_samples", num_samples, 0),
        ("num_classes", num_classes, 2),
        ("in_channels", in_channels, 1),
        ("size", size, 4),
        ("seed", seed, 0),
        ("max_shift", max_shift, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{arg} must be an int >= {minimum}, got {value!r}")
    if not noise >= 0.0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    if split not in _SPLIT_CODES:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(_SPLIT_CODES)}")
    _check_split_size(num_samples, "synthetic dataset")
    templates = _synthetic_templates(num_classes, in_channels, size, seed)

    def stream(which: int) -> np.random.Generator:
        return np.random.default_rng([seed, _SPLIT_CODES[split], which, num_classes, in_channels, size])

    blocks = -(-num_samples // num_classes)  # ceil
    label_rng = stream(_STREAM_LABELS)
    labels = np.concatenate(
        [label_rng.permutation(num_classes) for _ in range(blocks)] or [np.zeros(0, dtype=np.int64)]
    )[:num_samples].astype(np.int64)
    shifts = stream(_STREAM_SHIFT).integers(-max_shift, max_shift + 1, size=(num_samples, 2))
    gains = stream(_STREAM_GAIN).uniform(0.8, 1.2, size=num_samples).astype(np.float32)
    noise_rng = stream(_STREAM_NOISE)

    images = np.empty((num_samples, in_channels, size, size), dtype=np.uint8)
    chunk = 1024  # bounds the float32 working set
    for start in range(0, num_samples, chunk):
        stop = min(start + chunk, num_samples)
        x = templates[labels[start:stop]]  # (B, C, S, S) float32
        for j in range(stop - start):
            dy, dx = shifts[start + j]
            if dy or dx:
                x[j] = np.roll(x[j], (int(dy), int(dx)), axis=(1, 2))
        x = 0.5 + (x - 0.5) * gains[start:stop, None, None, None]
        x += np.float32(noise) * noise_rng.standard_normal(x.shape, dtype=np.float32)
        images[start:stop] = np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)
    return ArrayDataset(
        images=images,
        labels=labels,
        sample_ids=np.arange(num_samples, dtype=np.int64) + SPLIT_ID_OFFSETS[split],
        num_classes=num_classes,
        name="synthetic",
        classes=tuple(f"pattern{c}" for c in range(num_classes)),
    )
