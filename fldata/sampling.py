"""Seeded subsets of a dataset (:func:`take`): stratified by class or uniform."""

from __future__ import annotations

import numpy as np

from fldata.array_dataset import ArrayDataset


def take(ds: ArrayDataset, n: int, seed: int = 0, stratified: bool = True) -> ArrayDataset:
    """A seeded subset of ``n`` samples, in the dataset's original order.

    With ``stratified=True`` each class gets ``n`` times its share of the
    dataset, rounded by largest remainder (ties to the lower class index) and
    capped by what the class has, so class proportions are kept as closely as
    integers allow. With ``stratified=False`` it is a uniform random sample.
    Sample ids are kept.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if n > len(ds):
        raise ValueError(f"cannot take {n} samples from a dataset of {len(ds)}")
    rng = np.random.default_rng(seed)
    if not stratified:
        chosen = rng.choice(len(ds), size=n, replace=False)
        return ds.subset(np.sort(chosen))
    counts = ds.class_counts()
    quotas = _largest_remainder(counts.astype(np.float64) * n / max(len(ds), 1), n, counts)
    chosen_parts = []
    for c in range(ds.num_classes):
        if quotas[c]:
            members = np.flatnonzero(ds.labels == c)
            chosen_parts.append(rng.choice(members, size=int(quotas[c]), replace=False))
    chosen = np.concatenate(chosen_parts) if chosen_parts else np.zeros(0, dtype=np.int64)
    return ds.subset(np.sort(chosen))


def _largest_remainder(shares: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
    """Round non-negative ``shares`` to integers summing to ``total``, each <= its cap.

    Requires ``caps.sum() >= total``. Floors first, then hands out the rest one
    at a time by largest fractional part (stable: ties go to lower indices),
    skipping entries already at their cap.
    """
    out = np.minimum(np.floor(shares).astype(np.int64), caps)
    remaining = total - int(out.sum())
    order = np.argsort(-(shares - np.floor(shares)), kind="stable")
    while remaining > 0:
        progressed = False
        for i in order:
            if remaining == 0:
                break
            if out[i] < caps[i]:
                out[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"cannot place {total} items within caps summing to {int(caps.sum())}")
    return out
