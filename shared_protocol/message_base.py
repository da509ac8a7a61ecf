"""Typed messages and their (de)serialisation to frames: the :class:`Message` base,
the field declarations, the registry of message types, and encode / decode.

A message type is a dataclass deriving from :class:`Message`, registered by its
``TYPE`` string. Scalar fields (int, float, str, bool, lists and dicts of those)
travel in the frame's JSON header under ``fields``; fields declared with
:func:`tensor` travel in the body, each with the codec chosen at encode time;
a field declared with :func:`tensor_dict` is a name -> array mapping (model
weights) whose entries travel as tensors named ``field/key``; a field declared
with :func:`record` is a typed record (:mod:`shared_protocol.records`) that
travels as a JSON object under ``fields`` and is checked field by field.

Decoding checks everything before constructing the object: known type, every
declared field present with the right JSON type, every tensor present with the
declared dtype and rank, no unexpected tensors, then the message's own
``validate`` (cross-field consistency such as matching batch sizes).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from .errors import HeaderError, ShapeMismatchError, UnknownMessageTypeError, ValueRangeError
from .frame import DEFAULT_LIMITS, FrameLimits, decode_frame, decode_tensor, encode_frame
from .records import JsonRecord


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor field must look like: dtype(s) and rank (None = any)."""

    dtypes: tuple[str, ...]
    ndim: int | None = None
    optional: bool = False


def tensor(dtype: str | tuple[str, ...], ndim: int | None = None, optional: bool = False) -> Any:
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    default: Any = None if optional else dataclasses.MISSING
    return field(default=default, metadata={"tensor": TensorSpec(dtypes, ndim, optional)})


def tensor_dict() -> Any:
    return field(default_factory=dict, metadata={"tensor_dict": True})


def record(cls: type[JsonRecord]) -> Any:
    """A field holding a typed record; absent on the wire means the record's defaults."""
    return field(default_factory=cls, metadata={"record": cls})


def new_message_id() -> str:
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class Message:
    """Base of every message: who sent it, for which run and round."""

    TYPE: ClassVar[str] = ""
    # Default codec per tensor field name; encode() can override per call.
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {}

    run: str
    round: int
    sender: str
    msg_id: str = field(default_factory=new_message_id)

    @property
    def for_evaluation(self) -> bool:
        """Whether the message belongs to evaluation, not training: its bytes are metered
        apart, so a round's cost columns stay the cost of training."""
        return False

    def validate(self) -> None:
        """Cross-field checks; raise a ProtocolError subclass on failure."""


_MESSAGE_TYPES: dict[str, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def register_message(cls: M) -> M:
    if not cls.TYPE:
        raise ValueError(f"{cls.__name__} has no TYPE")
    if cls.TYPE in _MESSAGE_TYPES:
        raise ValueError(f"message type {cls.TYPE!r} is already registered ({_MESSAGE_TYPES[cls.TYPE].__name__})")
    _MESSAGE_TYPES[cls.TYPE] = cls
    return cls


def message_types() -> dict[str, type[Message]]:
    return dict(_MESSAGE_TYPES)


_BASE_FIELDS = ("run", "round", "sender", "msg_id")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
}


def _json_kind(annotation: Any) -> tuple[str, bool]:
    """Map a field annotation (a string under postponed evaluation) to a JSON kind."""
    text = str(annotation).replace(" ", "")
    optional = "None" in text
    base = text.replace("|None", "").replace("None|", "")
    for kind in ("dict", "list", "int", "float", "str", "bool"):
        if base.startswith(kind):
            return kind, optional
    raise TypeError(f"unsupported message field annotation {annotation!r}")


def _check_json(kind: str, optional: bool, name: str, value: Any) -> None:
    if value is None and optional:
        return
    allowed = _JSON_TYPES[kind]
    if isinstance(value, bool) and kind in ("int", "float"):
        raise HeaderError(f"field {name!r} must be {kind}, got bool")
    if not isinstance(value, allowed):
        raise HeaderError(f"field {name!r} must be {kind}, got {type(value).__name__}")
    if kind == "float" and not math.isfinite(float(value)):
        raise HeaderError(f"field {name!r} must be finite, got {value}")


def encode_message(msg: Message, codecs: dict[str, str] | None = None, validate: bool = True) -> bytes:
    """Serialise a message to a frame. ``codecs`` maps tensor field names to codec names.
    ``validate=False`` skips the message's own checks: only for an agent told to misbehave
    (edge_agent/faults.py), so that the receiver's checks meet what a broken device sends."""
    if validate:
        msg.validate()
    chosen = {**msg.DEFAULT_CODECS, **(codecs or {})}
    fields_json: dict[str, Any] = {}
    tensors: dict[str, np.ndarray] = {}
    codec_for: dict[str, str] = {}
    for f in dataclasses.fields(msg):
        if f.name in _BASE_FIELDS:
            continue
        value = getattr(msg, f.name)
        if "tensor" in f.metadata:
            if value is None:
                continue
            tensors[f.name] = np.asarray(value)
            codec_for[f.name] = chosen.get(f.name, "raw")
        elif "tensor_dict" in f.metadata:
            for key, array in value.items():
                tensors[f"{f.name}/{key}"] = np.asarray(array)
                codec_for[f"{f.name}/{key}"] = chosen.get(f.name, "raw")
        elif "record" in f.metadata:
            kind = f.metadata["record"]
            if not isinstance(value, kind):
                raise TypeError(f"{msg.TYPE}.{f.name} must be {kind.__name__}, got {type(value).__name__}; "
                                f"build it with {kind.__name__}(...) or {kind.__name__}.from_json(...)")
            fields_json[f.name] = value.to_json()
        else:
            fields_json[f.name] = value
    header = {
        "type": msg.TYPE,
        "run": msg.run,
        "round": msg.round,
        "sender": msg.sender,
        "msg_id": msg.msg_id,
        "fields": fields_json,
    }
    return encode_frame(header, tensors, codec_for)


def peek_header(blob: bytes | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The frame's header (type, run, round, sender, ...) without decoding tensors."""
    return decode_frame(blob, limits).header


def decode_message(
    blob: bytes | memoryview,
    limits: FrameLimits = DEFAULT_LIMITS,
    expected: type[Message] | tuple[type[Message], ...] | None = None,
) -> Message:
    frame = decode_frame(blob, limits)
    header = frame.header
    type_name = header.get("type")
    cls = _MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise UnknownMessageTypeError(f"unknown message type {type_name!r}")
    if expected is not None and not issubclass(cls, expected):
        raise UnknownMessageTypeError(f"unexpected message type {type_name!r} here")
    for name, kind in (("run", str), ("round", int), ("sender", str), ("msg_id", str)):
        value = header.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise HeaderError(f"header field {name!r} must be {kind.__name__}, got {value!r}")
    raw_fields = header.get("fields", {})
    if not isinstance(raw_fields, dict):
        raise HeaderError("header field 'fields' must be an object")

    kwargs: dict[str, Any] = {name: header[name] for name in _BASE_FIELDS}
    descriptors = {d.name: d for d in frame.descriptors}
    consumed: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.name in _BASE_FIELDS:
            continue
        if "tensor" in f.metadata:
            spec: TensorSpec = f.metadata["tensor"]
            desc = descriptors.get(f.name)
            if desc is None:
                if spec.optional:
                    kwargs[f.name] = None
                    continue
                raise ShapeMismatchError(f"{cls.TYPE}: missing tensor {f.name!r}")
            if desc.dtype not in spec.dtypes:
                raise ShapeMismatchError(f"{cls.TYPE}.{f.name}: dtype {desc.dtype}, expected one of {spec.dtypes}")
            if spec.ndim is not None and len(desc.shape) != spec.ndim:
                raise ShapeMismatchError(
                    f"{cls.TYPE}.{f.name}: rank {len(desc.shape)} (shape {list(desc.shape)}), expected rank {spec.ndim}"
                )
            kwargs[f.name] = decode_tensor(desc, frame.body, limits)
            consumed.add(f.name)
        elif "tensor_dict" in f.metadata:
            prefix = f.name + "/"
            kwargs[f.name] = {
                name[len(prefix) :]: decode_tensor(desc, frame.body, limits)
                for name, desc in descriptors.items()
                if name.startswith(prefix)
            }
            consumed.update(n for n in descriptors if n.startswith(prefix))
        elif "record" in f.metadata:
            if f.name in raw_fields:  # a RecordError (a ValueRangeError) names the bad field
                kwargs[f.name] = f.metadata["record"].from_json(raw_fields[f.name], f"{cls.TYPE}.{f.name}")
        else:
            kind, optional = _json_kind(f.type)
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if f.name not in raw_fields:
                if has_default:
                    continue
                raise HeaderError(f"{cls.TYPE}: missing field {f.name!r}")
            _check_json(kind, optional, f.name, raw_fields[f.name])
            kwargs[f.name] = raw_fields[f.name]
    unexpected = set(descriptors) - consumed
    if unexpected:
        raise HeaderError(f"{cls.TYPE}: unexpected tensors {sorted(unexpected)}")
    msg = cls(**kwargs)
    msg.validate()
    return msg


def check_same_length(type_name: str, **arrays: np.ndarray | None) -> int:
    """All given arrays share their first dimension; return it."""
    lengths = {name: int(a.shape[0]) for name, a in arrays.items() if a is not None}
    if len(set(lengths.values())) > 1:
        raise ShapeMismatchError(f"{type_name}: first dimensions disagree: {lengths}")
    return next(iter(lengths.values()), 0)


def check_split(type_name: str, split: str, splits: tuple[str, ...], seq: int | None = None) -> None:
    """``split`` is one of ``splits`` and ``seq``, when given, a batch number >= 0."""
    if split not in splits:
        raise ValueRangeError(f"{type_name}: split must be one of {splits}, got {split!r}")
    if seq is not None and seq < 0:
        raise ValueRangeError(f"{type_name}: seq must be >= 0")


def check_seqs(type_name: str, seqs: list[Any], most: int = 100_000) -> None:
    """A request's batch numbers: 1 to ``most`` non-negative ints."""
    if not seqs or len(seqs) > most or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seqs):
        raise ValueRangeError(f"{type_name}: seqs must be 1..{most} non-negative ints")


def check_labels(type_name: str, labels: np.ndarray, num_classes: int) -> None:
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueRangeError(
            f"{type_name}: labels must be in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]"
        )
