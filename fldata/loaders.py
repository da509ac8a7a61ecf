"""The built-in dataset loaders and :func:`load_dataset`, which loads one split of a
registered dataset by name.

Everything here needs numpy only. torchvision (CIFAR, optional Fashion-MNIST
download) and Pillow (image folders) are imported lazily, inside the loader that
needs them, so a torch-free edge backend can import this module. Importing it
registers the built-in datasets (:mod:`fldata.registry`). Fashion-MNIST is
memory-mapped from its cache (:mod:`fldata.idx`; "Memory" in
:mod:`fldata.array_dataset`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Final

import numpy as np

from fldata.array_dataset import SPLIT_ID_OFFSETS, ArrayDataset, _check_split_size
from fldata.downloads import _download, _require_module, default_data_root
from fldata.idx import _find_idx_pair, _idx_images_32, _read_idx
from fldata.image_folder import _load_image_folder
from fldata.npz_io import load_npz
from fldata.registry import get_dataset_spec, list_datasets, register_dataset
from fldata.synthetic import make_synthetic

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
    # Made once per process and shared (seconds of CPU for the training split, which every
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
