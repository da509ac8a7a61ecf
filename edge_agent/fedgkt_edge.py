"""FedGKT's edge protocol, once for both training backends (no torch here).

What a FedGKT agent says and answers does not depend on what trains its
ResNet-8: parse the round's :class:`GktRoundConfig`, train ``edge_epochs`` with
``CE + alpha * KD(server logits)``, then stream eval-mode feature maps, edge
logits, labels and sample ids batch by batch (never all maps in memory), keep
the server logits that come back by sample id, re-extract exactly the batches a
:class:`GktResendRequest` names, and persist model and teacher in one format. Maps
go up once: a batch whose maps the server holds (the round config's ``held_maps``
names the digest this agent's extractor and codec give) goes up as its logits and
sample ids (:class:`GktReusedMaps`); a :class:`GktMapsRequest` gets them in full.
:class:`FedGktEdgeBase` does all of that; a backend fills in the model:

* ``edge_agent/methods/fedgkt.py`` -- torch (the shared training loop);
* ``edge_agent/backends/ort_fedgkt.py`` -- onnxruntime-training and numpy, for
  devices without torch.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fldata import ArrayDataset
from shared_protocol.errors import StaleMessageError
from shared_protocol.messages import EvalRequest, Message, RoundStart
from shared_protocol.methods.fedgkt import (
    GktEvalModel,
    GktFeatures,
    GktMapsRequest,
    GktResendRequest,
    GktReusedMaps,
    GktRoundConfig,
    GktServerLogits,
)

from shared_protocol.activation_guard import ActivationGuard

from .activation_guard import protect_maps
from .costs import DeclaredFlops, RoundMeter, SampleFlops
from .methods.base import EdgeContext, EdgeMethod, EvalAnswer, RoundResult, shard_result
from .teacher import EXTRACT_BATCH_SAMPLES, TeacherLogits

__all__ = ["FedGktEdgeBase", "maps_digest"]

#: The prefix of the extractor's entries in the edge model's state (torch state-dict names, which
#: the ort backend keeps too).
EXTRACTOR_PREFIX = "extractor."


def maps_digest(model_arrays: Mapping[str, np.ndarray], codec: str) -> str:
    """sha256 over what determines the maps an agent uploads: the extractor's weights and
    BatchNorm buffers (every ``extractor.*`` entry of the model's state, by name, with dtype
    and shape) and the codec they are encoded with. The same digest on the same sample ids
    means the same maps, byte for byte after the codec (extraction runs in eval mode).
    ``""`` for a model without extractor entries (nothing to vouch for)."""
    names = sorted(k for k in model_arrays if k.startswith(EXTRACTOR_PREFIX))
    if not names:
        return ""
    h = hashlib.sha256(f"codec={codec}\n".encode())
    for name in names:
        array = np.ascontiguousarray(model_arrays[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}\n".encode())
        h.update(array.tobytes())
    return h.hexdigest()


class FedGktEdgeBase(EdgeMethod):
    """FedGKT's edge step without its model: the protocol, the round, local persistence."""

    name = "fedgkt"
    #: Whether the backend can add NoPeek's loss (``nopeek_alpha``) to its training, and draw its
    #: initial weights from the agent's private key (``edge_init = "per_agent"``).
    supports_nopeek = False
    private_init = False

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.num_classes = int(ctx.settings["num_classes"])
        self.edge_model = str(ctx.settings.get("edge_model", "resnet8"))
        self.teacher = TeacherLogits(self.num_classes)
        self.optimizer: Any = None
        self._optimizer_key: tuple | None = None
        self._last_round: tuple[RoundStart, GktRoundConfig] | None = None
        # The edge model's FLOPs per sample (the backend counts or is told them): training is
        # metered by the backend's loop, feature extraction and evaluation here.
        self.flops: SampleFlops = DeclaredFlops()
        # Samples per inference pass (extraction, evaluation): the micro-batch when the agent
        # saves memory (eval-mode outputs do not depend on the slicing).
        self.slice_samples = min(ctx.memory.micro_batch_samples or EXTRACT_BATCH_SAMPLES, EXTRACT_BATCH_SAMPLES)
        # A private extractor is scored here: the server model of the round being evaluated.
        self.eval_model: GktEvalModel | None = None

    # -- what a backend provides ---------------------------------------------- #

    @abstractmethod
    def _prepare(self, start: RoundStart, meter: RoundMeter) -> None:
        """Make the model ready for ``start``'s round (initial weights, artifacts)."""

    @abstractmethod
    def _new_optimizer(self, cfg: GktRoundConfig) -> Any:
        """An optimiser for ``cfg``'s edge settings (kept while they do not change)."""

    @abstractmethod
    def _train(self, start: RoundStart, cfg: GktRoundConfig, optimizer: Any, meter: RoundMeter) -> tuple[int, float]:
        """``cfg.edge_epochs`` of local training against :attr:`teacher`, skipping the batches
        that cannot finish within ``meter.deadline``, metered (``meter.trained``) by the
        backend's training loop; (samples, mean loss)."""

    @abstractmethod
    def _batches(self, data: ArrayDataset, batch_samples: int) -> Iterable[tuple[Any, np.ndarray, np.ndarray]]:
        """``data``'s (images in the backend's form, labels, sample ids) in a fixed order,
        ``batch_samples`` at a time, with the model in eval mode: a re-extracted batch must be
        the batch first sent."""

    def _upload_batches(self, split: str, batch_samples: int) -> Iterable[tuple[Any, np.ndarray, np.ndarray]]:
        return self._batches(self.ctx.train if split == "train" else self.ctx.test, batch_samples)

    @abstractmethod
    def _extract(self, images: Any) -> tuple[np.ndarray, np.ndarray]:
        """(feature maps (B, 16, H, W), logits (B, K)) of one upload batch, float32."""

    @abstractmethod
    def _model_arrays(self) -> dict[str, np.ndarray]:
        """The model's state as arrays ({} when there is no model yet)."""

    @abstractmethod
    def _load_model_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore :meth:`_model_arrays` (possibly {} from an agent that had no model yet)."""

    def _ready(self) -> bool:
        """Whether the model exists (to answer a resend request with)."""
        return True

    # -- downloads -------------------------------------------------------------- #

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, GktServerLogits):
            self.teacher.update(msg.sample_ids, msg.logits)
            return True
        if isinstance(msg, (GktResendRequest, GktMapsRequest)):
            self._resend(msg)
            return True
        if isinstance(msg, GktEvalModel):
            self.eval_model = msg
            return True
        return False

    def _resend(self, request: GktResendRequest | GktMapsRequest) -> None:
        """Re-extract the requested batches (the model has not changed since the upload:
        the same deterministic order gives the same batches) and send them again; in full
        (maps included) when the server asks for maps it does not hold."""
        if self._last_round is None or self._last_round[0].round != request.round or not self._ready():
            return  # not our latest round: nothing to resend
        start, cfg = self._last_round
        self._stream_features(request.split, start.round, cfg, RoundMeter(), only=set(request.seqs),
                              full=isinstance(request, GktMapsRequest))
        self.ctx.resend_round_end()

    # -- the round --------------------------------------------------------------- #

    def _optimizer_for(self, cfg: GktRoundConfig) -> Any:
        key = (cfg.edge_optimizer, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay, cfg.train_extractor)
        if self.optimizer is None or key != self._optimizer_key:
            self.optimizer = self._new_optimizer(cfg)
            self._optimizer_key = key
        return self.optimizer

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = GktRoundConfig.from_dict(start.config)
        if ActivationGuard.of(cfg).nopeek and not self.supports_nopeek:
            raise ValueError(f"nopeek_alpha = {cfg.nopeek_alpha}: the {type(self).__name__} backend cannot add NoPeek's "
                             "loss; use the torch backend, or nopeek_alpha = 0")
        if self.ctx.settings.get("edge_init") == "per_agent" and not self.private_init:
            raise ValueError(f"edge_init = 'per_agent': the {type(self).__name__} backend starts from the server's "
                             "artifacts, which the server holds; use the torch backend, or edge_init = 'shared'")
        self._last_round = (start, cfg)
        self._prepare(start, meter)
        with meter.phase("compute"):
            _, mean_loss = self._train(start, cfg, self._optimizer_for(cfg), meter)
        uploads = {"train": self._stream_features("train", start.round, cfg, meter)}
        metrics: dict[str, Any] = {"train_loss": mean_loss, "kd_samples": len(self.teacher)}
        return RoundResult(num_samples=uploads["train"]["samples"], uploads=uploads, metrics=metrics)

    def _extractor_private(self, cfg: GktRoundConfig) -> bool:
        """Whether this extractor is this agent's alone (the server's ``private_extractor``):
        drawn from the agent's private key, or trained on its data."""
        return self.ctx.settings.get("edge_init", "shared") != "shared" or cfg.train_extractor

    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """The deployed model is this extractor followed by the server's model: stream the
        test shard's maps (the server scores them: the local figure), score the ResNet-8 on
        them in the same pass, and send the ResNet-8 itself (about 42 KB) for the server to
        score the extractor + its model on the global test set. The ResNet-8 lives here, so
        it is scored here on the global set too, when the request names it."""
        if self._last_round is None or not self._ready():
            return EvalAnswer()  # no model trained here yet (a restarted agent): nothing to evaluate
        _, cfg = self._last_round
        if self._extractor_private(cfg) or self.eval_model is not None:  # scored here, nothing of it sent
            if self.eval_model is None or self.eval_model.round != request.round or not request.public_set.dataset:
                held = self.eval_model.round if self.eval_model is not None else None
                raise StaleMessageError(f"eval_request for round {request.round} without the server model and the public "
                                        f"set to score the private extractor with (held: round {held}, public set "
                                        f"{request.public_set.dataset or 'not named'})")
            return self._evaluate_private(request, self.eval_model, meter)
        test = self._stream_features("test", request.round, cfg, meter)
        meter.forward(self.flops, test["samples"])
        correct = test.pop("correct")
        global_results = {}
        if request.public_set.dataset:
            public = self.ctx.public_set(request.public_set, meter, request.round)  # once per run
            global_results["edge"] = self._score_edge(public, meter)
        return EvalAnswer(results={"edge": shard_result(correct, test["samples"])}, global_results=global_results,
                          models={"edge": self._model_arrays()}, uploads={"test": test})

    def _score_edge(self, data: ArrayDataset, meter: RoundMeter) -> dict[str, Any]:
        """The ResNet-8's figures on ``data`` (eval mode), its forward passes metered."""
        correct = 0
        with meter.phase("compute"):
            for images, labels, _ids in self._batches(data, EXTRACT_BATCH_SAMPLES):
                _maps, logits = self._extract(images)  # (B, 16, H, W), (B, K)
                correct += int((logits.argmax(axis=1) == labels).sum())
            meter.forward(self.flops, len(data))
        return shard_result(correct, len(data))

    def _evaluate_private(self, request: EvalRequest, server_model: GktEvalModel, meter: RoundMeter) -> EvalAnswer:
        """Score this extractor + the server model (``model``; ``personalised_bn`` with the
        statistics the server sent) and the ResNet-8 (``edge``) on the public global set the
        request names and on the local test shard."""
        raise ValueError(f"a private extractor is scored on the device with the server model, which the "
                         f"{type(self).__name__} backend cannot run: use the torch backend, or a shared frozen extractor "
                         "([fedgkt] edge_init = \"shared\", train_extractor = false)")

    def _stream_features(self, split: str, round_: int, cfg: GktRoundConfig, meter: RoundMeter,
                         only: set[int] | None = None, full: bool = False) -> dict[str, int]:
        """Extract (eval mode) and send batch by batch; at most one batch of maps in memory.
        For the test split also counts the edge model's correct predictions (``correct``).
        When the server holds this split's maps with the digest this extractor and codec give
        (and ``full`` is not asked), a batch goes up as its logits and sample ids (``reused``
        counts those batches): the logits still need the extraction, the maps not the link."""
        ctx = self.ctx
        batches = samples = correct = reused = 0
        guard = ActivationGuard.of(cfg)
        # The guard's parameters are part of what determines the maps: other noise, other maps.
        digest = maps_digest(self._model_arrays(), cfg.upload_codec + "".join(f"|{k}={v}" for k, v in guard.describe().items()))
        reuse = (cfg.reuse_maps and not cfg.train_extractor and not full
                 and cfg.held_maps.get(split) == digest)
        # A memory-saving agent sends smaller messages than the server allows (the server bounds
        # their size from above only); the same size every time, so a resend names the same batches.
        batch_samples = ctx.memory.upload_batch_samples(cfg.upload_batch_samples)
        for seq, (images, labels, sample_ids) in enumerate(self._upload_batches(split, batch_samples)):
            if only is not None and seq not in only:
                continue
            with meter.phase("compute"):
                features, logits = self._extract(images)  # (B, C, H, W), (B, K)
                if not reuse:
                    # One release per (split, digest): the same maps sent again carry the same noise.
                    features = protect_maps(features, guard, ctx.key(), f"{split}/{digest}", sample_ids)
            correct += int((logits.argmax(axis=1) == labels).sum())
            base = dict(run=ctx.run_id, round=round_, sender=ctx.agent_id, split=split, seq=seq, instance=ctx.instance,
                        maps_digest=digest)
            if reuse:
                del features  # the server holds them
                ctx.send(GktReusedMaps(**base, logits=logits, sample_ids=sample_ids.astype(np.int64)), meter)
                reused += 1
            else:
                msg = GktFeatures(**base, features=features, logits=logits,
                                  labels=labels.astype(np.int64), sample_ids=sample_ids.astype(np.int64))
                ctx.send(msg, meter, codecs={"features": cfg.upload_codec})
            batches += 1
            samples += len(labels)
        info = {"batches": batches, "samples": samples, **({"reused": reused} if reused else {})}
        if split == "train":
            meter.forward(self.flops, samples)
            return info
        return {**info, "correct": correct}

    @staticmethod
    def _fill_slices(total: int, parts: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """One upload batch's (features, logits) from ``(start, features, logits)`` slices of it,
        computed a slice at a time (``slice_samples``) into the arrays the message carries."""
        features = logits = None
        for start, part_features, part_logits in parts:
            if features is None or logits is None:
                features = np.empty((total, *part_features.shape[1:]), np.float32)
                logits = np.empty((total, part_logits.shape[1]), np.float32)
            features[start : start + part_features.shape[0]] = part_features
            logits[start : start + part_features.shape[0]] = part_logits
        if features is None or logits is None:
            raise ValueError("an upload batch has no samples")
        return features, logits

    # -- local persistence --------------------------------------------------------- #

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = {f"model/{k}": v for k, v in self._model_arrays().items()}
        state["teacher/ids"] = self.teacher.ids
        state["teacher/logits"] = self.teacher.logits
        # The key the noise on this agent's maps is drawn from: a restarted agent re-sends the same noisy maps.
        state["guard/key"] = np.frombuffer(self.ctx.key(), dtype=np.uint8).copy()
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if "guard/key" in arrays:
            self.ctx.private_key = bytes(np.asarray(arrays["guard/key"], dtype=np.uint8))
        self._load_model_arrays({k[6:]: v for k, v in arrays.items() if k.startswith("model/")})
        if "teacher/ids" in arrays:
            self.teacher = TeacherLogits(self.num_classes)
            self.teacher.update(arrays["teacher/ids"], arrays["teacher/logits"])
