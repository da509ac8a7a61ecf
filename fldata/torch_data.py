"""torch views of :class:`fldata.array_dataset.ArrayDataset`.

The only module of ``fldata`` that imports torch. Items are
``(image, label, sample_id)``: the sample id travels with every image so that
per-sample knowledge (FedGKT's server logits) is matched by identity even under
a shuffled loader.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from fldata.array_dataset import ArrayDataset
from fldata.mapped import gather_rows
from fldata.stats import compute_stats, dataset_stats

__all__ = ["TorchArrayDataset", "make_loader"]

# Salt mixed into the loader seed for the augmentation stream, so shuffling and
# augmentation do not draw from correlated generators.
_AUGMENT_SEED_SALT = 0x5EED_A06


class TorchArrayDataset(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """An :class:`ArrayDataset` as a map-style torch dataset.

    ``dataset[i]`` is ``(image, label, sample_id)``: ``image`` float32
    ``(C, H, W)`` normalised per channel as ``(pixel / 255 - mean) / std``,
    ``label`` and ``sample_id`` 0-d int64 tensors.

    Args:
        ds: the data; its arrays are shared, not copied (unless read-only).
        mean, std: per-channel statistics in ``[0, 1]`` units; default
            :func:`dataset_stats` for known dataset names, else
            :func:`compute_stats` of ``ds`` itself.
        augment: CIFAR-style augmentation: random crop back to ``H x W`` from
            the image zero-padded by ``crop_padding`` pixels, then a horizontal
            flip with probability 1/2. Applied to raw pixels before
            normalisation, as torchvision's ``RandomCrop`` +
            ``RandomHorizontalFlip`` + ``Normalize`` would.
        generator: source of augmentation randomness; ``None`` uses torch's
            global generator (which DataLoader workers seed individually).
        crop_padding: pixels of zero padding for the random crop.
    """

    def __init__(
        self,
        ds: ArrayDataset,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: bool = False,
        generator: torch.Generator | None = None,
        crop_padding: int = 4,
    ) -> None:
        if (mean is None) != (std is None):
            raise ValueError("pass both mean and std, or neither")
        if mean is None or std is None:
            mean, std = _default_stats(ds)
        c = ds.in_channels
        if len(mean) != c or len(std) != c:
            raise ValueError(f"mean and std need {c} values (one per channel), got {len(mean)} and {len(std)}")
        if any(not s > 0 for s in std):
            raise ValueError(f"std values must be > 0, got {tuple(std)}")
        if crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {crop_padding}")
        self.source = ds
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.augment = augment
        self.crop_padding = crop_padding
        self.generator = generator
        # torch.from_numpy shares memory, read-only arrays (a memory-mapped split) too:
        # it only warns that writes would be undefined, and nothing here writes to
        # the images (crops, flips and normalisation make new tensors). Copying
        # instead would make a mapped dataset resident.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self._images = torch.from_numpy(ds.images)  # (N, C, H, W) uint8
        self._labels = torch.from_numpy(np.ascontiguousarray(ds.labels))  # (N,) int64
        self._sample_ids = torch.from_numpy(np.ascontiguousarray(ds.sample_ids))  # (N,) int64
        # (x / 255 - mean) / std == x * scale - shift, one fused step per image.
        std_t = torch.tensor(self.std, dtype=torch.float32).view(c, 1, 1)
        self._scale = 1.0 / (255.0 * std_t)
        self._shift = torch.tensor(self.mean, dtype=torch.float32).view(c, 1, 1) / std_t

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._item(self._images[index], index)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A batch's samples, as ``[self[i] for i in indices]`` gives them (the same augmentation
        draws in the same order), read with one gather: from a memory-mapped shard
        (``[memory] shard_on_disk``) the pages are given back after the read, so an epoch
        never makes the whole shard resident. The DataLoader calls this for each batch."""
        rows = torch.from_numpy(gather_rows(self.source.images, np.asarray(indices, dtype=np.int64)))  # (B, C, H, W) uint8
        return [self._item(rows[j], index) for j, index in enumerate(indices)]

    def _item(self, image: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.augment:
            image = self._random_crop_flip(image)
        x = image.to(torch.float32) * self._scale - self._shift  # (C, H, W) float32
        return x, self._labels[index], self._sample_ids[index]

    def _random_crop_flip(self, image: torch.Tensor) -> torch.Tensor:
        _, h, w = image.shape
        p = self.crop_padding
        if p:
            padded = F.pad(image, (p, p, p, p))  # (C, H + 2p, W + 2p), zeros = black
            top, left = torch.randint(0, 2 * p + 1, (2,), generator=self.generator).tolist()
            image = padded[:, top : top + h, left : left + w]
        if torch.rand((), generator=self.generator).item() < 0.5:
            image = image.flip(-1)
        return image

    def reseed(self, seed: int) -> None:
        """Give augmentation its own generator seeded with ``seed``."""
        self.generator = torch.Generator().manual_seed(seed)


def _default_stats(ds: ArrayDataset) -> tuple[tuple[float, ...], tuple[float, ...]]:
    # Only the names dataset_stats knows; an image folder has no published
    # statistics, so they come from the data at hand.
    if ds.name in ("fashion-mnist", "cifar10", "cifar100", "cinic10", "synthetic"):
        return dataset_stats(ds.name, ds.in_channels)
    return compute_stats(ds)


def _seed_worker(worker_id: int) -> None:
    """DataLoader worker init: a per-worker augmentation generator.

    Every worker receives a copy of the dataset, generator state included, so
    without this all workers would draw the same crops. ``info.seed`` is the
    loader's base seed plus the worker id, hence deterministic per loader seed.
    """
    info = torch.utils.data.get_worker_info()
    if info is not None and isinstance(info.dataset, TorchArrayDataset) and info.dataset.generator is not None:
        info.dataset.reseed(info.seed % (2**63))


def make_loader(
    ds: ArrayDataset,
    batch_size: int,
    shuffle: bool = False,
    augment: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    drop_last: bool = False,
) -> DataLoader[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A DataLoader over ``ds`` yielding ``(images, labels, sample_ids)`` batches.

    Batches are ``(B, C, H, W)`` float32, ``(B,)`` int64, ``(B,)`` int64.
    ``seed`` fixes both the shuffle order and the augmentation, so the same
    arguments give the same batches (with ``num_workers=0``, or any fixed
    ``num_workers``).
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    augment_gen = torch.Generator().manual_seed((seed ^ _AUGMENT_SEED_SALT) % (2**63)) if augment else None
    tds = TorchArrayDataset(ds, mean=mean, std=std, augment=augment, generator=augment_gen)
    return DataLoader(
        tds,
        batch_size=batch_size,
        # RandomSampler rejects an empty dataset; an agent may hold no samples.
        shuffle=shuffle and len(tds) > 0,
        generator=torch.Generator().manual_seed(seed % (2**63)),
        num_workers=num_workers,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
        drop_last=drop_last,
    )
