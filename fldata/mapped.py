"""Images that stay on disk: memory-mapped rows read a block at a time.

A memory-mapped array costs no resident memory until its rows are read, but
every page a read touches stays mapped into the process (and counted in its
RSS) until the kernel needs it back. The helpers here read rows and then give
the pages back (``MADV_DONTNEED``; the data stays in the page cache, so the next
read is not a disk read), so a dataset of any size holds about one block of
rows at a time:

* :func:`gather_rows`: ``images[idx]`` as an in-memory array, for a mapped or an
  in-memory source alike (the same values either way);
* :func:`keep_on_disk`: a dataset whose images are moved into an unnamed file
  and mapped back from it (``--low-memory`` agents hold their shard this way:
  about 1 MB less resident memory per 1,000 32x32 single-channel images);
* :func:`drop_mapped_pages`: give back whatever a mapped array has resident.

Everything here needs numpy only.
"""

from __future__ import annotations

import dataclasses
import mmap
import tempfile
from pathlib import Path
from typing import Final, Protocol, TypeVar

import numpy as np

__all__ = ["GATHER_ROWS", "drop_mapped_pages", "gather_rows", "is_mapped", "keep_on_disk"]

#: Rows copied per step out of a memory-mapped array before its pages are given back. Small:
#: a page fault maps its neighbours too (the kernel's fault-around, 64 KiB), so each
#: scattered row can bring 64 rows' worth of pages into this process until they are dropped.
GATHER_ROWS: Final[int] = 64


def is_mapped(images: np.ndarray) -> bool:
    """Whether ``images`` reads from a file mapping (its pages are given back after reads)."""
    return isinstance(images, np.memmap)


def gather_rows(images: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``images[idx]`` as an in-memory array, rows in ``idx``'s order.

    For a memory-mapped source the rows are read in ascending file order, a
    block of :data:`GATHER_ROWS` at a time, and the mapping's pages are dropped
    from this process after each block (``MADV_DONTNEED``; they stay in the page
    cache), so reading a shard's rows never makes the whole file resident.
    """
    if not is_mapped(images) or idx.size == 0:
        return np.asarray(images[idx])
    out = np.empty((idx.size, *images.shape[1:]), dtype=images.dtype)
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    mapping = getattr(images, "_mmap", None)  # numpy keeps the mmap object here, views included
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)  # no read-ahead for scattered rows
    for start in range(0, idx.size, GATHER_ROWS):
        out[order[start : start + GATHER_ROWS]] = images[ordered[start : start + GATHER_ROWS]]
        _drop(mapping)
    return out


def drop_mapped_pages(images: np.ndarray) -> None:
    """Give back the pages of a memory-mapped array that reads made resident (a no-op otherwise)."""
    if is_mapped(images):
        _drop(getattr(images, "_mmap", None))


def _drop(mapping: object) -> None:
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


class _WithImages(Protocol):
    """A dataclass dataset (:class:`fldata.ArrayDataset`) as far as this module reads it."""

    images: np.ndarray

    def __len__(self) -> int: ...


_Dataset = TypeVar("_Dataset", bound=_WithImages)


def keep_on_disk(ds: _Dataset, directory: str | Path) -> _Dataset:
    """``ds`` with its images written to an unnamed file in ``directory`` and mapped back read-only.

    The file has no name from the start (``tempfile.TemporaryFile``), so it is
    gone when the mapping is, however the process ends. The labels and sample ids
    (9 bytes a sample for 1,024 of pixels at 32x32x1) stay in memory. A dataset
    whose images are already mapped is returned as it is. ``directory`` must be
    on a disk, not a RAM-backed tmpfs, or nothing is saved.

    Raises:
        OSError: ``directory`` cannot be created or written; the message names it.
    """
    if is_mapped(ds.images) or len(ds) == 0:
        return ds
    where = Path(directory)
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where) as spill:
            np.ascontiguousarray(ds.images).tofile(spill)
            spill.flush()
            # np.memmap keeps its own duplicate of the descriptor: closing ``spill`` leaves the mapping valid.
            images = np.memmap(spill, dtype=ds.images.dtype, mode="r", shape=ds.images.shape)
    except OSError as err:
        raise OSError(f"cannot keep the shard's images on disk in {where}: {err}; point EDGESPLIT_DATA_DIR at a "
                      "writable directory on a disk, or set [memory] shard_on_disk = false") from err
    return dataclasses.replace(ds, images=images)  # type: ignore[type-var]
