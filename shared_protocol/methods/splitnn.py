"""Split learning (vanilla SplitNN, Gupta & Raskar 2018; the FedGKT paper's SL
baseline) messages: per mini-batch, activations up and gradients back.

An agent's turn: RoundStart carries the extractor weights the previous agent
left (agents take turns and pass the extractor on, through the server); then,
batch by batch, :class:`SplitActivations` up and :class:`SplitGradients` back
before the next batch; at the end :class:`SplitExtractorWeights` up. After an
evaluated round the server sends the final extractor (:class:`SplitExtractor`);
answering the evaluation request every method answers (``EvalReport``), each
agent first streams its test activations (``split = "test"``, no answers).

With a private extractor (the server's ``extractor = "private"``) nothing of the extractor
crosses: RoundStart carries no weights, no :class:`SplitExtractorWeights` goes up, and
before the evaluation request the server sends its part (:class:`SplitServerModel`, an
evaluation download); the agent scores its extractor + that part on the run's public
global set and on its shard and reports the figures only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from ..activation_guard import ActivationGuard
from ..configs import check_optimizer, round_config_from_wire
from ..errors import ShapeMismatchError, ValueRangeError
from ..message_base import Message, check_same_length, check_split, register_message, tensor, tensor_dict
from ..registry import LauncherFlag, MethodSpec, register_method

SPLITS = ("train", "test")
#: Activation codecs; vanilla split learning sends fp32 (the paper's Eq. 12 counts fp32).
ACTIVATION_CODECS = ("raw", "zstd", "fp16-zstd", "u8-zstd", "u8-affine-zstd")


@register_message
@dataclass(kw_only=True)
class SplitActivations(Message):
    """Agent -> server: the extractor's output for one mini-batch.

    ``activations`` (B, C, H, W), ``labels`` (B,). ``seq`` numbers the batches of
    the agent's turn from 0; a repeated seq (a retry) is answered from the
    server's cache, never trained on twice.
    """

    TYPE: ClassVar[str] = "splitnn.activations"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"activations": "raw", "labels": "zstd"}
    split: str
    seq: int
    instance: str
    activations: np.ndarray = tensor(("float32",), ndim=4)
    labels: np.ndarray = tensor(("int64",), ndim=1)

    @property
    def for_evaluation(self) -> bool:
        """Test activations answer an evaluation request (their bytes are evaluation's)."""
        return self.split == "test"

    def validate(self) -> None:
        check_split(self.TYPE, self.split, SPLITS, self.seq)
        if check_same_length(self.TYPE, activations=self.activations, labels=self.labels) == 0:
            raise ShapeMismatchError(f"{self.TYPE}: empty batch")


@register_message
@dataclass(kw_only=True)
class SplitGradients(Message):
    """Server -> agent: dLoss/dActivations (B, C, H, W) for batch ``seq``, and the
    batch's loss and correct count (the server holds the head)."""

    TYPE: ClassVar[str] = "splitnn.gradients"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"gradients": "raw"}
    seq: int
    loss: float
    correct: int
    gradients: np.ndarray = tensor(("float32",), ndim=4)

    def validate(self) -> None:
        if self.seq < 0 or not 0 <= self.correct <= self.gradients.shape[0]:
            raise ValueRangeError(f"{self.TYPE}: bad seq {self.seq} or correct {self.correct}")


@register_message
@dataclass(kw_only=True)
class SplitExtractorWeights(Message):
    """Agent -> server at the end of its turn: the extractor, for the next agent."""

    TYPE: ClassVar[str] = "splitnn.extractor"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    instance: str
    batches: int
    weights: dict = tensor_dict()

    def validate(self) -> None:
        if not self.weights:
            raise ShapeMismatchError(f"{self.TYPE}: no weights")


@register_message
@dataclass(kw_only=True)
class SplitExtractor(Message):
    """Server -> agent after an evaluated round: the round's final extractor, ahead of the
    evaluation request: the agent streams its test activations under it (the server's part
    scores them)."""

    TYPE: ClassVar[str] = "splitnn.final_extractor"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    weights: dict = tensor_dict()

    def validate(self) -> None:
        if not self.weights:
            raise ShapeMismatchError(f"{self.TYPE}: no weights")


@register_message
@dataclass(kw_only=True)
class SplitServerModel(Message):
    """Server -> an agent whose extractor is private, just before its ``EvalRequest``: the
    server's part (``weights``, its state dict), which the agent needs to score its own
    extractor + that part itself. Its bytes are evaluation's."""

    TYPE: ClassVar[str] = "splitnn.server_model"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd"}
    weights: dict = tensor_dict()

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        if not self.weights:
            raise ValueRangeError(f"{self.TYPE}: no server model weights")
        for name, array in self.weights.items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ValueRangeError(f"{self.TYPE}: weights {name!r} hold non-finite values")


@dataclass(frozen=True)
class SplitRoundConfig:
    """``RoundStart.config`` of split learning: the agent's half of the settings."""

    local_epochs: int = 1
    optimizer: str = "adam"
    lr: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 64
    upload_codec: str = "raw"
    reply_timeout_s: float = 60.0  # per batch; the request is repeated up to reply_attempts times
    reply_attempts: int = 3
    eval_batch_samples: int = 256
    # The activation defences (shared_protocol/activation_guard.py), all off at 0.
    map_clip_norm: float = 0.0
    map_noise_multiplier: float = 0.0
    nopeek_alpha: float = 0.0

    def __post_init__(self) -> None:
        ActivationGuard.of(self)
        if self.local_epochs < 1 or self.batch_size < 1 or self.eval_batch_samples < 1 or self.reply_attempts < 1:
            raise ValueError("local_epochs, batch_size, eval_batch_samples and reply_attempts must be >= 1")
        check_optimizer(self.optimizer)
        if self.lr <= 0 or self.weight_decay < 0 or self.reply_timeout_s <= 0:
            raise ValueError("lr and reply_timeout_s must be > 0, weight_decay >= 0")
        if self.upload_codec not in ACTIVATION_CODECS:
            raise ValueError(f"upload_codec must be one of {ACTIVATION_CODECS}, got {self.upload_codec!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: dict) -> "SplitRoundConfig":
        return round_config_from_wire(cls, raw, "splitnn round config")


__all__ = [
    "ACTIVATION_CODECS",
    "SPLITS",
    "SplitActivations",
    "SplitExtractor",
    "SplitExtractorWeights",
    "SplitGradients",
    "SplitRoundConfig",
    "SplitServerModel",
]


# -- the registry's entry ------------------------------------------------------------ #

register_method(MethodSpec(
    name="splitnn",
    summary="vanilla split learning: agents take turns, the server answers every batch with its gradients",
    server="cloud_server.methods.splitnn",
    edge="edge_agent.methods.splitnn",
    config="cloud_server.methods.splitnn:SplitNNConfig",
    messages=(__name__,),
    flags=(
        LauncherFlag("--server-model", "resnet55_server", "the server's part: resnet55_server | resnet109_server"),
        LauncherFlag("--edge-epochs", 1, "epochs of local training per turn", type="int", minimum=1),
        LauncherFlag("--codec", None, "activations: raw (default) | fp16-zstd"),
    ),
    docs="docs/methods/baselines.md",
))
