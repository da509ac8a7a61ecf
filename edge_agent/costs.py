"""What a round costs on this device: time by phase, FLOPs, memory, bytes.

Time is split into compute (training and feature extraction), encode (frame
encoding and compression), network (publishing until the broker acknowledged)
and idle (waiting for the server between rounds).
"""

from __future__ import annotations

import os
import platform
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from .deadline import RoundDeadline

PHASES = ("compute", "encode", "network", "idle")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)


@dataclass
class RoundMeter:
    """Accumulates one round's costs."""

    seconds: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    train_flops: int = 0
    samples_trained: int = 0
    raw_bytes: int = 0  # tensor bytes before encoding
    encoded_bytes: int = 0  # after the codec
    deadline: RoundDeadline = field(default_factory=RoundDeadline)  # unbounded unless the round sets one

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; known: {PHASES}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    @property
    def codec_ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0
