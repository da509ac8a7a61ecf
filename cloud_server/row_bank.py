"""A method's training rows staged on the training device, so that the server's step
(:mod:`cloud_server.server_step`) gathers its batches by index there.

:class:`RowBank` holds a method's training rows (feature maps, images, targets) on the
training device when they fit in a byte budget (by default a fraction of
``torch.cuda.mem_get_info``'s free memory), else leaves them on the host and moves them per
batch. On a GPU the step is launch-bound at the batch sizes these methods use; a batch
gathered on the device spares it a host copy and a synchronisation per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fldata.torch_data import make_loader

__all__ = ["DEVICE_STAGING_FRACTION", "RowBank", "banks_for_staged_rows", "device_free_bytes", "normalised_images",
           "staging_budget_bytes"]

#: Share of the device's free memory (``torch.cuda.mem_get_info``) that staged rows may take
#: when no explicit budget is given; the rest is left to activations, gradients and the graph pools.
DEVICE_STAGING_FRACTION = 0.5


def device_free_bytes(device: torch.device | str) -> int | None:
    """Free memory of a CUDA device (``torch.cuda.mem_get_info``); None for other devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def staging_budget_bytes(device: torch.device | str, budget_bytes: int | None = None) -> int | None:
    """How many bytes of rows may be staged on ``device``: the explicit budget, capped on a CUDA
    device by :data:`DEVICE_STAGING_FRACTION` of its free memory; None means no limit (a CPU
    device, where "on the device" is host memory that is already held)."""
    free = device_free_bytes(device)
    if free is None:
        return budget_bytes
    cap = int(free * DEVICE_STAGING_FRACTION)
    return cap if budget_bytes is None else min(budget_bytes, cap)


class RowBank:
    """Rows of an ``(N, ...)`` array for training: on ``device`` when they fit, else on the host.

    ``rows`` is anything indexable by a CPU LongTensor of rows that returns a tensor
    (a tensor, or :class:`cloud_server.feature_store.RowSource` over a staged array, which
    may be a memory-mapped file). ``device_rows``: the rows already on the device (staged
    there as they arrived), used as they are. Otherwise, when the rows are in memory
    (``host_array`` is given, or ``rows`` is a tensor) and their bytes fit in
    ``budget_bytes`` (None: no limit), all rows are copied to the device once, in ``dtype``
    (default: their own), and :meth:`gather` indexes them there. Otherwise :meth:`gather`
    gathers on the host and copies the batch.

    :attr:`placement` says which: ``"device"`` or ``"host"`` (with :attr:`why_host`).
    """

    def __init__(self, rows: Any, device: torch.device | str, *, budget_bytes: int | None = None,
                 host_array: np.ndarray | None = None, device_rows: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device)
        self._rows = rows
        self.dtype = dtype
        self._on_device: torch.Tensor | None = None
        self.why_host = ""
        self.nbytes = 0
        if device_rows is not None:  # staged on the device already (as the uploads arrived)
            self._on_device = device_rows
            return
        source = host_array if host_array is not None else rows if isinstance(rows, torch.Tensor) else None
        if source is None:
            self.why_host = "rows are not held in memory (spilled to disk)"
            return
        itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else source.dtype.itemsize
        nbytes = int(np.prod(source.shape, dtype=np.int64)) * itemsize
        self.nbytes = nbytes
        if budget_bytes is not None and nbytes > budget_bytes:
            self.why_host = f"{nbytes} bytes do not fit the device staging budget of {budget_bytes} bytes"
            return
        tensor = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
        if self.device.type == "cuda" and not tensor.is_cuda:
            try:
                self._on_device = tensor.to(self.device, dtype=dtype or tensor.dtype, non_blocking=False)
            except torch.cuda.OutOfMemoryError as exc:
                self.why_host = f"the device ran out of memory staging {nbytes} bytes ({exc})"
                return
        else:
            self._on_device = tensor.to(self.device, dtype=dtype or tensor.dtype)

    @property
    def placement(self) -> str:
        return "device" if self._on_device is not None else "host"

    def __len__(self) -> int:
        return len(self._on_device) if self._on_device is not None else len(self._rows)

    def gather(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``index`` (a LongTensor on the device or the host) on the device, in ``dtype``."""
        if self._on_device is not None:
            out = self._on_device[index.to(self.device, non_blocking=True)]
        else:
            host = self._rows[index.cpu()]
            if self.device.type == "cuda":
                host = host.pin_memory()
            out = host.to(self.device, non_blocking=True)
        target = dtype or self.dtype
        return out if target is None or out.dtype == target else out.to(target)

    def release(self) -> None:
        self._on_device = None
        self._rows = None


def normalised_images(ds: Any) -> torch.Tensor:
    """A whole ``fldata`` dataset normalised as the agents' loaders do, as one ``(N, C, H, W)``
    tensor on the host: held once instead of re-normalised every pass (a server set is read
    many times a round; 1000 Fashion-MNIST images take 4 MB)."""
    return torch.cat([images for images, _labels, _ids in make_loader(ds, 1024)])


def banks_for_staged_rows(sources: list[Any], device: torch.device | str) -> list[RowBank]:
    """A :class:`RowBank` per staged row source (``cloud_server.feature_store.RowSource``), in
    order: rows staged on the device as they arrived are used there; the others are copied to
    the device while :func:`staging_budget_bytes` lasts, else gathered on the host per batch."""
    budget = staging_budget_bytes(device)
    banks = []
    for source in sources:
        staged = source.staged
        bank = RowBank(source, device, budget_bytes=budget, device_rows=staged.device_copy,
                       host_array=None if staged.spilled else staged.array)
        if budget is not None and bank.placement == "device" and staged.device_copy is None:
            budget -= bank.nbytes
        banks.append(bank)
    return banks

