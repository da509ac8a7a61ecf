"""Bounded staging of uploaded feature arrays on the server (memory, then memory-mapped files).

Methods that train on what agents upload (feature maps of a split model) stage the
uploads until the round's training. :class:`ArrayStaging` keeps them in memory
up to ``memory_bytes`` and writes the rest to memory-mapped ``.npy`` files in
``spill_dir`` (numpy's own format, opened with ``allow_pickle=False``), which
the training loop reads back row by row through the page cache. Files are
deleted when the staged array is released; unlinking a mapped file is safe on
POSIX (the mapping keeps the pages until it is dropped).

With a CUDA ``device``, every array is also copied to the device as it is staged
(``StagedArray.device_copy``) while the device holds less than ``device_bytes`` of
them (by default half the device's free memory when the first array arrives): the
round's training then starts from rows already on the GPU. Beyond that bound the
array stays on the host only, and the training loop copies its batches.

Maps held across rounds so that an agent sends them once (a method's ``reuse_maps``).

:class:`HeldMaps` is one agent's accepted maps of one split, kept in the staging
after the round that used them; a later upload batch
that reuses them is staged as rows of them (:class:`~cloud_server.feature_store.StagedBatch`
with ``held``), taken as they are when a round reuses all of them in order
(:func:`reused_whole`) or copied into the round's gathered rows (:func:`materialise`).
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from shared_protocol.errors import MapsNotHeldError, SizeLimitError
from shared_protocol.messages import RoundEnd

log = logging.getLogger("cloud_server.feature_store")


@dataclass
class StagedArray:
    """One staged array: in memory (``path`` None) or a read-only memory map over ``path``;
    ``device_copy``: the same rows on the training device, when they were staged there too."""

    array: np.ndarray
    path: Path | None
    released: bool = False
    device_copy: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def spilled(self) -> bool:
        return self.path is not None


class ArrayStaging:
    """Staged arrays of one dtype, at most ``memory_bytes`` of them in memory at a time.

    ``spill_dir`` None means a private temporary directory, made on the first spill
    and removed once it holds no files.
    """

    def __init__(self, memory_bytes: int, spill_dir: str | Path | None = None, dtype: Any = np.float16,
                 prefix: str = "staged", device: str | torch.device | None = None, device_bytes: int | None = None,
                 copy_to_device: bool | None = None) -> None:
        """``device``: the training device; arrays are also copied there as they are staged when
        ``copy_to_device`` (None: when the device is a CUDA device), at most ``device_bytes`` of
        them (None: :func:`cloud_server.row_bank.staging_budget_bytes` when the first arrives)."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
        if device_bytes is not None and device_bytes < 0:
            raise ValueError(f"device_bytes must be >= 0, got {device_bytes}")
        self.memory_bytes = memory_bytes
        self.dtype = np.dtype(dtype)
        self._spill_dir = Path(spill_dir) if spill_dir else None
        self._own_dir: Path | None = None
        self._prefix = prefix
        self._names = itertools.count()
        self.in_memory_bytes = 0
        self.spilled_bytes = 0
        self.peak_in_memory_bytes = 0
        self.files_written = 0
        self._files: set[Path] = set()
        self.device = torch.device(device) if device is not None else None
        self.copy_to_device = (self.device is not None and self.device.type == "cuda") if copy_to_device is None else copy_to_device
        if self.copy_to_device and self.device is None:
            raise ValueError("copy_to_device needs a device")
        self.device_bytes = device_bytes
        self._torch_dtype = torch.from_numpy(np.empty(0, self.dtype)).dtype
        self.on_device_bytes = 0
        self.device_refusals = 0  # arrays left on the host because the device bound was reached

    # -- staging ------------------------------------------------------------ #

    def stage(self, array: np.ndarray) -> StagedArray:
        """A copy of ``array`` in this staging's dtype: in memory while the bound allows, else on disk."""
        nbytes = int(np.prod(array.shape, dtype=np.int64)) * self.dtype.itemsize
        if self.in_memory_bytes + nbytes <= self.memory_bytes:
            staged = StagedArray(np.ascontiguousarray(array, dtype=self.dtype), None)
            self._count_in(staged)
        else:
            target = self.empty(array.shape, force_disk=True)
            target.array[...] = array  # casts while writing: no full-size temporary in memory
            staged = self.seal(target)
        if self.copy_to_device:
            self.attach_device_copy(staged, lambda: torch.from_numpy(np.ascontiguousarray(array, dtype=self.dtype)))
        return staged

    def attach_device_copy(self, staged: StagedArray, rows: Any) -> bool:
        """Give ``staged`` a copy on the device (``rows``: a tensor, or a function returning one,
        with the staged array's rows) if the device bound allows; True if it did."""
        nbytes = staged.nbytes
        if self.device_bytes is None:
            from .row_bank import staging_budget_bytes

            budget = staging_budget_bytes(self.device)  # type: ignore[arg-type]
            self.device_bytes = budget if budget is not None else 1 << 62
        if self.on_device_bytes + nbytes > self.device_bytes:
            self.device_refusals += 1
            if self.device_refusals == 1:
                log.info("staging beyond %d bytes on %s stays on the host", self.device_bytes, self.device)
            return False
        tensor = rows() if callable(rows) else rows
        staged.device_copy = tensor.to(self.device, dtype=self._torch_dtype)
        self.on_device_bytes += nbytes
        return True

    def empty(self, shape: tuple[int, ...], force_disk: bool = False) -> StagedArray:
        """An uninitialised writable array to fill and then :meth:`seal`; on disk when the bound says so."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        if not force_disk and self.in_memory_bytes + nbytes <= self.memory_bytes:
            staged = StagedArray(np.empty(shape, self.dtype), None)
            self._count_in(staged)
            return staged
        path = self._directory() / f"{self._prefix}-{os.getpid()}-{next(self._names)}.npy"
        array = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=tuple(shape))
        self._files.add(path)
        self.files_written += 1
        self.spilled_bytes += nbytes
        return StagedArray(array, path)

    def seal(self, staged: StagedArray) -> StagedArray:
        """Finish writing a spilled array: flush it and map it back read-only."""
        if staged.path is None:
            return staged
        written = staged.array
        if isinstance(written, np.memmap):
            written.flush()
        del written
        staged.array = np.load(staged.path, mmap_mode="r", allow_pickle=False)
        return staged

    def release(self, staged: StagedArray) -> None:
        """Forget a staged array: free its share of the bound, delete its file (idempotent)."""
        if staged.released:
            return
        staged.released = True
        if staged.device_copy is not None:
            staged.device_copy = None
            self.on_device_bytes -= staged.nbytes
        if staged.path is None:
            self.in_memory_bytes -= staged.nbytes
        else:
            self.spilled_bytes -= staged.nbytes
            self._files.discard(staged.path)
            staged.path.unlink(missing_ok=True)
            self._cleanup_dir()

    @property
    def files(self) -> list[Path]:
        """Spill files currently on disk."""
        return sorted(self._files)

    def release_all(self, staged: list[StagedArray]) -> None:
        for item in staged:
            self.release(item)

    # -- internals ---------------------------------------------------------- #

    def _count_in(self, staged: StagedArray) -> None:
        self.in_memory_bytes += staged.nbytes
        self.peak_in_memory_bytes = max(self.peak_in_memory_bytes, self.in_memory_bytes)

    def _directory(self) -> Path:
        if self._spill_dir is not None:
            self._spill_dir.mkdir(parents=True, exist_ok=True)
            return self._spill_dir
        if self._own_dir is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix=f"edgesplit-{self._prefix}-"))
            log.info("staging beyond %d bytes in memory spills to %s", self.memory_bytes, self._own_dir)
        return self._own_dir

    def _cleanup_dir(self) -> None:
        if self._own_dir is not None and not self._files:
            try:
                self._own_dir.rmdir()
            except OSError:  # someone put a file there: leave it be
                return
            self._own_dir = None


class RowSource:
    """Rows of a staged (N, ...) array as float16 torch tensors, indexable like a tensor
    by a LongTensor of rows or a slice; spilled arrays are read from their memory map."""

    def __init__(self, staged: StagedArray) -> None:
        self.staged = staged
        self._tensor = torch.from_numpy(staged.array) if not staged.spilled else None

    def __len__(self) -> int:
        return int(self.staged.array.shape[0])

    def __getitem__(self, index: torch.Tensor | slice) -> torch.Tensor:
        if self._tensor is not None:
            return self._tensor[index]
        rows = index.numpy() if isinstance(index, torch.Tensor) else index
        out = self.staged.array[rows]  # a gather copies; a slice is a view of the read-only map
        return torch.from_numpy(out if out.flags.writeable else np.array(out))


# --------------------------------------------------------------------------- #
# one agent's uploads of a round (numbered batches of feature maps)
# --------------------------------------------------------------------------- #


class FeatureBatch(Protocol):
    """What :meth:`StagedUploads.add` reads of one uploaded batch (a method's message type)."""

    split: str  # "train" | "test"
    seq: int  # the batch's number in the agent's round: a resent batch replaces its first copy
    features: np.ndarray  # (n, C, H, W)
    logits: np.ndarray  # (n, K)
    labels: np.ndarray  # (n,)
    sample_ids: np.ndarray  # (n,)


@dataclass
class StagedBatch:
    """One staged upload batch: its feature maps float16 in memory or in a mapped file, or
    (``held``) the rows of maps held from an earlier upload that the batch reuses."""

    features: StagedArray | None  # (n, 16, H, W) float16; None for a reused batch
    logits: np.ndarray  # (n, K)
    labels: np.ndarray  # (n,)
    sample_ids: np.ndarray  # (n,)
    held: HeldMaps | None = None  # a reused batch's maps ...
    rows: np.ndarray | None = None  # ... and their rows there (n,)


@dataclass
class StagedUploads:
    """One agent's uploads of its current round."""

    instance: str
    round: int
    train: dict[int, StagedBatch] = field(default_factory=dict)  # by seq: a resent batch replaces, never duplicates
    test: dict[int, StagedBatch] = field(default_factory=dict)
    samples: int = 0
    digests: dict[str, set[str]] = field(default_factory=dict)  # split -> the maps digests its batches gave

    def batches(self) -> list[StagedBatch]:
        return [*self.train.values(), *self.test.values()]

    def staged_arrays(self) -> list[StagedArray]:
        """The arrays these uploads staged themselves (a reused batch's maps are the holder's)."""
        return [b.features for b in self.batches() if b.features is not None]

    def digest(self, split: str) -> str:
        """The one maps digest every batch of ``split`` gave, or "" (none, or several)."""
        digests = self.digests.get(split, set())
        return next(iter(digests)) if len(digests) == 1 else ""

    def add(self, msg: FeatureBatch, staging: ArrayStaging, max_samples: int, agent: str,
            reused: tuple[HeldMaps, np.ndarray] | None = None) -> None:
        """Stage one uploaded batch of this round (a resent batch replaces its first copy),
        refusing more than ``max_samples`` samples in all. ``reused``: the batch carries no maps
        (nor labels); they are these rows of the held maps."""
        batches = self.train if msg.split == "train" else self.test
        replaced = batches.get(msg.seq)
        samples = self.samples - (len(replaced.labels) if replaced is not None else 0) + len(msg.sample_ids)
        if samples > max_samples:
            raise SizeLimitError(f"agent {agent} uploaded more than {max_samples} samples this round")
        if replaced is not None and replaced.features is not None:
            staging.release(replaced.features)
        if reused is not None:
            held, rows = reused
            batches[msg.seq] = StagedBatch(None, msg.logits, held.labels[rows], msg.sample_ids, held=held, rows=rows)
        else:
            # float16 now, not at training time: the bound is on what is actually held.
            batches[msg.seq] = StagedBatch(staging.stage(msg.features), msg.logits, msg.labels, msg.sample_ids)
        self.digests.setdefault(msg.split, set()).add(getattr(msg, "maps_digest", ""))
        self.samples = samples

    def why_unusable(self, end: RoundEnd) -> str | None:
        """Why these uploads cannot be trained on given the agent's ``RoundEnd``, or None if they can."""
        if not self.train:
            return "no feature uploads"
        if self.instance != end.instance or self.round != end.round:
            return "uploads came from another agent process or round"
        train_info = end.uploads.get("train", {})
        if train_info.get("batches") != len(self.train) or train_info.get("samples") != sum(len(b.labels) for b in self.train.values()):
            return f"incomplete upload: {len(self.train)} batches staged, agent reported {train_info}"
        return None


# (features, edge logits, labels, sample ids) of one agent, rows aligned.
AgentRows = tuple[RowSource, torch.Tensor, torch.Tensor, np.ndarray]


def gather_batches(batches: list[StagedBatch], staging: ArrayStaging) -> AgentRows:
    """One agent's batches as aligned rows, de-duplicated by sample id (last wins).

    The features are gathered into one staged array, in memory if every batch was
    and the bound allows, else in one mapped file; the batches' own staging is released.
    When every batch was also staged on the training device, the gathered rows are too.
    """
    ids = np.concatenate([b.sample_ids for b in batches])
    _, last = np.unique(ids[::-1], return_index=True)
    keep = np.sort(len(ids) - 1 - last)
    shape = (len(keep), *batches[0].features.array.shape[1:])
    any_spilled = any(b.features.spilled for b in batches)
    device_rows = None  # the same gather on the device, when every batch was staged there as it arrived
    if all(b.features.device_copy is not None for b in batches):
        copies = torch.cat([b.features.device_copy for b in batches])  # (n, 16, H, W)
        device_rows = copies if len(keep) == len(ids) else copies[torch.from_numpy(keep).to(copies.device)]
    for b in batches:
        if not b.features.spilled:
            staging.release(b.features)  # their bytes move into the gathered array below
    gathered = staging.empty(shape, force_disk=any_spilled)
    start = row = 0
    for b in batches:
        n = len(b.sample_ids)
        rows = keep[(keep >= start) & (keep < start + n)] - start  # this batch's surviving rows
        target = gathered.array[row : row + len(rows)]
        if len(rows) == n:  # no duplicates (the usual case): one straight copy
            target[...] = b.features.array
        else:
            np.take(b.features.array, rows, axis=0, out=target)
        row += len(rows)
        start += n
        staging.release(b.features)
    logits = torch.from_numpy(np.concatenate([b.logits for b in batches])[keep])
    labels = torch.from_numpy(np.concatenate([b.labels for b in batches])[keep])
    sealed = staging.seal(gathered)
    if device_rows is not None:
        staging.attach_device_copy(sealed, device_rows)  # the batches' device bytes were released above
    return RowSource(sealed), logits, labels, ids[keep]


# -- maps held across rounds ------------------------------------------------------------ #


@dataclass
class HeldMaps:
    """One agent's maps of one split, kept across rounds so that the agent sends them once:
    the rows its last accepted upload gave (de-duplicated, in upload order), their labels and
    sample ids, and the digest the agent gave them (its extractor and codec). The staged array
    belongs to the holder (released when the maps are replaced or dropped)."""

    digest: str
    rows: RowSource  # (n, 16, H, W) float16
    labels: np.ndarray  # (n,) int64
    sample_ids: np.ndarray  # (n,) int64
    _sorted_ids: np.ndarray = field(init=False, repr=False)
    _order: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._order = np.argsort(self.sample_ids, kind="stable")
        self._sorted_ids = self.sample_ids[self._order]

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        return self.rows.staged.nbytes

    def rows_of(self, digest: str, sample_ids: np.ndarray) -> np.ndarray:
        """The rows holding ``sample_ids``' maps, in their order; :class:`MapsNotHeldError` when the
        maps were made with another ``digest`` or some of the ids were never received."""
        if digest != self.digest:
            raise MapsNotHeldError(f"maps digest {digest[:12]}... is not the held maps' {self.digest[:12]}... "
                                   "(another extractor or codec)")
        at = np.searchsorted(self._sorted_ids, sample_ids)
        at = np.minimum(at, len(self._sorted_ids) - 1)
        known = self._sorted_ids[at] == sample_ids if len(self._sorted_ids) else np.zeros(len(sample_ids), bool)
        if not known.all():
            raise MapsNotHeldError(f"{int((~known).sum())} of {len(sample_ids)} sample ids (e.g. "
                                   f"{int(sample_ids[~known][0])}) are not among the {len(self)} held")
        return self._order[at]



def reused_whole(batches: list[StagedBatch]) -> AgentRows | None:
    """When every batch reuses the same held maps and together they name exactly the held
    rows in the held order (an agent re-sending its shard as before), those maps as they are,
    with the batches' logits: no copy. Else None."""
    held = batches[0].held if batches else None
    if held is None or any(b.held is not held for b in batches):
        return None
    ids = np.concatenate([b.sample_ids for b in batches])
    if len(ids) != len(held) or not np.array_equal(ids, held.sample_ids):
        return None
    logits = torch.from_numpy(np.concatenate([b.logits for b in batches]))
    return held.rows, logits, torch.from_numpy(held.labels), held.sample_ids


def materialise(batch: StagedBatch, staging: ArrayStaging) -> StagedBatch:
    """A reused batch as if its maps had been sent: its rows of the held maps staged anew
    (a full batch is returned as it is)."""
    if batch.held is None or batch.rows is None:
        return batch
    return StagedBatch(staging.stage(batch.held.rows.staged.array[batch.rows]), batch.logits, batch.labels, batch.sample_ids)
