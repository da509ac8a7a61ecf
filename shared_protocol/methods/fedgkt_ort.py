"""FedGKT with torch-free agents: the server ships onnxruntime-training artifacts.

An agent running ``--backend ort`` has no torch, so it cannot build the edge
model itself. In its first round it asks the server (``GktOrtArtifactsRequest``,
an upload within the round) and gets back, at once, the training / eval /
optimizer ONNX models and the initial checkpoint (``GktOrtArtifacts``), plus
what the agent cannot compute without torch: the model's state-dict layout and
its FLOPs per sample. Everything else -- feature uploads, server logits,
resends -- is plain FedGKT (:mod:`shared_protocol.methods.fedgkt`), so torch
and ort agents join one federation.

Imported by the FedGKT server step and by the ort edge step; torch agents never
see these types.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import ShapeMismatchError, ValueRangeError
from ..message_base import Message, register_message, tensor

ARTIFACT_FIELDS = ("training_model", "eval_model", "optimizer_model", "checkpoint")
META_KEYS = ("trainable", "bn_stats", "bn_counters", "state_names", "input_shape", "num_classes")
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024


def artifacts_sha256(blobs: dict[str, bytes]) -> str:
    """One digest over the four artifacts, in a fixed order."""
    h = hashlib.sha256()
    for name in ARTIFACT_FIELDS:
        data = blobs[name]
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


@register_message
@dataclass(kw_only=True)
class GktOrtArtifactsRequest(Message):
    """Agent -> server: send me the ort artifacts for this edge model and input shape."""

    TYPE: ClassVar[str] = "fedgkt.ort_artifacts_request"
    edge_model: str
    in_channels: int
    image_size: int
    num_classes: int
    runtime: str = ""  # e.g. "onnxruntime-training 1.19.2", for the server's log

    def validate(self) -> None:
        if not 1 <= self.in_channels <= 16 or not 8 <= self.image_size <= 1024 or not 1 <= self.num_classes <= 100_000:
            raise ValueRangeError(
                f"{self.TYPE}: in_channels {self.in_channels}, image_size {self.image_size} or num_classes {self.num_classes} out of range"
            )


@register_message
@dataclass(kw_only=True)
class GktOrtArtifacts(Message):
    """Server -> one agent: ONNX training artifacts as uint8 tensors, verified by ``sha256``.

    ``meta`` holds the state-dict layout (:class:`edge_agent.backends.ort.ArtifactMeta`
    fields); the weights inside follow the torch backend's names and shapes.
    """

    TYPE: ClassVar[str] = "fedgkt.ort_artifacts"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {name: "zstd" for name in ARTIFACT_FIELDS}
    edge_model: str
    sha256: str
    meta: dict
    train_flops_per_sample: int
    forward_flops_per_sample: int
    training_model: np.ndarray = tensor(("uint8",), ndim=1)
    eval_model: np.ndarray = tensor(("uint8",), ndim=1)
    optimizer_model: np.ndarray = tensor(("uint8",), ndim=1)
    checkpoint: np.ndarray = tensor(("uint8",), ndim=1)

    def blobs(self) -> dict[str, bytes]:
        return {name: np.ascontiguousarray(getattr(self, name)).tobytes() for name in ARTIFACT_FIELDS}

    def validate(self) -> None:
        missing = [k for k in META_KEYS if k not in self.meta]
        if missing:
            raise ValueRangeError(f"{self.TYPE}: meta lacks {missing}")
        total = sum(int(getattr(self, name).size) for name in ARTIFACT_FIELDS)
        if total > MAX_ARTIFACT_BYTES or any(getattr(self, name).size == 0 for name in ARTIFACT_FIELDS):
            raise ValueRangeError(f"{self.TYPE}: artifacts must be non-empty and at most {MAX_ARTIFACT_BYTES} bytes in all")
        if self.train_flops_per_sample < 0 or self.forward_flops_per_sample < 0:
            raise ValueRangeError(f"{self.TYPE}: FLOP counts must be >= 0")
        if artifacts_sha256(self.blobs()) != self.sha256:
            raise ShapeMismatchError(f"{self.TYPE}: artifacts do not match their sha256")
