"""Fashion-MNIST's IDX files: the parser, and the padded, uncompressed ``.npy`` cache
that the images are memory-mapped from.

Fashion-MNIST's images are decompressed once into an uncompressed ``.npy``
cache under :func:`~fldata.downloads.default_data_root` (``cache/``) and
memory-mapped from there, so loading a split costs no resident memory until
rows are read.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fldata.array_dataset import _pad_28_to_32
from fldata.downloads import default_data_root


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) of unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic {data[:4].hex()})")
    type_code, ndim = data[2], data[3]
    if type_code != 0x08:
        raise ValueError(f"{path}: expected IDX type 0x08 (unsigned byte), got 0x{type_code:02x}")
    header_len = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    expected = int(np.prod(dims, dtype=np.int64))
    if len(data) - header_len != expected:
        raise ValueError(
            f"{path}: header announces dims {dims} = {expected} bytes, file has "
            f"{len(data) - header_len}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(dims)


def _read_idx_header(f: BinaryIO, path: Path) -> tuple[int, ...]:
    head = f.read(4)
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic {head.hex()})")
    if head[2] != 0x08:
        raise ValueError(f"{path}: expected IDX type 0x08 (unsigned byte), got 0x{head[2]:02x}")
    ndim = head[3]
    raw = f.read(4 * ndim)
    if len(raw) != 4 * ndim:
        raise ValueError(f"{path}: IDX header cut short")
    return tuple(struct.unpack(f">{ndim}I", raw))


def _idx_cache_path(source: Path) -> Path:
    """Where the padded, uncompressed copy of ``source`` lives; the name changes with the source."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return default_data_root() / "cache" / f"{source.name.removesuffix('.gz')}-32x32-{key}.npy"


def _idx_images_32(path: Path) -> np.ndarray:
    """An IDX image file as ``uint8 (N, 1, 32, 32)`` (28x28 zero-padded), memory-mapped.

    The first call streams the (gzip) file, a block of rows at a time, into an
    uncompressed ``.npy`` cache (see :func:`_idx_cache_path`); later calls map
    the cache. Where the cache cannot be written (a read-only home), the
    images are read into memory instead (``uint8``, about 61 MB for the
    training split).
    """
    cache = _idx_cache_path(path)
    if not cache.is_file():
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            _write_idx_cache(path, cache)
        except PermissionError:
            images = _read_idx(path)
            if images.ndim != 3:
                raise ValueError(f"{path}: expected IDX images (N, H, W), got shape {images.shape}") from None
            return np.ascontiguousarray(_pad_28_to_32(images[:, None, :, :]))
    images = np.load(cache, mmap_mode="r", allow_pickle=False)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 1:
        raise ValueError(f"{cache} is not a padded IDX image cache (dtype {images.dtype}, shape {images.shape}); delete it")
    return images


def _write_idx_cache(path: Path, cache: Path) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    fd, tmp_name = tempfile.mkstemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent)
    try:
        with opener(path, "rb") as src, os.fdopen(fd, "wb") as dst:
            dims = _read_idx_header(src, path)
            if len(dims) != 3:
                raise ValueError(f"{path}: expected IDX images (N, H, W), got dims {dims}")
            n, h, w = dims
            out_h, out_w = (32, 32) if (h, w) == (28, 28) else (h, w)
            np.lib.format.write_array_header_1_0(
                dst, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": (n, 1, out_h, out_w)}
            )
            rows = 1024  # a block of about 1 MB at a time
            for start in range(0, n, rows):
                count = min(rows, n - start)
                block = src.read(count * h * w)
                if len(block) != count * h * w:
                    raise ValueError(f"{path}: header announces {n} images of {h}x{w}, the file ends after {start + len(block) // (h * w)}")
                images = np.frombuffer(block, np.uint8).reshape(count, 1, h, w)
                dst.write(_pad_28_to_32(images).tobytes())
            if src.read(1):
                raise ValueError(f"{path}: more data than the header's dims {dims} announce")
        os.chmod(tmp_name, 0o644)  # mkstemp's 0600 would keep other users' agents from sharing the cache
        os.replace(tmp_name, cache)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _find_idx_pair(directories: list[Path], prefix: str) -> tuple[Path, Path] | None:
    for d in directories:
        for suffix in (".gz", ""):
            images = d / f"{prefix}-images-idx3-ubyte{suffix}"
            labels = d / f"{prefix}-labels-idx1-ubyte{suffix}"
            if images.is_file() and labels.is_file():
                return images, labels
    return None
