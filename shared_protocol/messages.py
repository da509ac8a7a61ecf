"""Typed messages and their (de)serialisation to frames.

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
from .records import AgentRoundCosts, EvalCosts, JsonRecord


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


def encode_message(msg: Message, codecs: dict[str, str] | None = None) -> bytes:
    """Serialise a message to a frame. ``codecs`` maps tensor field names to codec names."""
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


def check_labels(type_name: str, labels: np.ndarray, num_classes: int) -> None:
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueRangeError(
            f"{type_name}: labels must be in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]"
        )


# --------------------------------------------------------------------------- #
# Core message types every method uses.
# --------------------------------------------------------------------------- #


@register_message
@dataclass(kw_only=True)
class Hello(Message):
    """Agent -> server on (re)connect: who I am and what I can do."""

    TYPE: ClassVar[str] = "hello"
    cpu_model: str
    arch: str
    cores: int
    memory_bytes: int
    backend: str
    num_samples: int
    class_counts: list
    methods: list
    software: dict = field(default_factory=dict)
    last_round_done: int = -1
    # How the agent trades speed for memory (its [memory] settings). micro_batch_samples > 0
    # changes BatchNorm's batches, so a report says which agents trained that way.
    memory: dict = field(default_factory=dict)
    # The data contract (checked by the server at join, before any work): the shape of one
    # training input as the model sees it, [channels, height, width], and the number of
    # classes of the agent's dataset. Empty / 0: not told (an agent from before they existed).
    input_shape: list = field(default_factory=list)
    num_classes: int = 0
    # Which process on which of its broker connections says hello (the agent's instance id and its
    # connection count): a hello repeated on the same connection (answering a discover, maybe one
    # queued in its MQTT session from before it started) means the agent still has every message
    # the server sent it since, so an open round goes on; a new connection or process restarts it.
    # "" / 0: not told (the round restarts, as before these fields).
    instance: str = ""
    connection: int = 0

    def validate(self) -> None:
        if self.num_samples < 0 or self.cores < 0 or self.memory_bytes < 0 or self.connection < 0:
            raise ValueRangeError("hello: counts must be non-negative")
        if not all(isinstance(c, int) and c >= 0 for c in self.class_counts):
            raise ValueRangeError("hello: class_counts must be non-negative ints")
        if self.input_shape and (len(self.input_shape) != 3
                                 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in self.input_shape)):
            raise ValueRangeError(f"hello: input_shape must be [channels, height, width] of positive ints, got {self.input_shape!r}")
        if self.num_classes < 0:
            raise ValueRangeError(f"hello: num_classes must be >= 0, got {self.num_classes}")


@register_message
@dataclass(kw_only=True)
class Welcome(Message):
    """Server -> agent: accepted or refused, and the run's fixed settings."""

    TYPE: ClassVar[str] = "welcome"
    accepted: bool
    reason: str = ""
    # Why, as a code an agent acts on: "data_mismatch" (the agent's data does not fit the
    # run: a configuration error on the device, not retried), "not_allowed", "method".
    code: str = ""
    method: str = ""
    settings: dict = field(default_factory=dict)


@register_message
@dataclass(kw_only=True)
class RoundStart(Message):
    """Server -> agent(s): take part in round ``round``.

    ``config`` holds the method's per-round settings (epochs, lr, KD weights...).
    ``weights`` carries a model for methods that send one (FedAvg and friends).
    """

    TYPE: ClassVar[str] = "round_start"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    method: str
    config: dict = field(default_factory=dict)
    deadline_s: float
    evaluate: bool = False
    participants: list = field(default_factory=list)
    weights: dict = tensor_dict()


@register_message
@dataclass(kw_only=True)
class RoundEnd(Message):
    """Agent -> server: my part of the round is done, and what it cost."""

    TYPE: ClassVar[str] = "round_end"
    num_samples: int
    instance: str = ""  # the agent process that did the work (a restart is a new instance)
    uploads: dict = field(default_factory=dict)  # method-specific: what was sent, e.g. batches per split
    costs: AgentRoundCosts = record(AgentRoundCosts)
    # Method-specific figures. Two naming rules hold for every method, so the server can
    # check them without knowing the method: a metric named ``*_accuracy`` is a fraction
    # in [0, 1], and ``X_correct`` comes with ``X_total``, ints with 0 <= correct <= total.
    metrics: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Costs and metrics go into reports: every number must be finite, and
        non-negative outside ``metrics`` (a loss may be negative)."""
        if self.num_samples < 0:
            raise ValueRangeError(f"round_end: num_samples must be >= 0, got {self.num_samples}")
        for table_name, table in (("metrics", self.metrics), ("uploads", self.uploads)):
            for key, value in _numbers(table):
                if not math.isfinite(value) or (value < 0 and table_name != "metrics"):
                    raise ValueRangeError(f"round_end: {table_name}.{key} = {value} must be finite and >= 0")
        check_metric_names("round_end", self.metrics)


def check_metric_names(type_name: str, metrics: dict) -> None:
    """The naming rules of method metrics (see ``RoundEnd.metrics``)."""
    for key, value in metrics.items():
        if key.endswith("_accuracy") and value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0
        ):
            raise ValueRangeError(f"{type_name}: metrics.{key} = {value!r} must be in [0, 1] (metrics named *_accuracy are fractions)")
        if key.endswith("_correct"):
            total = key[: -len("_correct")] + "_total"
            n, d = value, metrics.get(total, 0)
            if not (isinstance(n, int) and isinstance(d, int) and not isinstance(n, bool) and 0 <= n <= d):
                raise ValueRangeError(f"{type_name}: metrics {key}={n!r} / {total}={d!r} must be ints with 0 <= {key} <= {total}")


def _numbers(table: dict, prefix: str = "") -> list[tuple[str, float]]:
    """Every int/float in a nested dict, with its dotted key."""
    out: list[tuple[str, float]] = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((f"{prefix}{key}", float(value)))
    return out


@register_message
@dataclass(kw_only=True)
class EvalRequest(Message):
    """Server -> agent, after an evaluated round: evaluate the model(s) you hold for
    ``round`` on your own test shard, and send what the server needs to evaluate your
    deployed model(s) on the run's global test set (cloud_server/evaluation.py).

    The method's downloads of the round (the new global model, server logits...) were sent
    before this request on the same topic. ``config`` is the method's (e.g. the global
    model version the answer must be about)."""

    TYPE: ClassVar[str] = "eval_request"
    config: dict = field(default_factory=dict)

    @property
    def for_evaluation(self) -> bool:
        return True


@register_message
@dataclass(kw_only=True)
class EvalReport(Message):
    """Agent -> server: the answer to an :class:`EvalRequest`.

    ``results`` holds, per labelled model the agent evaluated on its own test shard
    (``"model"``: the method's deployed model; others such as ``"edge"``, ``"mentee"``),
    ``{"correct": int, "total": int}`` and optionally ``"loss_sum"`` (summed cross-entropy).
    ``models`` carries, as ``LABEL/PARAM`` arrays, the agent-side model(s) the server needs
    to score the deployed model on the global test set (FedGKT's ResNet-8, FedKD's mentor).
    ``uploads`` says what the agent streamed for evaluation before this report (a split
    method's test activations: batches and samples per split), ``costs`` what it cost."""

    TYPE: ClassVar[str] = "eval_report"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"models": "zstd"}
    instance: str = ""
    results: dict = field(default_factory=dict)
    uploads: dict = field(default_factory=dict)
    costs: EvalCosts = record(EvalCosts)
    models: dict = tensor_dict()

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        for label, figures in self.results.items():
            if not isinstance(figures, dict):
                raise ValueRangeError(f"eval_report: results.{label} must be an object, got {type(figures).__name__}")
            n, d = figures.get("correct"), figures.get("total")
            if not (isinstance(n, int) and isinstance(d, int) and not isinstance(n, bool) and not isinstance(d, bool)
                    and 0 <= n <= d):
                raise ValueRangeError(f"eval_report: results.{label} correct={n!r} / total={d!r} must be ints with "
                                      "0 <= correct <= total")
            loss = figures.get("loss_sum")
            if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))
                                     or not math.isfinite(loss) or loss < 0):
                raise ValueRangeError(f"eval_report: results.{label}.loss_sum = {loss!r} must be a finite number >= 0")
        for key, value in _numbers(self.uploads):
            if not math.isfinite(value) or value < 0:
                raise ValueRangeError(f"eval_report: uploads.{key} = {value} must be finite and >= 0")
        for name, array in self.models.items():
            if "/" not in name:
                raise ValueRangeError(f"eval_report: model array {name!r} is not named LABEL/PARAM")
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ValueRangeError(f"eval_report: model array {name!r} holds non-finite values")


@register_message
@dataclass(kw_only=True)
class ErrorReply(Message):
    """Either side: a message of yours was refused, and why."""

    TYPE: ClassVar[str] = "error"
    code: str
    reason: str
    ref_msg_id: str = ""


@register_message
@dataclass(kw_only=True)
class Status(Message):
    """Retained on the status topic; the broker's last will publishes 'offline'."""

    TYPE: ClassVar[str] = "status"
    state: str

    STATES: ClassVar[frozenset[str]] = frozenset({"online", "offline", "training", "uploading", "idle", "done"})

    def validate(self) -> None:
        if self.state not in self.STATES:
            raise ValueRangeError(f"status: unknown state {self.state!r}")


@register_message
@dataclass(kw_only=True)
class Discover(Message):
    """Server -> all, on (re)start: every agent answers with a Hello."""

    TYPE: ClassVar[str] = "discover"


@register_message
@dataclass(kw_only=True)
class Shutdown(Message):
    """Server -> all: the run is over (or aborted); agents exit cleanly."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


__all__ = [
    "TensorSpec",
    "tensor",
    "tensor_dict",
    "record",
    "Message",
    "register_message",
    "message_types",
    "encode_message",
    "decode_message",
    "peek_header",
    "check_same_length",
    "check_labels",
    "check_metric_names",
    "Hello",
    "Welcome",
    "RoundStart",
    "RoundEnd",
    "EvalRequest",
    "EvalReport",
    "ErrorReply",
    "Status",
    "Shutdown",
    "Discover",
    "new_message_id",
]
