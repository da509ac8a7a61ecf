"""In-memory image datasets as plain numpy arrays, and their loaders.

Everything here needs numpy only. torchvision (CIFAR, optional Fashion-MNIST
download) and Pillow (image folders) are imported lazily, inside the loader that
needs them, so a torch-free edge backend can import this module.

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
cache under :func:`default_data_root` (``cache/``) and memory-mapped from there,
so loading a split costs no resident memory until rows are read; a
:meth:`ArrayDataset.subset` of a memory-mapped dataset copies only the chosen
rows and gives the mapped pages back as it goes. An edge agent therefore holds
its own shard as ``uint8``, never the whole split (and never float32: batches
are normalised one at a time by the loaders).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import socket
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Final, Iterator

import numpy as np

from fldata.mapped import drop_mapped_pages, gather_rows
from fldata.registry import get_dataset_spec, list_datasets, register_dataset

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_FASHION_MNIST_DIR",
    "DOWNLOAD_TIMEOUT_S",
    "SPLIT_ID_OFFSETS",
    "ArrayDataset",
    "DownloadError",
    "ImageFolderError",
    "compute_stats",
    "dataset_stats",
    "default_data_root",
    "load_dataset",
    "load_npz",
    "make_synthetic",
    "save_npz",
    "take",
]

#: Added to a sample's index in its split to form its id (see module docstring).
SPLIT_ID_OFFSETS: Final[dict[str, int]] = {
    "train": 0,
    "test": 10_000_000,
    "valid": 20_000_000,
}
# A split larger than this would run into the next split's id range.
_MAX_SPLIT_SIZE: Final[int] = 10_000_000

#: Where Debian's ``dataset-fashion-mnist`` package puts the IDX files.
DEFAULT_FASHION_MNIST_DIR: Final[str] = "/usr/share/datasets/fashion-mnist"

_FASHION_MNIST_CLASSES: Final[tuple[str, ...]] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

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

_IMAGE_SUFFIXES: Final[frozenset[str]] = frozenset({".png", ".jpg", ".jpeg", ".bmp"})
_NPZ_FORMAT: Final[str] = "edgesplit-arraydataset-v1"


# --------------------------------------------------------------------------- #
# The dataset type
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def default_data_root() -> Path:
    """Where downloads and caches go: ``$EDGESPLIT_DATA_DIR`` or ``~/.cache/edgesplit/datasets``."""
    env = os.environ.get("EDGESPLIT_DATA_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "edgesplit" / "datasets"


#: Seconds a download may wait for the network before it fails (connect and each read).
DOWNLOAD_TIMEOUT_S: Final[float] = 15.0


@contextmanager
def _network_timeout(seconds: float) -> Iterator[None]:
    """A default socket timeout for torchvision's downloads, which set none of their own:
    without it an offline machine waits on the operating system's TCP timeouts (minutes)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


class DownloadError(OSError):
    """A dataset download was asked for and failed (no network, a timeout, a bad mirror)."""


def _download(what: str, fetch: Callable[[], object]) -> None:
    try:
        with _network_timeout(DOWNLOAD_TIMEOUT_S):
            fetch()
    except (OSError, RuntimeError) as exc:  # urllib's URLError and socket.timeout are OSErrors; torchvision raises RuntimeError
        raise DownloadError(
            f"downloading {what} failed ({exc}); on a machine without a network install the data locally "
            "(Fashion-MNIST: `apt-get install dataset-fashion-mnist`) or point the data root at a copy"
        ) from exc


def load_dataset(
    name: str,
    split: str = "train",
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> ArrayDataset:
    """Load one split of a named dataset into memory.

    Args:
        name: a registered dataset (:func:`fldata.registry.list_datasets`); built in:

            * ``"fashion-mnist"``: IDX files (``.gz`` or not) in ``root``, its
              torchvision layout ``root/FashionMNIST/raw``, or by default
              :data:`DEFAULT_FASHION_MNIST_DIR` (``apt-get install
              dataset-fashion-mnist``). Only with ``download=True`` does it fall
              back to a torchvision download into ``root`` (or
              :func:`default_data_root`).
            * ``"cifar10"``, ``"cifar100"``: torchvision's copy in ``root`` (or
              :func:`default_data_root`), downloaded if ``download=True``.
            * ``"cinic10"``: an image folder ``root/{train,valid,test}/<class>/*.png``.
            * ``"imagefolder"``: ``root/<split>/<class>/*.{png,jpg,jpeg,bmp}``, or
              ``root/<class>/...`` for ``split="train"`` when ``root/train`` does
              not exist. Classes are the sorted folder names.
            * ``"npz"``: ``root/<split>.npz`` written by :func:`save_npz` (e.g. one
              agent's partition exported with ``python -m fldata.export``), or
              ``root`` itself when it is a ``.npz`` file and ``split="train"``.
            * ``"synthetic"``: :func:`make_synthetic` with 5000 train / 1000 test
              samples, 10 classes, 3 channels, seed 0 (``root`` is ignored).
        split: ``"train"`` or ``"test"`` (``"valid"`` too for CINIC-10 and image
            folders).
        root: directory holding the data; see ``name``.
        download: allow a network download (torchvision datasets only); off by
            default, and a download that gets no answer fails after
            :data:`DOWNLOAD_TIMEOUT_S` seconds.

    Raises:
        ValueError: unknown name or split (the message lists the known ones).
        FileNotFoundError: the data is not on disk and may not be downloaded.
        DownloadError: a download was allowed and failed.
    """
    spec = get_dataset_spec(name)
    if split not in SPLIT_ID_OFFSETS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLIT_ID_OFFSETS)}")
    if split not in spec.splits:
        raise ValueError(f"{name} has no {split!r} split; expected {' or '.join(repr(s) for s in spec.splits)}")
    return spec.loader(split, root, download)


def _load_synthetic(split: str, root: str | os.PathLike[str] | None, download: bool) -> ArrayDataset:
    """5000 train / 1000 test samples of :func:`make_synthetic` (``root`` and ``download`` are ignored)."""
    return _synthetic_split(split)


@functools.lru_cache(maxsize=4)
def _synthetic_split(split: str) -> ArrayDataset:
    # Made once per process and shared (about 1.3 s of CPU for the training split, which every
    # agent, the server's evaluation set and FedBE's unlabeled pool would otherwise each make
    # again): read-only, as ArrayDataset's arrays are to be treated anyway.
    ds = make_synthetic(5000 if split == "train" else 1000, split=split)
    for array in (ds.images, ds.labels, ds.sample_ids):
        array.setflags(write=False)
    return ds


def _load_npz_split(split: str, root: str | os.PathLike[str] | None, download: bool) -> ArrayDataset:
    """``root/<split>.npz`` written by :func:`save_npz`, or ``root`` itself for a ``.npz`` file and ``split="train"``."""
    if root is None:
        raise ValueError("npz needs root=<directory with train.npz / test.npz> (python -m fldata.export writes them)")
    root_path = Path(root)
    if root_path.is_file() and split == "train":
        return load_npz(root_path)
    split_file = root_path / f"{split}.npz"
    if not split_file.is_file():
        raise FileNotFoundError(f"{split_file} not found; export a partition with python -m fldata.export --out {root_path}")
    return load_npz(split_file)


def _image_folder_root(name: str, root: str | os.PathLike[str] | None, download: bool) -> Path:
    # Image folders: there is nothing to download.
    if download:
        raise ValueError(
            f"{name} cannot be downloaded automatically; fetch it yourself and pass root="
            + (" (CINIC-10: https://github.com/BayesWatch/cinic-10)" if name == "cinic10" else "")
        )
    if root is None:
        raise ValueError(f"{name} needs root=<directory with {{train,valid,test}}/<class>/ images>")
    return Path(root)


def _load_cinic10(split: str, root: str | os.PathLike[str] | None, download: bool) -> ArrayDataset:
    """CINIC-10 as an image folder ``root/{train,valid,test}/<class>/*.png``."""
    root_path = _image_folder_root("cinic10", root, download)
    split_dir = root_path / split
    if not split_dir.is_dir():
        raise FileNotFoundError(
            f"CINIC-10 split folder {split_dir} not found; expected "
            f"{root_path}/{{train,valid,test}}/<class>/*.png"
        )
    return _load_image_folder(split_dir, "cinic10", SPLIT_ID_OFFSETS[split])


def _load_imagefolder(split: str, root: str | os.PathLike[str] | None, download: bool) -> ArrayDataset:
    """``root/<split>/<class>/*`` images, or ``root/<class>/*`` as the training split."""
    root_path = _image_folder_root("imagefolder", root, download)
    split_dir = root_path / split
    if split_dir.is_dir():
        return _load_image_folder(split_dir, "imagefolder", SPLIT_ID_OFFSETS[split])
    if split == "train" and root_path.is_dir():
        return _load_image_folder(root_path, "imagefolder", SPLIT_ID_OFFSETS[split])
    raise FileNotFoundError(
        f"image folder split {split_dir} not found (a bare {root_path}/<class>/ layout "
        "is only accepted as split='train')"
    )


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


def _load_fashion_mnist(split: str, root: str | os.PathLike[str] | None, download: bool) -> ArrayDataset:
    prefix = "train" if split == "train" else "t10k"
    if root is not None:
        base = Path(root)
        search = [base, base / "FashionMNIST" / "raw", base / "fashion-mnist"]
    else:
        search = [Path(DEFAULT_FASHION_MNIST_DIR)]
    found = _find_idx_pair(search, prefix)
    if found is None and download:
        _require_module("torchvision", "downloading Fashion-MNIST")
        from torchvision.datasets import FashionMNIST

        dl_root = Path(root) if root is not None else default_data_root()
        _download("Fashion-MNIST", lambda: FashionMNIST(str(dl_root), train=(split == "train"), download=True))
        found = _find_idx_pair([dl_root / "FashionMNIST" / "raw"], prefix)
    if found is None:
        raise FileNotFoundError(
            f"Fashion-MNIST {prefix}-images-idx3-ubyte[.gz] / {prefix}-labels-idx1-ubyte[.gz] "
            f"not found in {', '.join(str(p) for p in search)}; install them with "
            "`apt-get install dataset-fashion-mnist`, point the data root at a directory holding them "
            "(root=, an agent's [data] root or --data-root DIR), or allow a download where a network "
            "exists (download=True, [data] download = true or --download)"
        )
    images_path, labels_path = found
    labels = _read_idx(labels_path)  # (N,)
    images = _idx_images_32(images_path)  # (N, 1, 32, 32) uint8, memory-mapped when the cache can be written
    if labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"Fashion-MNIST files disagree: images {images.shape} from {images_path}, "
            f"labels {labels.shape} from {labels_path}"
        )
    n = images.shape[0]
    return ArrayDataset(
        images=images,
        labels=labels.astype(np.int64),
        sample_ids=np.arange(n, dtype=np.int64) + SPLIT_ID_OFFSETS[split],
        num_classes=10,
        name="fashion-mnist",
        classes=_FASHION_MNIST_CLASSES,
    )


def _require_module(module: str, purpose: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{purpose} needs the '{module}' package, which is not installed "
            "(pip install 'edgesplit[edge]')"
        )


def _load_cifar(
    name: str, split: str, root: str | os.PathLike[str] | None, download: bool
) -> ArrayDataset:
    folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    base = Path(root) if root is not None else default_data_root()
    if not download and not (base / folder).is_dir():
        raise FileNotFoundError(
            f"{name} not found: expected torchvision's {base / folder}; point the data root at the "
            f"directory containing {folder}/ (root=, an agent's [data] root or --data-root DIR), or allow a "
            "download where a network exists (download=True, [data] download = true or --download)"
        )
    _require_module("torchvision", f"loading {name}")
    # torchvision reads CIFAR's own (pickle-based) batch files. That is the
    # format the dataset is published in; nothing we receive over the wire is
    # ever unpickled.
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    if download:
        _download(name, lambda: cls(str(base), train=(split == "train"), download=True))
    tv = cls(str(base), train=(split == "train"), download=False)
    images = np.ascontiguousarray(np.asarray(tv.data, dtype=np.uint8).transpose(0, 3, 1, 2))  # NHWC -> NCHW
    labels = np.asarray(tv.targets, dtype=np.int64)
    _check_split_size(images.shape[0], f"{name} {split}")
    classes = tuple(str(c) for c in tv.classes)
    return ArrayDataset(
        images=images,
        labels=labels,
        sample_ids=np.arange(images.shape[0], dtype=np.int64) + SPLIT_ID_OFFSETS[split],
        num_classes=len(classes),
        name=name,
        classes=classes,
    )


class ImageFolderError(ValueError):
    """An image folder that cannot be used as it is; the message names the file and the fix."""


def _unreadable(path: Path, exc: BaseException) -> ImageFolderError:
    return ImageFolderError(
        f"{path} is not a readable image ({type(exc).__name__}: {exc}): the file is corrupt, truncated or not "
        f"an image; delete it or replace it with a good copy, then start again"
    )


@contextmanager
def _open_image(image_module, path: Path) -> Iterator:  # type: ignore[no-untyped-def]
    """``Image.open(path)``, with an unreadable file named and its fix given (never a bare PIL traceback)."""
    try:
        im = image_module.open(path)
    except (OSError, ValueError, SyntaxError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise _unreadable(path, exc) from exc
    with im:
        yield im


def _load_image_folder(directory: Path, name: str, id_offset: int) -> ArrayDataset:
    """Read ``directory/<class>/<image>``; classes are the sorted folder names."""
    _require_module("PIL", f"loading {name} image folders")
    from PIL import Image

    class_dirs = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise FileNotFoundError(f"no class folders in {directory}; expected {directory}/<class>/<image>")
    files: list[Path] = []
    labels_list: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        class_files = sorted(
            p for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES
        )
        files.extend(class_files)
        labels_list.extend([label] * len(class_files))
    if not files:
        raise FileNotFoundError(
            f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) under the class folders of {directory}"
        )
    _check_split_size(len(files), str(directory))

    # First pass reads headers only (Image.open is lazy) to settle one mode and
    # one size for the whole folder; we never resize silently.
    modes: set[str] = set()
    size: tuple[int, int] | None = None
    first: Path | None = None
    for path in files:
        with _open_image(Image, path) as im:
            modes.add(im.mode)
            if size is None:
                size, first = im.size, path
            elif im.size != size:
                raise ImageFolderError(
                    f"image folder {directory} mixes image sizes: {path} is {im.size[0]}x{im.size[1]}, "
                    f"{first} and the images before it are {size[0]}x{size[1]}; every image of a device (and of the run) "
                    f"must have one size: resize {path} (or the others) first"
                )
    if size is None:  # unreachable: files is non-empty; narrows the type for checkers
        raise FileNotFoundError(f"no images under {directory}")
    mode = "L" if modes <= {"L", "1"} else "RGB"
    channels = 1 if mode == "L" else 3
    width, height = size
    images = np.empty((len(files), channels, height, width), dtype=np.uint8)
    for i, path in enumerate(files):
        with _open_image(Image, path) as im:
            try:
                arr = np.asarray(im.convert(mode), dtype=np.uint8)
            except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
                raise _unreadable(path, exc) from exc
        images[i] = arr[None, :, :] if channels == 1 else arr.transpose(2, 0, 1)  # HWC -> CHW
    images = _pad_28_to_32(images)
    return ArrayDataset(
        images=np.ascontiguousarray(images),
        labels=np.asarray(labels_list, dtype=np.int64),
        sample_ids=np.arange(len(files), dtype=np.int64) + id_offset,
        num_classes=len(class_dirs),
        name=name,
        classes=tuple(p.name for p in class_dirs),
    )


# --------------------------------------------------------------------------- #
# Synthetic data
# --------------------------------------------------------------------------- #

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


# --------------------------------------------------------------------------- #
# Subsets, statistics, files
# --------------------------------------------------------------------------- #


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


# -- the built-in datasets ------------------------------------------------------ #

register_dataset("fashion-mnist", description="Fashion-MNIST: IDX files (Debian's dataset-fashion-mnist), torchvision download")(_load_fashion_mnist)
register_dataset("cifar10", description="CIFAR-10: torchvision's copy, downloaded if allowed")(functools.partial(_load_cifar, "cifar10"))
register_dataset("cifar100", description="CIFAR-100: torchvision's copy, downloaded if allowed")(functools.partial(_load_cifar, "cifar100"))
register_dataset("cinic10", splits=("train", "valid", "test"), description="CINIC-10 as an image folder")(_load_cinic10)
register_dataset("imagefolder", splits=("train", "valid", "test"))(_load_imagefolder)
register_dataset("npz", splits=("train", "valid", "test"))(_load_npz_split)
register_dataset("synthetic")(_load_synthetic)

#: The built-in dataset names (:func:`fldata.registry.list_datasets` also lists any registered later).
DATASET_NAMES: Final[tuple[str, ...]] = list_datasets()
