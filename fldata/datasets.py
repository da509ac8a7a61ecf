"""In-memory image datasets as plain numpy arrays, and their loaders, by their public names.

Each job lives in its own module; this one gathers their public names so that
``from fldata.datasets import ...`` keeps working (new code imports from the module
that does the job). Everything here needs numpy only.

- :mod:`fldata.array_dataset`: the container, :class:`ArrayDataset`, and the
  sample-id scheme (:data:`SPLIT_ID_OFFSETS`);
- :mod:`fldata.loaders`: :func:`load_dataset` and the built-in loaders
  (Fashion-MNIST, CIFAR-10/100, CINIC-10, image folders, npz, synthetic);
- :mod:`fldata.idx`: Fashion-MNIST's IDX parser and its memory-mapped cache;
- :mod:`fldata.image_folder`: ``<class>/<image>`` folders;
- :mod:`fldata.downloads`: the data root, downloads that fail quickly;
- :mod:`fldata.synthetic`: :func:`make_synthetic`;
- :mod:`fldata.sampling`: :func:`take`;
- :mod:`fldata.stats`: normalisation statistics;
- :mod:`fldata.npz_io`: :func:`save_npz` / :func:`load_npz`.
"""

from __future__ import annotations

from fldata.array_dataset import SPLIT_ID_OFFSETS, ArrayDataset
from fldata.downloads import DOWNLOAD_TIMEOUT_S, DownloadError, default_data_root
from fldata.image_folder import ImageFolderError
from fldata.loaders import DATASET_NAMES, DEFAULT_FASHION_MNIST_DIR, load_dataset
from fldata.npz_io import load_npz, save_npz
from fldata.sampling import take
from fldata.stats import compute_stats, dataset_stats
from fldata.synthetic import make_synthetic

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
