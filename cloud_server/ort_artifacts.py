"""Serving onnxruntime-training artifacts to torch-free FedGKT agents.

The FedGKT server step hands every :class:`GktOrtArtifactsRequest` here. The
artifacts are generated once per (edge model, classes, input shape) -- about a
second -- from a fresh edge model initialised with the run's seed, and cached.
A server without onnx / onnxruntime-training answers with an ErrorReply that
says what to install, so the agent's round fails with a clear reason instead of
timing out.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from models import build_model, forward_flops_per_sample, training_flops_per_sample
from shared_protocol.messages import ErrorReply, Message
from shared_protocol.methods.fedgkt import GktRoundConfig
from shared_protocol.methods.fedgkt_ort import GktOrtArtifacts, GktOrtArtifactsRequest, artifacts_sha256

log = logging.getLogger("cloud_server.ort")


class OrtArtifactServer:
    def __init__(self, run_id: str, edge_model: str, num_classes: int, seed: int = 0,
                 train_extractor: bool = GktRoundConfig.train_extractor) -> None:
        self.run_id = run_id
        self.train_extractor = train_extractor  # fedgkt.train_extractor: False freezes the extractor in the training graph
        self.edge_model = edge_model
        self.num_classes = num_classes
        self.seed = seed
        self._cache: dict[tuple[int, int], GktOrtArtifacts | ErrorReply] = {}

    def reply(self, request: GktOrtArtifactsRequest) -> Message:
        base = {"run": self.run_id, "round": request.round, "sender": "server"}
        if request.edge_model != self.edge_model or request.num_classes != self.num_classes:
            return ErrorReply(**base, code="ort_mismatch", reason=(
                f"this run trains {self.edge_model} with {self.num_classes} classes; the agent asked for "
                f"{request.edge_model} with {request.num_classes}"), ref_msg_id=request.msg_id)
        key = (request.in_channels, request.image_size)
        if key not in self._cache:
            self._cache[key] = self._generate(*key)
        cached = self._cache[key]
        log.info("sending ort artifacts to %s (%s)", request.sender, request.runtime or "unknown runtime")
        if isinstance(cached, ErrorReply):
            return ErrorReply(**base, code=cached.code, reason=cached.reason, ref_msg_id=request.msg_id)
        fields = {name: getattr(cached, name) for name in ("edge_model", "sha256", "meta", "train_flops_per_sample",
                                                           "forward_flops_per_sample", "training_model", "eval_model",
                                                           "optimizer_model", "checkpoint")}
        return GktOrtArtifacts(**base, **fields)

    def _generate(self, in_channels: int, image_size: int) -> GktOrtArtifacts | ErrorReply:
        try:
            from models.onnx_export import OrtExportError, export_edge_artifacts
        except ImportError as exc:  # pragma: no cover - models.onnx_export only needs torch
            return ErrorReply(run=self.run_id, round=0, sender="server", code="ort_unavailable", reason=str(exc))
        # The run's own stream (the weights torch.manual_seed(seed) gives): forking torch's global
        # RNG does not keep other threads of the process from reseeding it meanwhile.
        model = build_model(self.edge_model, self.num_classes, in_channels, generator=torch.Generator().manual_seed(self.seed))
        shape = (in_channels, image_size, image_size)
        try:
            artifacts = export_edge_artifacts(model, self.num_classes, in_channels, image_size, train_extractor=self.train_extractor)
        except OrtExportError as exc:
            log.error("cannot generate ort artifacts: %s", exc)
            return ErrorReply(run=self.run_id, round=0, sender="server", code="ort_unavailable", reason=str(exc)[:500])
        blobs = {"training_model": artifacts.training_model, "eval_model": artifacts.eval_model,
                 "optimizer_model": artifacts.optimizer_model, "checkpoint": artifacts.checkpoint}
        meta = {"trainable": list(artifacts.trainable), "bn_stats": list(artifacts.bn_stats),
                "bn_counters": list(artifacts.bn_counters), "state_names": list(artifacts.state_names),
                "input_shape": list(artifacts.input_shape), "num_classes": artifacts.num_classes}
        log.info("generated ort artifacts for %s %s: %d bytes", self.edge_model, shape, sum(map(len, blobs.values())))
        return GktOrtArtifacts(
            run=self.run_id, round=0, sender="server", edge_model=self.edge_model, sha256=artifacts_sha256(blobs), meta=meta,
            train_flops_per_sample=training_flops_per_sample(model, shape), forward_flops_per_sample=forward_flops_per_sample(model, shape),
            **{name: np.frombuffer(blob, dtype=np.uint8).copy() for name, blob in blobs.items()},
        )
