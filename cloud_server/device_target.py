"""The device a user plans to deploy on, as a run's per-device figures are read against it:
the speed of its link and its memory (``[server] link_mbit`` and ``device_memory``;
``edgesplit local --link-mbit / --device-memory``; ``cloud-server report --link-mbit /
--device-memory`` reads a finished run against another device).

A link time is wire bytes x 8 / the link's rate, each way at the one stated rate. A memory
of "" means each agent's own memory as its hello reported it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_LINK_MBIT", "MEMORY_SHARE", "DeviceTarget", "parse_memory_size", "add_target_flags"]

#: A typical uplink of a device on a home line or a mobile network; state yours with --link-mbit.
DEFAULT_LINK_MBIT = 10.0
#: An agent peaking above this share of the device's memory is warned about: the system, the
#: broker connection and whatever else the device runs need the rest.
MEMORY_SHARE = 0.8

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str, what: str = "device_memory") -> int:
    """``"2GiB"`` -> 2147483648; ``"512MB"`` -> 512000000; a bare number is bytes."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{what} must be a size such as 2GiB, 512MiB, 4GB or a number of bytes "
                         f"(units: {', '.join(u for u in _UNITS if u)}), got {text!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{what} must be more than 0 bytes, got {text!r}")
    return size


@dataclass(frozen=True)
class DeviceTarget:
    link_mbit: float = DEFAULT_LINK_MBIT
    device_memory: str = ""  # "": each agent's own memory (its hello's memory_bytes)

    def __post_init__(self) -> None:
        if isinstance(self.link_mbit, bool) or not isinstance(self.link_mbit, (int, float)) \
                or not math.isfinite(self.link_mbit) or self.link_mbit <= 0:
            raise ValueError(f"link_mbit must be a link speed in Mbit/s above 0 (e.g. 1 for a slow uplink), "
                             f"got {self.link_mbit!r}")
        if not isinstance(self.device_memory, str):
            raise ValueError(f"device_memory must be a size as a string (e.g. \"2GiB\") or \"\" for each agent's own "
                             f"memory, got {self.device_memory!r}")
        if self.device_memory:
            parse_memory_size(self.device_memory)

    @property
    def memory_bytes(self) -> int | None:
        """The stated device memory (None: each agent's own)."""
        return parse_memory_size(self.device_memory) if self.device_memory else None

    def link_s(self, wire_bytes: float) -> float:
        """Seconds ``wire_bytes`` take on the link."""
        return wire_bytes * 8 / (self.link_mbit * 1e6)

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> "DeviceTarget":
        """The target a run's resolved config (report.json's ``config``) names; reports
        written before these keys existed get the defaults."""
        return cls(link_mbit=config.get("link_mbit", DEFAULT_LINK_MBIT), device_memory=config.get("device_memory", ""))


def _link_mbit(text: str) -> float:
    try:
        return DeviceTarget(link_mbit=float(text)).link_mbit
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory(text: str) -> str:
    try:
        parse_memory_size(text, "--device-memory")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_target_flags(parser: argparse.ArgumentParser, for_report: bool = False) -> None:
    """``--link-mbit`` and ``--device-memory`` (left out: None, the run's config decides)."""
    where = "the run's own" if for_report else f"{DEFAULT_LINK_MBIT:g}"
    parser.add_argument("--link-mbit", type=_link_mbit, default=None, metavar="MBIT_S",
                        help=f"the devices' link speed in Mbit/s: summary.md's per-device table gives the seconds each "
                        f"agent's bytes take on it, up and down (default: {where}; [server] link_mbit)")
    parser.add_argument("--device-memory", type=_memory, default=None, metavar="SIZE",
                        help=f"the devices' memory (e.g. 2GiB): an agent peaking above {100 * MEMORY_SHARE:.0f}%% of it is "
                        "warned about, with the setting that lowers it (default: "
                        + ("the run's own" if for_report else "each agent's own memory")
                        + "; [server] device_memory)")

