"""An :class:`ArrayDataset` as an uncompressed ``.npz`` file (no pickle):
:func:`save_npz` writes it atomically, :func:`load_npz` reads and checks it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final

import numpy as np

from fldata.array_dataset import ArrayDataset

_NPZ_FORMAT: Final[str] = "edgesplit-arraydataset-v1"


def save_npz(ds: ArrayDataset, path: str | os.PathLike[str]) -> None:
    """Write ``ds`` to an uncompressed ``.npz`` at exactly ``path`` (no pickle).

    The write goes to a temporary file in the same directory and is renamed
    into place, so a reader never sees half a file.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            # Passing a file object stops numpy from appending ".npz" to the name.
            np.savez(
                f,
                format=np.array(_NPZ_FORMAT),
                images=ds.images,
                labels=ds.labels,
                sample_ids=ds.sample_ids,
                num_classes=np.array(ds.num_classes, dtype=np.int64),
                name=np.array(ds.name),
                classes=np.array(ds.classes, dtype=np.str_),
            )
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def load_npz(path: str | os.PathLike[str]) -> ArrayDataset:
    """Read a dataset written by :func:`save_npz` (``allow_pickle=False``)."""
    expected = {"format", "images", "labels", "sample_ids", "num_classes", "name", "classes"}
    loaded = np.load(path, allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is a single .npy array, not an EdgeSplit dataset (.npz) file")
    with loaded as z:
        keys = set(z.files)
        if keys != expected:
            raise ValueError(
                f"{path} is not an EdgeSplit dataset file: expected arrays {sorted(expected)}, "
                f"found {sorted(keys)}"
            )
        fmt = str(z["format"])
        if fmt != _NPZ_FORMAT:
            raise ValueError(f"{path}: expected format {_NPZ_FORMAT!r}, found {fmt!r}")
        return ArrayDataset(
            images=z["images"],
            labels=z["labels"],
            sample_ids=z["sample_ids"],
            num_classes=int(z["num_classes"]),
            name=str(z["name"]),
            classes=tuple(str(c) for c in z["classes"]),
        )
