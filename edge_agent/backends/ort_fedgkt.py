"""FedGKT edge step on the ort backend: onnxruntime-training + numpy, no torch.

The same round as :mod:`edge_agent.methods.fedgkt` -- train ResNet-8 with
``CE + alpha * KD(server logits)``, then stream eval-mode feature maps, edge
logits, labels and sample ids batch by batch -- with the model in ONNX
artifacts the server generated and shipped (:mod:`shared_protocol.methods.fedgkt_ort`).
The first round asks for them; they are cached by sha256 in the agent's state
directory (or a temporary one), so a restarted agent asks again only when the
server's model changed.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from fldata.numpy_data import Normalizer, iterate_batches
from shared_protocol.messages import ErrorReply, Message, RoundStart
from shared_protocol.methods.fedgkt import GktFeatures, GktResendRequest, GktRoundConfig, GktServerLogits
from shared_protocol.methods.fedgkt_ort import GktOrtArtifacts, GktOrtArtifactsRequest

from ..costs import RoundMeter
from ..methods.base import EdgeContext, EdgeMethod, RoundResult
from ..teacher import EXTRACT_BATCH_SAMPLES, TeacherLogits
from .optim import make_numpy_optimizer
from .ort import ArtifactMeta, OrtEdgeModel, ort_version

log = logging.getLogger("edge_agent.ort")

ARTIFACT_TIMEOUT_S = 300.0


class OrtFedGktEdge(EdgeMethod):
    name = "fedgkt"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.num_classes = int(ctx.settings["num_classes"])
        self.edge_model = str(ctx.settings.get("edge_model", "resnet8"))
        self.teacher = TeacherLogits(self.num_classes)
        self.model: OrtEdgeModel | None = None
        self.optimizer = None
        self._optimizer_key: tuple | None = None
        self._pending_state: dict[str, np.ndarray] | None = None
        self._last_round: tuple[RoundStart, GktRoundConfig] | None = None
        self.train_flops_per_sample = self.forward_flops_per_sample = 0
        self.normalizer = Normalizer.for_dataset(ctx.train)
        self.threads = int(os.environ.get("EDGESPLIT_ORT_THREADS", "1"))
        self.cache_root = Path(os.environ.get("EDGESPLIT_ORT_CACHE") or tempfile.gettempdir()) / "edgesplit-ort"

    # -- artifacts ----------------------------------------------------------- #

    def _ensure_model(self, start: RoundStart, meter: RoundMeter) -> OrtEdgeModel:
        if self.model is not None:
            return self.model
        c, h, w = self.ctx.train.image_shape
        if h != w:
            raise ValueError(f"the ort backend needs square images, got {h}x{w}")
        request = GktOrtArtifactsRequest(
            run=self.ctx.run_id, round=start.round, sender=self.ctx.agent_id, edge_model=self.edge_model,
            in_channels=c, image_size=h, num_classes=self.num_classes, runtime=f"onnxruntime-training {ort_version()}",
        )
        reply = self.ctx.request(
            request, meter, lambda m: isinstance(m, (GktOrtArtifacts, ErrorReply)), timeout_s=ARTIFACT_TIMEOUT_S,
        )
        if isinstance(reply, ErrorReply):
            raise RuntimeError(f"the server cannot provide ort artifacts: {reply.reason}")
        assert isinstance(reply, GktOrtArtifacts)
        directory = self.cache_root / reply.sha256[:32]
        directory.mkdir(parents=True, exist_ok=True)
        for name, blob in reply.blobs().items():
            target = directory / (name if name == "checkpoint" else f"{name}.onnx")
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, target)
        meta = ArtifactMeta(
            trainable=tuple(reply.meta["trainable"]), bn_stats=tuple(reply.meta["bn_stats"]),
            bn_counters=tuple(reply.meta["bn_counters"]), state_names=tuple(reply.meta["state_names"]),
            input_shape=tuple(reply.meta["input_shape"]), num_classes=int(reply.meta["num_classes"]),
        )
        if meta.num_classes != self.num_classes or tuple(meta.input_shape) != (c, h, w):
            raise ValueError(f"artifacts are for {meta.input_shape} / {meta.num_classes} classes, this agent has {(c, h, w)} / {self.num_classes}")
        self.model = OrtEdgeModel(directory, meta, threads=self.threads)
        self.train_flops_per_sample = reply.train_flops_per_sample
        self.forward_flops_per_sample = reply.forward_flops_per_sample
        if self._pending_state is not None:
            self.model.load_arrays(self._pending_state)
            self._pending_state = None
        log.info("ort artifacts %s loaded (%d bytes)", reply.sha256[:12], sum(len(b) for b in reply.blobs().values()))
        return self.model

    # -- downloads ----------------------------------------------------------- #

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, GktServerLogits):
            self.teacher.update(msg.sample_ids, msg.logits)
            return True
        if isinstance(msg, GktResendRequest):
            if self._last_round is not None and self._last_round[0].round == msg.round and self.model is not None:
                start, cfg = self._last_round
                self._stream_features(msg.split, start, cfg, RoundMeter(), only=set(msg.seqs))
                self.ctx.resend_round_end()
            return True
        return False

    # -- the round ----------------------------------------------------------- #

    def _optimizer_for(self, cfg: GktRoundConfig):  # type: ignore[no-untyped-def]
        key = (cfg.edge_optimizer, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay)
        if self.optimizer is None or key != self._optimizer_key:
            self.optimizer = make_numpy_optimizer(cfg.edge_optimizer, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay)
            self._optimizer_key = key
        return self.optimizer

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = GktRoundConfig.from_dict(start.config)
        self._last_round = (start, cfg)
        model = self._ensure_model(start, meter)
        ctx = self.ctx
        use_kd = cfg.edge_kd and cfg.alpha > 0 and len(self.teacher) > 0
        optimizer = self._optimizer_for(cfg)
        samples = 0
        total_loss = 0.0
        with meter.phase("compute"):
            for epoch in range(cfg.edge_epochs):
                seed = (ctx.seed + start.round) * 1000 + epoch
                for images, labels, ids in iterate_batches(ctx.train, cfg.batch_size, shuffle=True, seed=seed,
                                                           augment=ctx.augment, normalizer=self.normalizer):
                    if use_kd:
                        teacher, found = self.teacher.lookup(ids)
                    else:
                        teacher, found = np.zeros((len(ids), self.num_classes), np.float32), np.zeros(len(ids), bool)
                    loss, _ = model.train_step(images, labels, teacher, found.astype(np.float32), cfg.temperature,
                                               cfg.alpha if use_kd else 0.0, optimizer)
                    if not math.isfinite(loss):
                        raise RuntimeError(f"{ctx.agent_id} round {start.round}: loss is {loss}")
                    samples += len(labels)
                    total_loss += loss * len(labels)
        meter.samples_trained += samples
        meter.train_flops += self.train_flops_per_sample * samples
        uploads = {"train": self._stream_features("train", start, cfg, meter)}
        metrics: dict = {"train_loss": total_loss / samples if samples else 0.0, "kd_samples": len(self.teacher)}
        if start.evaluate:
            correct = total = 0
            with meter.phase("compute"):
                for images, labels, _ in iterate_batches(ctx.test, EXTRACT_BATCH_SAMPLES, normalizer=self.normalizer):
                    logits, _ = model.forward_eval(images)
                    correct += int((logits.argmax(axis=1) == labels).sum())
                    total += len(labels)
            meter.train_flops += self.forward_flops_per_sample * total
            metrics.update(edge_correct=correct, edge_total=total, edge_accuracy=correct / total if total else None)
            uploads["test"] = self._stream_features("test", start, cfg, meter)
        return RoundResult(num_samples=uploads["train"]["samples"], uploads=uploads, metrics=metrics)

    def _stream_features(self, split: str, start: RoundStart, cfg: GktRoundConfig, meter: RoundMeter, only: set[int] | None = None) -> dict:
        """Extract (eval mode) and send batch by batch; at most one batch of maps in memory."""
        assert self.model is not None
        ctx = self.ctx
        data = ctx.train if split == "train" else ctx.test
        batches = samples = 0
        for seq, (images, labels, ids) in enumerate(iterate_batches(data, cfg.upload_batch_samples, normalizer=self.normalizer)):
            if only is not None and seq not in only:
                continue
            with meter.phase("compute"):
                logits, features = self._extract(images)  # (B, K), (B, 16, H, W)
            msg = GktFeatures(
                run=ctx.run_id, round=start.round, sender=ctx.agent_id, split=split, seq=seq, instance=ctx.instance,
                features=features, logits=logits,
                labels=labels.astype(np.int64), sample_ids=ids.astype(np.int64),
            )
            ctx.send(msg, meter, codecs={"features": cfg.upload_codec})
            batches += 1
            samples += len(labels)
        if split == "train":
            meter.train_flops += self.forward_flops_per_sample * samples
        return {"batches": batches, "samples": samples}

    def _extract(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits and feature maps of one upload batch, a slice at a time (see ``EXTRACT_BATCH_SAMPLES``)."""
        assert self.model is not None
        logits = features = None
        for start in range(0, images.shape[0], EXTRACT_BATCH_SAMPLES):
            part_logits, part = self.model.forward_eval(images[start : start + EXTRACT_BATCH_SAMPLES])  # (b, K), (b, 16, H, W)
            if logits is None or features is None:
                logits = np.empty((images.shape[0], part_logits.shape[1]), np.float32)
                features = np.empty((images.shape[0], *part.shape[1:]), np.float32)
            logits[start : start + part.shape[0]] = part_logits
            features[start : start + part.shape[0]] = part
        assert logits is not None and features is not None  # iterate_batches never yields an empty batch
        return logits, features

    # -- local persistence (the torch backend's format) ------------------------ #

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = {} if self.model is None else {f"model/{k}": v for k, v in self.model.arrays().items()}
        state["teacher/ids"] = self.teacher.ids
        state["teacher/logits"] = self.teacher.logits
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        model_arrays = {k[6:]: v for k, v in arrays.items() if k.startswith("model/")}
        if model_arrays:
            if self.model is None:
                self._pending_state = model_arrays  # applied when the artifacts arrive
            else:
                self.model.load_arrays(model_arrays)
        if "teacher/ids" in arrays:
            self.teacher = TeacherLogits(self.num_classes)
            self.teacher.update(arrays["teacher/ids"], arrays["teacher/logits"])
