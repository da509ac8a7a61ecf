"""The core message types every method uses: hello / welcome, round start and end,
evaluation requests and reports, errors, status, discovery and shutdown.

Each registers itself on import (:func:`~shared_protocol.message_base.register_message`);
a method's own message types live in :mod:`shared_protocol.methods`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .errors import ValueRangeError
from .message_base import Message, check_labels, record, register_message, tensor, tensor_dict
from .records import AgentRoundCosts, EvalCosts, JsonRecord, non_negative


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
    # The fault this agent commits on purpose ([agent] fault, shared_protocol/faults.py: e.g.
    # "sign_flip x4"), so that a run report names it; "": an honest agent (or one that does not say).
    fault: str = ""

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


@dataclass(frozen=True)
class PublicEvalSet(JsonRecord):
    """The run's public global test set, named for an agent that scores a private model on
    it: a seeded, stratified subset of ``dataset``'s ``split`` (``subset_samples`` 0: the whole
    split; ``seed`` draws it), ``samples`` images, and the sha256 of its sample ids and images
    (``fldata.public_set``), the digests report.json records as ``eval_set``. ``dataset`` "":
    no set named (the method's agents score nothing on it)."""

    dataset: str = ""
    split: str = "test"
    subset_samples: int = non_negative(0)
    seed: int = 0
    samples: int = non_negative(0)
    ids_sha256: str = ""
    images_sha256: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset and not (_is_sha256(self.ids_sha256) and _is_sha256(self.images_sha256) and self.samples > 0):
            raise ValueRangeError(f"public set {self.dataset!r}: samples must be > 0 and ids_sha256 / images_sha256 "
                                  f"64 hex digits, got {self.samples}, {self.ids_sha256!r}, {self.images_sha256!r}")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@register_message
@dataclass(kw_only=True)
class EvalRequest(Message):
    """Server -> agent, after an evaluated round: evaluate the model(s) you hold for
    ``round`` on your own test shard, and send what the server needs to evaluate your
    deployed model(s) on the run's global test set (cloud_server/evaluation.py).

    The method's downloads of the round (the new global model, server logits, and for a
    method whose agents score privately the models they need for it) were sent before this
    request on the same topic. ``config`` is the method's (e.g. the global model version the
    answer must be about). ``public_set`` names the global test set when the method's agents
    score model(s) on it themselves (``EvalReport.global_results``): private ones, and ones
    that live on the device."""

    TYPE: ClassVar[str] = "eval_request"
    config: dict = field(default_factory=dict)
    public_set: PublicEvalSet = record(PublicEvalSet)

    @property
    def for_evaluation(self) -> bool:
        return True


def _check_figures(where: str, results: dict) -> None:
    """``{label: {"correct": int, "total": int, "loss_sum"?: float}}`` with 0 <= correct <= total."""
    for label, figures in results.items():
        if not isinstance(figures, dict):
            raise ValueRangeError(f"eval_report: {where}.{label} must be an object, got {type(figures).__name__}")
        n, d = figures.get("correct"), figures.get("total")
        if not (isinstance(n, int) and isinstance(d, int) and not isinstance(n, bool) and not isinstance(d, bool)
                and 0 <= n <= d):
            raise ValueRangeError(f"eval_report: {where}.{label} correct={n!r} / total={d!r} must be ints with "
                                  "0 <= correct <= total")
        loss = figures.get("loss_sum")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))
                                 or not math.isfinite(loss) or loss < 0):
            raise ValueRangeError(f"eval_report: {where}.{label}.loss_sum = {loss!r} must be a finite number >= 0")


@register_message
@dataclass(kw_only=True)
class EvalReport(Message):
    """Agent -> server: the answer to an :class:`EvalRequest`.

    ``results`` holds, per labelled model the agent evaluated on its own test shard
    (``"model"``: the method's deployed model; others such as ``"edge"``, ``"mentee"``),
    ``{"correct": int, "total": int}`` and optionally ``"loss_sum"`` (summed cross-entropy).
    ``global_results`` holds the same figures of the model(s) the agent scored on the run's
    public global test set itself (a model the method keeps private: FedKD's mentor; one that
    lives on the device: FedGKT's ResNet-8), and
    ``public_set_sha256`` that set's ``images_sha256`` (``EvalRequest.public_set``).
    ``models`` carries, as ``LABEL/PARAM`` arrays, the agent-side model(s) the server needs
    to score the deployed model on the global test set when they are not private (FedGKT's
    ResNet-8 on a server-made frozen extractor).
    ``uploads`` says what the agent streamed for evaluation before this report (a split
    method's test activations: batches and samples per split), ``costs`` what it cost."""

    TYPE: ClassVar[str] = "eval_report"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"models": "zstd"}
    instance: str = ""
    results: dict = field(default_factory=dict)
    global_results: dict = field(default_factory=dict)
    public_set_sha256: str = ""
    uploads: dict = field(default_factory=dict)
    costs: EvalCosts = record(EvalCosts)
    models: dict = tensor_dict()

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        _check_figures("results", self.results)
        _check_figures("global_results", self.global_results)
        if self.global_results and not _is_sha256(self.public_set_sha256):
            raise ValueRangeError(f"eval_report: global_results need the public set they were scored on "
                                  f"(public_set_sha256: 64 hex digits), got {self.public_set_sha256!r}")
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
class EvalSetRequest(Message):
    """Agent -> server, while answering an :class:`EvalRequest`: send me the public set
    ``images_sha256`` names (this agent cannot load it itself)."""

    TYPE: ClassVar[str] = "eval_set_request"
    images_sha256: str

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        if not _is_sha256(self.images_sha256):
            raise ValueRangeError(f"eval_set_request: images_sha256 must be 64 hex digits, got {self.images_sha256!r}")


@register_message
@dataclass(kw_only=True)
class EvalSetData(Message):
    """Server -> one agent, the answer to an :class:`EvalSetRequest`: the public global test
    set itself, images (N, C, H, W) uint8, labels and sample ids (N,) int64, with the dataset
    ``name`` (it picks the normalisation) and ``num_classes``. Its bytes are evaluation's."""

    TYPE: ClassVar[str] = "eval_set_data"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"images": "zstd"}
    name: str
    num_classes: int
    images: np.ndarray = tensor("uint8", 4)
    labels: np.ndarray = tensor("int64", 1)
    sample_ids: np.ndarray = tensor("int64", 1)

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        if self.num_classes < 1:
            raise ValueRangeError(f"eval_set_data: num_classes must be >= 1, got {self.num_classes}")
        if not (self.images.shape[0] == self.labels.shape[0] == self.sample_ids.shape[0]):
            raise ValueRangeError(f"eval_set_data: {self.images.shape[0]} images, {self.labels.shape[0]} labels and "
                                  f"{self.sample_ids.shape[0]} sample ids must be as many")
        check_labels(self.TYPE, self.labels, self.num_classes)


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
