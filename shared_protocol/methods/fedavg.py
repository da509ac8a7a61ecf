"""FedAvg messages: model weights up (sample count attached), the global model down.

The global model goes to agents in ``RoundStart.weights`` (and, after an
evaluated round, in :class:`FedAvgGlobalModel`); each agent's trained model comes
back as :class:`FedAvgUpdate`. These types carry nothing FedAvg-specific beyond
"a model and how many samples it saw", so the FedAvg family (FedGKD,
FedDistill, FedBE) can reuse them.

Float tensors (parameters, BatchNorm running mean/var) travel as tensors with
the run's weights codec: lossless ``zstd`` by default, ``fp16-zstd`` optional.
Integer buffers (BatchNorm's ``num_batches_tracked``: 0-d counters) travel as
JSON ints in ``int_buffers``, so a lossy float codec never touches a counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from ..configs import check_optimizer, round_config_from_wire
from ..errors import ShapeMismatchError, ValueRangeError
from ..message_base import Message, register_message, tensor_dict
from ..registry import LauncherFlag, MethodSpec, register_method

#: Codecs a model's float tensors may travel with (both directions).
WEIGHT_CODECS = ("zstd", "fp16-zstd", "raw")


def split_state(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A state dict as (float tensors, integer scalars) for the wire.

    Raises ValueError for an integer buffer that is not a scalar: the models
    here have none (only BatchNorm counters), and a silent fallback would put
    integers through a lossy codec.
    """
    floats: dict[str, np.ndarray] = {}
    ints: dict[str, int] = {}
    for name, array in arrays.items():
        if array.dtype.kind == "f":
            floats[name] = np.ascontiguousarray(array, dtype=np.float32)
        elif array.dtype.kind in "iu" and array.ndim == 0:
            ints[name] = int(array)
        else:
            raise ValueError(f"state entry {name!r} ({array.dtype}, shape {array.shape}): only float tensors and integer scalars travel")
    return floats, ints


def join_state(weights: dict[str, np.ndarray], int_buffers: dict[str, int]) -> dict[str, np.ndarray]:
    """Inverse of :func:`split_state` (integer scalars become 0-d int64 arrays)."""
    overlap = set(weights) & set(int_buffers)
    if overlap:
        raise ValueRangeError(f"names both in weights and int_buffers: {sorted(overlap)}")
    return {**weights, **{name: np.asarray(value, dtype=np.int64) for name, value in int_buffers.items()}}


def _check_model(type_name: str, weights: dict[str, np.ndarray], int_buffers: dict[str, Any]) -> None:
    if not weights:
        raise ShapeMismatchError(f"{type_name}: no weights")
    for name, array in weights.items():
        if array.dtype.kind != "f":
            raise ShapeMismatchError(f"{type_name}: weight {name!r} is {array.dtype}; integers go in int_buffers")
        if not np.isfinite(array).all():
            raise ValueRangeError(f"{type_name}: weight {name!r} has NaN or infinite values")
    for name, value in int_buffers.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueRangeError(f"{type_name}: int_buffers[{name!r}] must be an int >= 0, got {value!r}")
    if set(weights) & set(int_buffers):
        raise ValueRangeError(f"{type_name}: names both in weights and int_buffers")


@register_message
@dataclass(kw_only=True)
class FedAvgUpdate(Message):
    """Agent -> server: my model after local training on ``num_samples`` samples,
    started from global model ``model_version``."""

    TYPE: ClassVar[str] = "fedavg.update"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    instance: str
    num_samples: int
    model_version: int
    int_buffers: dict = field(default_factory=dict)
    weights: dict = tensor_dict()

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ValueRangeError(f"{self.TYPE}: num_samples must be >= 1, got {self.num_samples}")
        if self.model_version < 0:
            raise ValueRangeError(f"{self.TYPE}: model_version must be >= 0")
        _check_model(self.TYPE, self.weights, self.int_buffers)


@register_message
@dataclass(kw_only=True)
class FedAvgGlobalModel(Message):
    """Server -> agent after an evaluated round: the new global model ``model_version``.

    The agent keeps it, and evaluates it when the server's evaluation request follows
    (cloud_server/evaluation.py); the next RoundStart then names the version and carries
    no weights, so evaluation costs no extra download except after the last round.
    """

    TYPE: ClassVar[str] = "fedavg.global_model"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    model_version: int
    int_buffers: dict = field(default_factory=dict)
    weights: dict = tensor_dict()

    def validate(self) -> None:
        _check_model(self.TYPE, self.weights, self.int_buffers)


@dataclass(frozen=True)
class FedAvgRoundConfig:
    """``RoundStart.config`` of FedAvg: local training settings and which global model.

    ``model_version`` is the round whose aggregate the RoundStart's weights are
    (0: the initial model). Empty ``RoundStart.weights`` means "the version you
    received in FedAvgGlobalModel"; ``int_buffers`` are the global model's counters.
    """

    model_version: int = 0
    local_epochs: int = 1
    optimizer: str = "adam"
    lr: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 1e-4
    batch_size: int = 64
    upload_codec: str = "zstd"
    int_buffers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_version < 0:
            raise ValueError(f"model_version must be >= 0, got {self.model_version}")
        if self.local_epochs < 1 or self.batch_size < 1:
            raise ValueError("local_epochs and batch_size must be >= 1")
        check_optimizer(self.optimizer)
        if self.lr <= 0 or self.weight_decay < 0 or self.momentum < 0:
            raise ValueError("lr must be > 0, weight_decay and momentum >= 0")
        if self.upload_codec not in WEIGHT_CODECS:
            raise ValueError(f"upload_codec must be one of {WEIGHT_CODECS}, got {self.upload_codec!r}")
        for name, value in self.int_buffers.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"int_buffers[{name!r}] must be an int >= 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: dict) -> "FedAvgRoundConfig":
        return round_config_from_wire(cls, raw, "fedavg round config")


# -- the registry's entry ------------------------------------------------------------ #

#: The `edgesplit local` flags a whole-model method's launcher table reads (the FedAvg family's).
WHOLE_MODEL_FLAGS = (
    LauncherFlag("--model", "resnet56", "the full model every agent trains (a registered model fed images)"),
    LauncherFlag("--edge-epochs", 1, "epochs of local training per round", type="int", minimum=1),
    LauncherFlag("--codec", None, "weights, both ways: zstd (default, lossless) | fp16-zstd"),
)

register_method(MethodSpec(
    name="fedavg",
    summary="FedAvg: the sample-weighted mean of the agents' full models (the accuracy baseline)",
    server="cloud_server.methods.fedavg",
    edge="edge_agent.methods.fedavg",
    config="cloud_server.methods.fedavg:FedAvgConfig",
    messages=(__name__, "shared_protocol.secagg_messages"),  # the secure aggregation messages too
    flags=WHOLE_MODEL_FLAGS,
    docs="docs/methods/baselines.md",
))
