"""The schema of the per-device figures in a report read back from disk: each round's
``device_bytes`` (by agent, training's and evaluation's bytes) and the ``per_device``
section, whose link seconds must follow from its bytes and its stated link speed, and whose
memory shares from its peaks and memories. Called by :func:`.schema.validate_report`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .formatting import describe
from .per_device import AGENT_FIELDS

if TYPE_CHECKING:
    from .schema import _Checker

__all__ = ["check_device_bytes", "check_per_device"]

_TOP = {"link_mbit": ("number", False, 0.0), "device_memory_bytes": ("int", True, 1), "memory_share_warned": ("number", False, 0.0),
        "agents": ("dict", False, None), "warnings": ("list", False, None)}


def _specs(fields: Mapping[str, tuple[str, bool]]) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: (kind, nullable, 0, None) if kind in ("int", "number") else (kind, nullable, None, None)
            for k, (kind, nullable) in fields.items()}, {}


_AGENT_SPECS = _specs(AGENT_FIELDS)


def check_device_bytes(ck: "_Checker", path: str, rnd: Mapping[str, Any], byte_specs: Any) -> None:
    """A round's ``device_bytes`` (optional): {agent: {"train": bytes, "evaluation": bytes}}."""
    if "device_bytes" not in rnd:
        return
    device_bytes = rnd["device_bytes"]
    if not isinstance(device_bytes, dict):
        ck.add(f"{path}.device_bytes: expected a dict of agents, got {describe(device_bytes)}")
        return
    for agent, held in device_bytes.items():
        where = f"{path}.device_bytes[{agent}]"
        good = ck.fields(held, where, ({"train": ("dict", False, None, None), "evaluation": ("dict", False, None, None)}, {}))
        for kind, counts in good.items():
            ck.fields(counts, f"{where}.{kind}", byte_specs)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def check_per_device(ck: "_Checker", section: Any) -> None:
    """The ``per_device`` section (optional)."""
    if section is None:
        return
    top = ck.fields(section, "per_device", ({k: (kind, nullable, low, None) for k, (kind, nullable, low) in _TOP.items()}, {}))
    link = top.get("link_mbit")
    if link is not None and link <= 0:
        ck.add(f"per_device.link_mbit: must be above 0 Mbit/s, got {link!r}")
        link = None
    for agent, entry in (top.get("agents") or {}).items():
        where = f"per_device.agents[{agent}]"
        good = ck.fields(entry, where, _AGENT_SPECS)
        if len(good) != len(AGENT_FIELDS):
            continue  # the missing or mistyped fields are already recorded
        for total, parts in (("up_wire", ("train_up_wire", "eval_up_wire")), ("down_wire", ("train_down_wire", "eval_down_wire"))):
            if not _close(good[total], good[parts[0]] + good[parts[1]]):
                ck.add(f"{where}.{total} is {good[total]!r}, expected {parts[0]} + {parts[1]} = {good[parts[0]] + good[parts[1]]!r}")
        for seconds, wire in (("up_link_s", "up_wire"), ("down_link_s", "down_wire")):
            if link is not None and not _close(good[seconds], good[wire] * 8 / (link * 1e6)):
                ck.add(f"{where}.{seconds} is {good[seconds]!r}, expected {wire} x 8 / (link_mbit x 10^6) = "
                       f"{good[wire] * 8 / (link * 1e6)!r}")
            if good[f"max_{seconds}"] + 1e-9 < good[seconds]:
                ck.add(f"{where}.max_{seconds} {good[f'max_{seconds}']!r} is below the mean {good[seconds]!r}")
        peak, memory, share = good["peak_rss_bytes"], good["memory_bytes"], good["memory_share"]
        expected = peak / memory if peak is not None and memory else None
        if (share is None) != (expected is None) or (share is not None and not _close(share, expected)):  # type: ignore[arg-type]
            ck.add(f"{where}.memory_share is {share!r}, expected peak_rss_bytes / memory_bytes = {expected!r}")
        warned = top.get("memory_share_warned")
        if share is not None and warned is not None and (share > warned) != (good["memory_warning"] is not None):
            ck.add(f"{where}.memory_warning is {good['memory_warning']!r} with memory_share {share!r} against "
                   f"memory_share_warned {warned!r}: a share above it has a warning, one at or below it none")
