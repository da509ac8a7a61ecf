"""Typed records and their one JSON (de)serialiser.

A record is a dataclass deriving from :class:`JsonRecord`. ``to_json()`` gives
strict JSON values (numpy scalars and arrays become numbers and lists, a
non-finite float becomes ``null``); ``from_json()`` checks every field against
its annotation before building the record, so JSON from a peer or from a file
never travels on as a half-checked dict. Both sides use it: the agent's
:class:`AgentRoundCosts` crosses the wire in ``RoundEnd.costs``, and the
server's run report (``cloud_server/records.py``) is built from records too.

Annotations understood: ``int``, ``float``, ``str``, ``bool``, ``X | None``,
``list[X]``, ``dict[str, X]``, a bare ``dict`` (free-form, e.g. a method's own
figures) and other record types. Field metadata (see :func:`bounded`,
:func:`non_negative`, :func:`fraction` and :func:`optional_section`): ``min`` /
``max`` bound a number inclusively, checked when the record is built;
``omit_empty`` leaves the field out of the JSON when it is None or empty, for
sections only some runs have; ``added_later`` marks a field that files written
before it existed lack (a schema checks it only where present).

Reading: a missing key takes the field's default (a field without one is
required); an unknown key is ignored, so a newer peer may send more.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from .errors import ValueRangeError

__all__ = ["RecordError", "JsonRecord", "AgentRoundCosts", "EvalCosts", "bounded", "non_negative", "fraction", "optional_section",
           "plain_json"]

R = TypeVar("R", bound="JsonRecord")


class RecordError(ValueRangeError, ValueError):
    """A record's JSON or values are not what its type declares. A ValueRangeError, so a
    receiver rejects the message that carried it like any other bad message; a ValueError
    for callers that read records from files."""


def bounded(default: Any, minimum: float | None = None, maximum: float | None = None, added_later: bool = False) -> Any:
    """A number field within [minimum, maximum] (None where unbounded, and a None value passes)."""
    return field(default=default, metadata={"min": minimum, "max": maximum, "added_later": added_later})


def non_negative(default: Any, added_later: bool = False) -> Any:
    """A number field that must be >= 0 (a count, bytes, seconds)."""
    return bounded(default, minimum=0, added_later=added_later)


def fraction(default: float | None = None) -> Any:
    """A number field in [0, 1] (an accuracy); None where not measured."""
    return bounded(default, minimum=0, maximum=1)


def optional_section(default: Any = None, default_factory: Any = None) -> Any:
    """A field left out of the JSON while it is None or empty."""
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"omit_empty": True})
    return field(default=default, metadata={"omit_empty": True})


def plain_json(value: Any) -> Any:
    """``value`` as strict JSON: records as objects, numpy as Python numbers and lists,
    non-finite floats as None (a diverged loss is unknown, not a broken report)."""
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar or array
        return plain_json(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list)) and not value)


class JsonRecord:
    """Base of typed records (mix into a ``@dataclass``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise RecordError(f"{type(self).__name__}.{f.name} = {value} must be finite")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if (low is not None and value < low) or (high is not None and value > high):
                    bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
                    raise RecordError(f"{type(self).__name__}.{f.name} = {value} must be in {bounds}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("omit_empty") and _is_empty(value):
                continue
            out[f.name] = plain_json(value)
        return out

    @classmethod
    def from_json(cls: type[R], raw: Any, where: str = "") -> R:
        """Build the record from JSON; :class:`RecordError` names the first bad field."""
        where = where or cls.__name__
        if not isinstance(raw, dict):
            raise RecordError(f"{where}: expected an object, got {type(raw).__name__}")
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in raw:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(f"{where}.{f.name}: missing")
                continue
            kwargs[f.name] = _read(hints[f.name], raw[f.name], f"{where}.{f.name}")
        return cls(**kwargs)


def _read(kind: Any, value: Any, where: str) -> Any:
    """``value`` checked against the annotation ``kind``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (kind,) = [a for a in args if a is not type(None)]  # only ``X | None`` unions are declared
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if isinstance(kind, type) and issubclass(kind, JsonRecord):
        return kind.from_json(value, where)
    expected = origin or kind
    if expected is Any:
        return value
    # bool is an int subclass in Python, but True is never a count.
    if isinstance(value, bool) and expected is not bool:
        raise RecordError(f"{where}: expected {getattr(expected, '__name__', expected)}, got bool")
    if expected is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, expected):
        raise RecordError(f"{where}: expected {expected.__name__}, got {type(value).__name__}")
    if expected is list and args:
        return [_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if expected is dict and args:
        return {str(k): _read(args[1], v, f"{where}[{k}]") for k, v in value.items()}
    return value


@dataclass(frozen=True)
class AgentRoundCosts(JsonRecord):
    """What one agent's round cost on its own device (``RoundEnd.costs``).

    Time is split into phases (compute: training and feature extraction; encode:
    frame encoding and compression; network: publishing until the broker
    acknowledged; idle: waiting for the server since the previous round) and
    ``round_s``, from RoundStart to RoundEnd. Bytes are as this agent's connection
    saw them: payload (frames before chunking) and wire (MQTT packets).
    """

    samples: int = non_negative(0)
    train_flops: int = non_negative(0)  # forward + backward, FLOPs = 2 x MACs
    compute_s: float = non_negative(0.0)
    encode_s: float = non_negative(0.0)
    network_s: float = non_negative(0.0)
    idle_s: float = non_negative(0.0)
    round_s: float = non_negative(0.0, added_later=True)
    # The round's own peak: the most the agent process held since its previous round ended (the
    # process's lifetime peak on systems that cannot reset it; edge_agent.costs.RoundPeakRss).
    peak_rss_bytes: int = non_negative(0)
    # False: ``peak_rss_bytes`` is the process's lifetime peak (several simulated agents in one
    # process, or a system that cannot reset it), which rises by nature: no growth warning reads it.
    peak_rss_per_round: bool = field(default=True, metadata={"added_later": True})
    payload_bytes_up: int = non_negative(0)
    wire_bytes_up: int = non_negative(0)
    payload_bytes_down: int = non_negative(0)
    wire_bytes_down: int = non_negative(0)
    codec: str = ""  # the upload codec the round used ("" when the method uploads no tensors)
    codec_ratio: float = non_negative(1.0)  # raw tensor bytes / encoded bytes
    # training batches left out so the round could finish within RoundStart.deadline_s (0: all ran)
    skipped_batches: int = non_negative(0, added_later=True)


@dataclass(frozen=True)
class EvalCosts(JsonRecord):
    """What answering one evaluation request cost on the agent (``EvalReport.costs``), kept
    apart from the round's training costs: forward FLOPs of the evaluation passes (and of
    the test activations a split method uploads), time by phase, and the bytes of the
    evaluation uploads as this agent's connection saw them."""

    flops: int = non_negative(0)
    compute_s: float = non_negative(0.0)
    encode_s: float = non_negative(0.0)
    network_s: float = non_negative(0.0)
    payload_bytes_up: int = non_negative(0)
    wire_bytes_up: int = non_negative(0)
    payload_bytes_down: int = non_negative(0)
    wire_bytes_down: int = non_negative(0)
