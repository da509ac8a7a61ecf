"""The run's public global test set: a seeded, stratified subset of a dataset's test
split, loaded the same way wherever it is loaded (the server's evaluator, an agent that
scores a private model on it), and named by digests of its sample ids and images, so
that two copies can be told identical without comparing them byte by byte."""

from __future__ import annotations

import hashlib

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.loaders import load_dataset
from fldata.sampling import take

__all__ = ["load_public_test_set", "public_set_digests"]


def load_public_test_set(dataset: str, samples: int = 0, seed: int = 0, root: str | None = None,
                         download: bool = False) -> ArrayDataset:
    """``samples`` images of ``dataset``'s test split (0: the whole split), drawn with ``seed``
    as :func:`fldata.subsets.seeded_subset` cuts the test split the agents' test shares come from."""
    test = load_dataset(dataset, "test", root, download)
    if samples:
        test = take(test, min(samples, len(test)), seed)
    return test


def public_set_digests(data: ArrayDataset) -> tuple[str, str]:
    """(ids_sha256, images_sha256): sha256 of the sample ids as little-endian int64 and of the
    uint8 images (N, C, H, W) in C order."""
    ids = np.ascontiguousarray(data.sample_ids, dtype="<i8")
    return (hashlib.sha256(ids.tobytes()).hexdigest(),
            hashlib.sha256(np.ascontiguousarray(data.images).tobytes()).hexdigest())
