"""What machine this is: CPU model, architecture, cores, memory.

Agents announce it in their Hello, the server and the centralized trainer write
it into run reports, benchmarks into their results; one reading for all of
them, so that a Pi is named the same way on every page. Standard library only
(no torch), so a torch-free agent and the server both use it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["HostInfo", "cpu_model", "host_info", "total_memory_bytes"]

CPUINFO = Path("/proc/cpuinfo")

# /proc/cpuinfo keys naming the CPU, best first: x86 and 32-bit ARM kernels write
# "model name"; 64-bit Raspberry Pi OS writes no "model name" but "Model" (the board,
# "Raspberry Pi 4 Model B Rev 1.4") and "Hardware" (the SoC, "BCM2835").
_CPUINFO_KEYS = ("model name", "Model", "Hardware")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name, e.g. ``"Intel(R) Xeon(R) CPU @ 2.20GHz"``; where
    ``/proc/cpuinfo`` names none (macOS, Windows), what :mod:`platform` knows."""
    found: dict[str, str] = {}
    try:
        with cpuinfo.open() as f:
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if sep and key in _CPUINFO_KEYS and value.strip():
                    found.setdefault(key, value.strip())
    except OSError:
        pass  # not Linux, or no procfs: fall back to platform below
    for key in _CPUINFO_KEYS:
        if key in found:
            return found[key]
    return platform.processor() or platform.machine() or "unknown"


def total_memory_bytes() -> int:
    """Physical memory of the machine; 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class HostInfo:
    cpu_model: str
    arch: str  # platform.machine(): x86_64, aarch64, armv7l, arm64
    cores: int  # logical CPUs
    memory_bytes: int  # physical memory; 0: unknown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def host_info() -> HostInfo:
    """This machine's :class:`HostInfo`."""
    return HostInfo(cpu_model=cpu_model(), arch=platform.machine(), cores=os.cpu_count() or 1, memory_bytes=total_memory_bytes())
