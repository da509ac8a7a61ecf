"""FedGKT edge step on the ort backend: onnxruntime-training + numpy, no torch.

The same round as :mod:`edge_agent.methods.fedgkt` -- the protocol is their
common base, :class:`edge_agent.fedgkt_edge.FedGktEdgeBase` -- with the model in
ONNX artifacts the server generated and shipped (:mod:`shared_protocol.methods.fedgkt_ort`).
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

from fldata import ArrayDataset
from fldata.numpy_data import Normalizer, iterate_batches
from shared_protocol.messages import ErrorReply, RoundStart
from shared_protocol.methods.fedgkt import GktRoundConfig
from shared_protocol.methods.fedgkt_ort import GktOrtArtifacts, GktOrtArtifactsRequest

from ..costs import DeclaredFlops, RoundMeter
from ..fedgkt_edge import FedGktEdgeBase
from ..methods.base import EdgeContext
from .optim import NumpyAdam, NumpySGD, make_numpy_optimizer
from .ort import ArtifactMeta, OrtEdgeModel, ort_version

log = logging.getLogger("edge_agent.ort")

ARTIFACT_TIMEOUT_S = 300.0


class OrtFedGktEdge(FedGktEdgeBase):
    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.model: OrtEdgeModel | None = None
        self._pending_state: dict[str, np.ndarray] | None = None
        self.normalizer = Normalizer.for_dataset(ctx.train)
        self.threads = int(os.environ.get("EDGESPLIT_ORT_THREADS", "1"))
        self.cache_root = Path(os.environ.get("EDGESPLIT_ORT_CACHE") or tempfile.gettempdir()) / "edgesplit-ort"

    # -- artifacts ----------------------------------------------------------- #

    def _prepare(self, start: RoundStart, meter: RoundMeter) -> None:
        if self.model is not None:
            return
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
        self.flops = DeclaredFlops(training=reply.train_flops_per_sample, forward=reply.forward_flops_per_sample)
        if self._pending_state is not None:
            self.model.load_arrays(self._pending_state)
            self._pending_state = None
        log.info("ort artifacts %s loaded (%d bytes)", reply.sha256[:12], sum(len(b) for b in reply.blobs().values()))

    # -- the round ----------------------------------------------------------- #

    def _ready(self) -> bool:
        return self.model is not None

    def _new_optimizer(self, cfg: GktRoundConfig) -> NumpySGD | NumpyAdam:
        return make_numpy_optimizer(cfg.edge_optimizer, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay)

    def _train(self, start: RoundStart, cfg: GktRoundConfig, optimizer: NumpySGD | NumpyAdam,
               meter: RoundMeter) -> tuple[int, float]:
        model, ctx = self.model, self.ctx
        assert model is not None  # _prepare made it
        trains_extractor = any(name.startswith("extractor.") for name in model.meta.trainable)
        if trains_extractor != cfg.train_extractor:
            raise RuntimeError(f"the server's ort artifacts {'train' if trains_extractor else 'freeze'} the extractor, "
                               f"its round config says train_extractor = {cfg.train_extractor}")
        use_kd = cfg.edge_kd and cfg.alpha > 0 and len(self.teacher) > 0
        samples = 0
        total_loss = 0.0
        for epoch in range(cfg.edge_epochs):
            seed = (ctx.seed + start.round) * 1000 + epoch
            batches = iterate_batches(ctx.train, cfg.batch_size, shuffle=True, seed=seed, augment=ctx.augment,
                                      normalizer=self.normalizer)
            for images, labels, ids in meter.deadline.batches(batches, length=-(-len(ctx.train) // cfg.batch_size)):
                if use_kd:
                    teacher, found = self.teacher.lookup(ids)
                else:
                    teacher, found = np.zeros((len(ids), self.num_classes), np.float32), np.zeros(len(ids), bool)
                loss, _ = model.train_step(images, labels, teacher, found.astype(np.float32), cfg.temperature,
                                           cfg.alpha if use_kd else 0.0, optimizer, micro_batch=ctx.memory.micro_batch_samples or None)
                if not math.isfinite(loss):
                    raise RuntimeError(f"{ctx.agent_id} round {start.round}: loss is {loss}")
                samples += len(labels)
                total_loss += loss * len(labels)
                meter.trained(len(labels), self.flops.training)  # this backend's loop meters its steps
        return samples, total_loss / samples if samples else 0.0

    def _batches(self, data: ArrayDataset, batch_samples: int):  # -> Iterator[(images (B, C, H, W), labels, ids)]
        return iterate_batches(data, batch_samples, normalizer=self.normalizer)

    def _extract(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        model = self.model
        assert model is not None

        def slices():  # -> Iterator[(start, maps (b, 16, H, W), logits (b, K))]
            for start in range(0, images.shape[0], self.slice_samples):
                part_logits, part = model.forward_eval(images[start : start + self.slice_samples])  # (b, K), (b, 16, H, W)
                yield start, part, part_logits

        return self._fill_slices(images.shape[0], slices())

    # -- local persistence (the torch backend's format) ------------------------ #

    def _model_arrays(self) -> dict[str, np.ndarray]:
        return {} if self.model is None else self.model.arrays()

    def _load_model_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if not arrays:
            return
        if self.model is None:
            self._pending_state = arrays  # applied when the artifacts arrive
        else:
            self.model.load_arrays(arrays)
