"""The dataset container: :class:`ArrayDataset`, a labelled image set held as plain
numpy arrays, with its sample-id scheme and image layout. Needs numpy only.

Sample ids
----------
Every sample carries a stable ``int64`` id so that per-sample state (FedGKT's
server logits, for one) is keyed by identity, never by batch position. The id is
the sample's index in its original split plus a per-split offset
(:data:`SPLIT_ID_OFFSETS`): train ``0 + i``, test ``10_000_000 + i``, valid
``20_000_000 + i``. Ids therefore never collide across the splits of one
dataset, and they survive :meth:`ArrayDataset.subset`, :func:`take`, partitioning
and ``.npz`` round trips. For image folders the index is the position in the
sorted (class folder, file name) order, so it is stable while the folder's
contents do not change.

Image layout
------------
``images`` are ``uint8`` ``(N, C, H, W)``. 28x28 images (Fashion-MNIST, MNIST-like
folders) are zero-padded by 2 px on every side to 32x32 at load time, keeping
their single channel, because every model in EdgeSplit takes 32x32 inputs and
``in_channels`` as a parameter.

Memory
------
Fashion-MNIST's images are decompressed once into an uncompressed ``.npy``
cache under :func:`fldata.downloads.default_data_root` (``cache/``) and memory-mapped from there,
so loading a split costs no resident memory until rows are read; a
:meth:`ArrayDataset.subset` of a memory-mapped dataset copies only the chosen
rows and gives the mapped pages back as it goes. An edge agent therefore holds
its own shard as ``uint8``, never the whole split (and never float32: batches
are normalised one at a time by the loaders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fldata.mapped import gather_rows

#: Added to a sample's index in its split to form its id (see module docstring).
SPLIT_ID_OFFSETS: Final[dict[str, int]] = {
    "train": 0,
    "test": 10_000_000,
    "valid": 20_000_000,
}
# A split larger than this would run into the next split's id range.
_MAX_SPLIT_SIZE: Final[int] = 10_000_000


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A labelled image dataset held in memory as numpy arrays.

    Attributes:
        images: ``uint8`` array ``(N, C, H, W)``.
        labels: ``int64`` array ``(N,)`` with values in ``[0, num_classes)``.
        sample_ids: ``int64`` array ``(N,)``; stable and unique within the
            dataset (see the module docstring for the scheme).
        num_classes: number of classes of the *full* dataset (a shard that
            lacks some classes keeps the full count, so label spaces agree).
        name: dataset name, e.g. ``"cifar10"``; used to look up normalisation
            statistics, so shards keep their parent's name.
        classes: one human-readable name per class; defaults to ``"0"``,
            ``"1"``, ...

    The arrays are not copied and not made read-only: treat them as immutable.
    ``images`` may be a read-only :class:`numpy.memmap` (see "Memory" in the
    module docstring); :meth:`subset` then reads only the rows it keeps.
    ``eq=False`` because element-wise array comparison has no single truth
    value; compare datasets with :func:`numpy.array_equal` on the fields.
    """

    images: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    num_classes: int
    name: str
    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require_array("images", self.images, np.uint8, ndim=4)
        n = self.images.shape[0]
        _require_array("labels", self.labels, np.int64, ndim=1)
        _require_array("sample_ids", self.sample_ids, np.int64, ndim=1)
        if self.labels.shape[0] != n or self.sample_ids.shape[0] != n:
            raise ValueError(
                f"images, labels and sample_ids must have the same length; got "
                f"{n}, {self.labels.shape[0]} and {self.sample_ids.shape[0]}"
            )
        if not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool):
            raise ValueError(f"num_classes must be an int, got {self.num_classes!r}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if n and (self.labels.min() < 0 or self.labels.max() >= self.num_classes):
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}); got values in "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]"
            )
        if n:
            unique_ids = np.unique(self.sample_ids)
            if unique_ids.shape[0] != n:
                raise ValueError(
                    f"sample_ids must be unique; {n - unique_ids.shape[0]} of {n} "
                    "are duplicates (a subset with repeated indices?)"
                )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        if self.classes == ():
            # Frozen: the default must be filled in through object.__setattr__.
            object.__setattr__(self, "classes", tuple(str(c) for c in range(self.num_classes)))
        if not isinstance(self.classes, tuple) or not all(isinstance(c, str) for c in self.classes):
            raise ValueError(f"classes must be a tuple of str, got {self.classes!r}")
        if len(self.classes) != self.num_classes:
            raise ValueError(
                f"classes must name each of the {self.num_classes} classes; got "
                f"{len(self.classes)} names"
            )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(name={self.name!r}, n={len(self)}, "
            f"image_shape={self.image_shape}, num_classes={self.num_classes})"
        )

    @property
    def in_channels(self) -> int:
        """Number of image channels ``C`` (1 for Fashion-MNIST, 3 for CIFAR)."""
        return int(self.images.shape[1])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        _, c, h, w = self.images.shape
        return (int(c), int(h), int(w))

    def class_counts(self) -> np.ndarray:
        """Samples per class, ``int64`` ``(num_classes,)``."""
        return np.bincount(self.labels, minlength=self.num_classes).astype(np.int64)

    def subset(self, indices: np.ndarray | list[int] | range) -> ArrayDataset:
        """The samples at ``indices`` (in that order), keeping their sample ids.

        ``indices`` are positions in this dataset: integers in ``[0, len)`` or a
        boolean mask of length ``len``. Repeated positions are an error because
        sample ids must stay unique.
        """
        idx = np.asarray(indices)
        n = len(self)
        if idx.dtype == np.bool_:
            if idx.shape != (n,):
                raise ValueError(f"a boolean mask must have shape ({n},), got {idx.shape}")
            idx = np.flatnonzero(idx)
        elif idx.size == 0:
            idx = np.zeros(0, dtype=np.int64)
        elif not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"indices must be integers or a boolean mask, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(
                f"indices must lie in [0, {n}); got values in [{int(idx.min())}, {int(idx.max())}]"
            )
        return ArrayDataset(
            images=gather_rows(self.images, idx),
            labels=self.labels[idx],
            sample_ids=self.sample_ids[idx],
            num_classes=self.num_classes,
            name=self.name,
            classes=self.classes,
        )


def _require_array(field: str, value: object, dtype: type, ndim: int) -> None:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{field} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{field} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{field} must be {ndim}-D, got shape {value.shape}")


def _pad_28_to_32(images: np.ndarray) -> np.ndarray:
    """Zero-pad ``(N, C, 28, 28)`` to ``(N, C, 32, 32)``; other sizes pass through."""
    if images.shape[2:] != (28, 28):
        return images
    return np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2)), mode="constant", constant_values=0)


def _check_split_size(n: int, what: str) -> None:
    if n >= _MAX_SPLIT_SIZE:
        raise ValueError(
            f"{what} has {n} samples; the sample-id scheme allows fewer than "
            f"{_MAX_SPLIT_SIZE} per split"
        )
