"""Config dataclasses from dicts: one place for the refusal of unknown keys.

Two kinds of config come from dicts. A TOML table a person wrote (``[fedavg]``)
is parsed at start-up, and a mistake is a ``ValueError`` naming the table. A
round config that came over the wire (``RoundStart.config``) is a peer's
message, and anything wrong with it is a :class:`~shared_protocol.errors.ValueRangeError`,
which the receiver rejects like any other bad message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ValueRangeError

T = TypeVar("T")

__all__ = ["OPTIMIZERS", "check_optimizer", "config_from_table", "round_config_from_wire"]

#: The optimisers a config may name (``models.training.make_optimizer`` builds them, the ort
#: backend's numpy optimisers mirror them; a test keeps the lists equal). Kept here, torch-free,
#: so that every config -- a TOML table or a round config off the wire -- checks against one list.
OPTIMIZERS = ("sgd", "adam")


def check_optimizer(name: str, key: str = "optimizer") -> str:
    """``name`` if it is one of :data:`OPTIMIZERS`, else a ValueError naming the config ``key``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"{key} must be one of {OPTIMIZERS}, got {name!r}")
    return name


def _unknown_keys(cls: type, raw: Mapping[str, Any]) -> list[str]:
    return sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})


def config_from_table(cls: type[T], raw: Mapping[str, Any], table: str) -> T:
    """``cls(**raw)`` for the TOML table ``[table]``; unknown keys are a ValueError."""
    unknown = _unknown_keys(cls, raw)
    if unknown:
        raise ValueError(f"unknown [{table}] keys: {unknown}")
    return cls(**raw)


def round_config_from_wire(cls: type[T], raw: Any, what: str) -> T:
    """``cls(**raw)`` for a config received in a message (``what``, e.g. "fedavg round config");
    a non-dict, unknown keys or values ``cls`` refuses are a ValueRangeError."""
    if not isinstance(raw, dict):
        raise ValueRangeError(f"{what} must be a table, got {type(raw).__name__}")
    unknown = _unknown_keys(cls, raw)
    if unknown:
        raise ValueRangeError(f"{what} has unknown keys {unknown}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ValueRangeError(f"{what} invalid: {exc}") from None
