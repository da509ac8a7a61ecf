"""What the server's device did in a round: its name, training seconds, peak memory, utilisation.

A :class:`DeviceMeter` belongs to a method's :class:`~cloud_server.methods.base.ServerContext`
(and to the centralized trainer). A method wraps its server-side training in
:meth:`DeviceMeter.training`; when the coordinator closes the round it calls
:meth:`DeviceMeter.take`, which returns the round's figures for the report (the round
record's ``"server"``) and starts the next round's count.

* ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` since the previous round
  closed (staging, training and evaluation); None on a CPU.
* ``gpu_utilization_percent`` / ``gpu_utilization_max_percent``: the driver's utilisation
  (``torch.cuda.utilization``, through NVML) sampled every ``sample_every_s`` while the
  server trains; None, with ``gpu_utilization_unavailable`` saying why, when the device
  is a CPU, NVML (the ``pynvml`` module, package ``nvidia-ml-py``) is not importable, or the
  driver refuses. Sampling reads NVML from a thread: it never synchronises the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from shared_protocol.hostinfo import cpu_model
from .records import ServerDeviceRecord

log = logging.getLogger("cloud_server.device_meter")


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` for a CUDA device, the CPU's model name for a CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_model()
    return str(device)


def utilization_reader(device: torch.device | str) -> tuple[Any, str | None]:
    """(a function returning the device's utilisation in percent, None) or (None, why not)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"the server trains on the {device.type}, not a GPU"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        import pynvml  # noqa: F401  # what torch.cuda.utilization reads the driver with
    except ImportError:
        return None, "NVML is not importable (pip install nvidia-ml-py for GPU utilisation)"
    errors: tuple[type[BaseException], ...] = (RuntimeError, OSError, ValueError)
    nvml_error = getattr(pynvml, "NVMLError", None)
    if isinstance(nvml_error, type) and issubclass(nvml_error, BaseException):
        errors = (*errors, nvml_error)

    def read() -> int:
        try:
            return int(torch.cuda.utilization(device))
        except errors as exc:
            raise RuntimeError(f"the driver did not report utilisation: {type(exc).__name__}: {exc}") from exc

    try:
        read()
    except RuntimeError as exc:
        return None, str(exc)
    return read, None


class DeviceMeter:
    def __init__(self, device: torch.device | str, sample_every_s: float = 0.5) -> None:
        if sample_every_s <= 0:
            raise ValueError(f"sample_every_s must be > 0, got {sample_every_s}")
        self.device = torch.device(device)
        self.sample_every_s = sample_every_s
        self._name: str | None = None
        self._reader: Any = None
        self._unavailable: str | None = None
        self._reader_checked = False
        self._lock = threading.Lock()
        self._active = 0
        self._samples: list[int] = []
        self._train_s = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def name(self) -> str:
        if self._name is None:
            self._name = device_name(self.device)
        return self._name

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Count the enclosed time as server training and sample the GPU's utilisation meanwhile."""
        self._ensure_sampler()
        with self._lock:
            self._active += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._active -= 1
                self._train_s += elapsed

    def take(self) -> ServerDeviceRecord:
        """The figures since the previous :meth:`take` (the round record's ``server``); resets them."""
        self._stop_sampler()
        with self._lock:
            samples, train_s = self._samples, self._train_s
            self._samples, self._train_s = [], 0.0
        peak = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        unavailable = self._unavailable if self._reader_checked else utilization_reader(self.device)[1]
        if unavailable is None and not samples:
            unavailable = "no sample: the server did not train long enough this round"
        return ServerDeviceRecord(
            device=str(self.device),
            device_name=self.name,
            train_s=train_s,
            peak_memory_bytes=peak,
            gpu_utilization_percent=sum(samples) / len(samples) if samples else None,
            gpu_utilization_max_percent=max(samples) if samples else None,
            gpu_utilization_samples=len(samples),
            gpu_utilization_unavailable=None if samples else unavailable,
        )

    # -- sampling ----------------------------------------------------------- #

    def _ensure_sampler(self) -> None:
        if not self._reader_checked:
            self._reader, self._unavailable = utilization_reader(self.device)
            self._reader_checked = True
            if self._unavailable:
                log.info("GPU utilisation will not be recorded: %s", self._unavailable)
        if self._reader is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="device-meter", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_every_s):
            with self._lock:
                active = self._active > 0
            if not active:
                continue
            try:
                value = self._reader()
            except RuntimeError as exc:
                log.warning("GPU utilisation stopped reading: %s", exc)
                return
            with self._lock:
                self._samples.append(value)

    def _stop_sampler(self) -> None:
        thread = self._thread
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)
            self._thread = None
