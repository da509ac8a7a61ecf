"""FedKD messages: SVD-factored mentee updates up, the SVD-factored aggregate down.

Every round each agent sends :class:`FedKdUpdate`: its mentee's change over
the round (or, with ``upload = "gradient"``, its mean gradient), every float
tensor of the mentee's state factored with the round's energy threshold T
(:mod:`shared_protocol.svd`, Eqs. 8-9). The server answers every agent whose
update it used with :class:`FedKdAggregate`: the averaged update, factored
again with the same T, which the agent adds to its copy of the global mentee.
Evaluation is the server's evaluation request every method answers (the agent
scores its mentor and the new global mentee; its mentor travels for the global
test set). Agents that do not hold the global mentee the
round starts from (first round, missed rounds, restarts) get it whole, once,
in ``RoundStart.weights`` (lossless ``zstd``).

How tensors travel: ``layout`` lists, in order, one entry ``[name, shape,
mode, rank]`` per tensor (``mode`` "factored" with K >= 1, or "dense" with rank
0), and ``factors`` is one float32 vector: the tensors' payloads back to back,
each exactly the payload of the ``svd`` codec
(:class:`shared_protocol.codecs.SvdCodec`): ``U`` (P x K, row-major), ``S``
(K), ``V`` (K x Q, row-major), or the dense values. One vector rather than one
tensor per parameter keeps the frame header small (a tensor descriptor costs
about 200 bytes, as much as a 16 x 3 x 3 conv's factors); it travels with codec
``raw`` (factors are incompressible noise to zstd), and the frame layer checks
it for NaN/Inf like any tensor. The tensors are not sent *through* the ``svd``
codec because the frame layer looks codecs up by name and gives them no
per-call parameter, while T changes every round (Eq. 9) and the server's
messages are encoded by the coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from .. import svd
from ..configs import check_optimizer, round_config_from_wire
from ..errors import ShapeMismatchError, SizeLimitError, ValueRangeError
from ..frame import DEFAULT_LIMITS
from ..message_base import Message, register_message, tensor
from ..registry import MethodSpec, register_method

#: What an update carries: the mentee's change over the round, or its mean gradient.
UPLOAD_KINDS = ("update", "gradient")
#: Codecs the whole global mentee may travel with in ``RoundStart.weights``.
SYNC_CODECS = ("zstd", "raw")
#: Largest tensor a layout may declare (the frame layer's default element limit): a
#: rank-1 entry of a few bytes must not claim a matrix that takes gigabytes to rebuild.
MAX_TENSOR_ELEMENTS = DEFAULT_LIMITS.max_tensor_elements


def factor_state(arrays: dict[str, np.ndarray], threshold: float) -> tuple[list[list[Any]], np.ndarray, dict[str, svd.SvdTensor]]:
    """SVD-factor every tensor of a state: (``layout``, ``factors`` vector, the packed tensors by name)."""
    packed = {name: svd.factorize(array, threshold) for name, array in arrays.items()}
    layout = [[name, list(p.shape), p.mode, p.rank] for name, p in packed.items()]
    factors = np.concatenate([p.values for p in packed.values()]) if packed else np.zeros(0, np.float32)  # (sum of payloads,)
    return layout, factors.astype(np.float32, copy=False), packed


def unfactor_state(type_name: str, layout: list[Any], factors: np.ndarray) -> dict[str, svd.SvdTensor]:
    """The packed tensors of a received message, by name; a ProtocolError if anything is inconsistent.

    Checks every entry (unique name, shape, mode, rank with 1 <= K <= min(P, Q))
    and that the payload sizes add up to the vector's length exactly, before
    slicing; rebuilding is left to the caller (:meth:`SvdTensor.reconstruct`).
    """
    sizes: list[tuple[str, tuple[int, ...], str, int, int]] = []
    for entry in layout:
        if not isinstance(entry, list) or len(entry) != 4:
            raise ShapeMismatchError(f"{type_name}: layout entries are [name, shape, mode, rank], got {entry!r}"[:300])
        name, shape, mode, rank = entry
        if not isinstance(name, str) or not name:
            raise ShapeMismatchError(f"{type_name}: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ShapeMismatchError(f"{type_name}: tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
        if math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise SizeLimitError(f"{type_name}: tensor {name!r} declares {math.prod(shape)} elements, limit {MAX_TENSOR_ELEMENTS}")
        try:
            size = svd.payload_elements(tuple(shape), mode, rank)
        except ValueError as exc:
            raise ShapeMismatchError(f"{type_name}: tensor {name!r}: {exc}") from None
        sizes.append((name, tuple(shape), mode, rank, size))
    names = [entry[0] for entry in sizes]
    if len(set(names)) != len(names):
        raise ShapeMismatchError(f"{type_name}: a tensor name appears twice in the layout")
    total = sum(entry[4] for entry in sizes)
    if factors.ndim != 1 or factors.size != total:
        raise ShapeMismatchError(f"{type_name}: factors have {factors.size} values, the layout needs {total}")
    out: dict[str, svd.SvdTensor] = {}
    offset = 0
    for name, shape, mode, rank, size in sizes:
        out[name] = svd.unpack(factors[offset : offset + size], shape, mode, rank)
        offset += size
    return out


def _check_counts(type_name: str, **values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueRangeError(f"{type_name}: {name} must be >= 0, got {value}")


@register_message
@dataclass(kw_only=True)
class FedKdUpdate(Message):
    """Agent -> server: my mentee's update (or mean gradient) of this round, SVD-factored
    with ``threshold``, computed from global mentee ``base_version`` on ``num_samples`` samples."""

    TYPE: ClassVar[str] = "fedkd.update"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"factors": "raw"}
    instance: str
    num_samples: int
    base_version: int
    payload: str
    threshold: float
    layout: list
    factors: np.ndarray = tensor(("float32",), ndim=1)

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ValueRangeError(f"{self.TYPE}: num_samples must be >= 1, got {self.num_samples}")
        _check_counts(self.TYPE, base_version=self.base_version)
        if self.payload not in UPLOAD_KINDS:
            raise ValueRangeError(f"{self.TYPE}: payload must be one of {UPLOAD_KINDS}, got {self.payload!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueRangeError(f"{self.TYPE}: threshold must be in (0, 1], got {self.threshold}")
        if not self.layout:
            raise ShapeMismatchError(f"{self.TYPE}: no tensors")
        unfactor_state(self.TYPE, self.layout, self.factors)


@register_message
@dataclass(kw_only=True)
class FedKdAggregate(Message):
    """Server -> agent: the aggregated mentee update that turns global mentee
    ``base_version`` into ``version``, SVD-factored with ``threshold``."""

    TYPE: ClassVar[str] = "fedkd.aggregate"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"factors": "raw"}
    version: int
    base_version: int
    threshold: float
    layout: list
    factors: np.ndarray = tensor(("float32",), ndim=1)

    def validate(self) -> None:
        _check_counts(self.TYPE, base_version=self.base_version)
        if self.version <= self.base_version:
            raise ValueRangeError(f"{self.TYPE}: version {self.version} must follow base_version {self.base_version}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueRangeError(f"{self.TYPE}: threshold must be in (0, 1], got {self.threshold}")
        if not self.layout:
            raise ShapeMismatchError(f"{self.TYPE}: no tensors")
        unfactor_state(self.TYPE, self.layout, self.factors)


@dataclass(frozen=True)
class FedKdRoundConfig:
    """``RoundStart.config`` of FedKD: the wire contract between the two sides.

    ``global_version``: the global mentee the round starts from (0: the initial
    one); empty ``RoundStart.weights`` means "the copy you hold". ``threshold``
    is this round's T(t) (Eq. 9), computed by the server; agents factor with it.
    """

    global_version: int = 0
    threshold: float = 0.95
    upload: str = "update"  # update (the round's mentee change) | gradient (mean gradient at the global mentee)
    local_epochs: int = 1
    batch_size: int = 64
    optimizer: str = "adam"
    mentor_lr: float = 0.001
    mentee_lr: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 1e-4
    hidden_loss: bool = True  # Eq. 5's MSE(H_t, W_h H_s)
    attention_loss: bool = True  # Eq. 5's MSE(A_t, A_s), attention maps of the last feature maps
    upload_codec: str = "svd"  # what the update travels as (for the cost report)
    # Ablations (the paper's Figs. 2-3), all on by default. False: L_t (resp. L_s) is the task loss
    # alone, the mentor (mentee) learning from the labels only ("without mutual distillation");
    # adaptive_weight False: the distillation and hidden terms weighted 1, not 1 / (L^t_t + L^t_s).
    mentor_distillation: bool = True
    mentee_distillation: bool = True
    adaptive_weight: bool = True

    #: Keys added after agents were deployed: sent only when not at their default, so that a
    #: default round config is what those agents (which refuse unknown keys) accept.
    ADDED_LATER: ClassVar[tuple[str, ...]] = ("mentor_distillation", "mentee_distillation", "adaptive_weight")

    def __post_init__(self) -> None:
        for name in self.ADDED_LATER:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.global_version < 0:
            raise ValueError(f"global_version must be >= 0, got {self.global_version}")
        svd.check_threshold(self.threshold)
        if self.upload not in UPLOAD_KINDS:
            raise ValueError(f"upload must be one of {UPLOAD_KINDS}, got {self.upload!r}")
        if self.local_epochs < 1 or self.batch_size < 1:
            raise ValueError("local_epochs and batch_size must be >= 1")
        check_optimizer(self.optimizer)
        if self.mentor_lr <= 0 or self.mentee_lr <= 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError("mentor_lr and mentee_lr must be > 0, momentum and weight_decay >= 0")
        if self.upload_codec != "svd":
            raise ValueError(f"FedKD updates travel SVD-factored; upload_codec must be 'svd', got {self.upload_codec!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not (f.name in self.ADDED_LATER and getattr(self, f.name) == f.default)}

    @classmethod
    def from_dict(cls, raw: dict) -> "FedKdRoundConfig":
        return round_config_from_wire(cls, raw, "fedkd round config")


# -- the registry's entry ------------------------------------------------------------ #

register_method(MethodSpec(
    name="fedkd",
    summary="FedKD: private mentor + shared mentee, adaptive mutual distillation, SVD-factored updates both ways",
    server="cloud_server.methods.fedkd",
    edge="edge_agent.methods.fedkd",
    config="cloud_server.methods.fedkd_config:FedKdConfig",
    messages=(__name__,),
    docs="docs/methods/fedkd.md",
))
