"""FedGKT edge step (He et al. 2020, Algorithm 1 ClientTrain, Eq. 7).

Each round: train the ResNet-8 for ``edge_epochs`` with
``CE + alpha * KD(server logits -> edge)`` (CE only until server logits exist),
then run the extractor in eval mode over the shard and stream feature maps H,
edge logits z_c, labels and sample ids batch by batch, never holding all maps
in memory. Server logits come back keyed by sample id and are looked up by id
in the next round, whatever order the loader shuffles the samples into.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fldata.torch_data import make_loader
from models import build_model, forward_flops_per_sample, load_arrays_into, state_dict_to_arrays, training_flops_per_sample
from models.losses import kd_loss
from shared_protocol.messages import Message, RoundStart
from shared_protocol.methods.fedgkt import GktFeatures, GktResendRequest, GktRoundConfig, GktServerLogits

from ..costs import RoundMeter
from ..teacher import EXTRACT_BATCH_SAMPLES, TeacherLogits  # shared with the ort backend
from ..memory import lighten_model
from ..trainer import accuracy, make_optimizer, train_epochs
from .base import EdgeContext, EdgeMethod, RoundResult, register_edge_method


_FLOPS_CACHE: dict[tuple, tuple[int, int]] = {}


def _flops(name: str, model: torch.nn.Module, shape: tuple[int, ...]) -> tuple[int, int]:
    """(training, forward) FLOPs per sample; counted once per architecture and input shape
    (FLOPs depend on shapes only, and counting is slow)."""
    key = (name, shape, sum(p.numel() for p in model.parameters()))
    if key not in _FLOPS_CACHE:
        _FLOPS_CACHE[key] = (training_flops_per_sample(model, shape), forward_flops_per_sample(model, shape))
    return _FLOPS_CACHE[key]


@register_edge_method
class FedGktEdge(EdgeMethod):
    name = "fedgkt"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        settings = ctx.settings
        self.num_classes = int(settings["num_classes"])
        self.model = build_model(settings.get("edge_model", "resnet8"), self.num_classes, ctx.train.in_channels).to(ctx.device)
        self.teacher = TeacherLogits(self.num_classes)
        self.optimizer: torch.optim.Optimizer | None = None
        self._last_round: tuple[RoundStart, GktRoundConfig] | None = None
        self._optimizer_key: tuple | None = None
        self.trained = False  # True once this model has trained a round (or was restored)
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        self.train_flops_per_sample, self.forward_flops_per_sample = _flops(settings.get("edge_model", "resnet8"), self.model, shape)
        # After counting: the reported FLOPs are the method's; --low-memory's recomputation
        # (about +30 % of a training step's FLOPs for ResNet-8) is documented, not counted.
        self.model = lighten_model(self.model)

    # -- downloads --------------------------------------------------------- #

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, GktServerLogits):
            self.teacher.update(msg.sample_ids, msg.logits)
            return True
        if isinstance(msg, GktResendRequest):
            self._resend(msg)
            return True
        return False

    def _resend(self, request: GktResendRequest) -> None:
        """Re-extract the requested batches (the model has not changed since the upload:
        the same deterministic loader gives the same batches) and send them again."""
        if self._last_round is None or self._last_round[0].round != request.round:
            return  # not our latest round: nothing to resend
        start, cfg = self._last_round
        self._stream_features(request.split, start, cfg, RoundMeter(), only=set(request.seqs))
        self.ctx.resend_round_end()

    # -- the round --------------------------------------------------------- #

    def _optimizer_for(self, cfg: GktRoundConfig) -> torch.optim.Optimizer:
        key = (cfg.edge_optimizer, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay)
        if self.optimizer is None or key != self._optimizer_key:
            self.optimizer = make_optimizer(cfg.edge_optimizer, self.model.parameters(), cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay)
            self._optimizer_key = key
        return self.optimizer

    def loss_fn(self, cfg: GktRoundConfig):  # type: ignore[no-untyped-def]
        """Eq. 7: CE + alpha * KD(z_s -> z_c), KD only for samples with a server logit."""

        def loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            logits, _features = output  # (B, K), (B, 16, H, W)
            value = F.cross_entropy(logits, labels)
            if cfg.edge_kd and cfg.alpha > 0 and len(self.teacher):
                teacher, found = self.teacher.lookup(sample_ids.numpy())
                if found.any():
                    mask = torch.from_numpy(found).to(logits.device)
                    value = value + cfg.alpha * kd_loss(logits[mask], torch.from_numpy(teacher[found]).to(logits.device), cfg.temperature)
            return value

        return loss

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = GktRoundConfig.from_dict(start.config)
        self._last_round = (start, cfg)
        ctx = self.ctx
        if start.weights and not self.trained:
            # The server's common initialisation (fedgkt.edge_init = "shared"): every agent's
            # extractor starts in the same feature space.
            load_arrays_into(self.model, start.weights)
        self.trained = True
        with meter.phase("compute"):
            loader = meter.deadline.batches(make_loader(ctx.train, cfg.batch_size, shuffle=True, augment=ctx.augment, seed=ctx.seed + start.round))
            result = train_epochs(
                self.model, loader, self._optimizer_for(cfg), self.loss_fn(cfg), cfg.edge_epochs,
                device=ctx.device, progress=ctx.progress, desc=f"{ctx.agent_id} round {start.round}",
            )
        meter.samples_trained += result.samples
        meter.train_flops += self.train_flops_per_sample * result.samples
        uploads = {"train": self._stream_features("train", start, cfg, meter)}
        metrics: dict = {"train_loss": result.mean_loss, "kd_samples": len(self.teacher)}
        if start.evaluate:
            with meter.phase("compute"):
                self.model.eval()
                test_loader = make_loader(ctx.test, EXTRACT_BATCH_SAMPLES)
                correct, total = accuracy(lambda x: self.model(x)[0], test_loader, ctx.device)
            meter.train_flops += self.forward_flops_per_sample * total
            metrics.update(edge_correct=correct, edge_total=total, edge_accuracy=correct / total if total else None)
            uploads["test"] = self._stream_features("test", start, cfg, meter)
        return RoundResult(num_samples=uploads["train"]["samples"], uploads=uploads, metrics=metrics)

    @torch.no_grad()
    def _stream_features(self, split: str, start: RoundStart, cfg: GktRoundConfig, meter: RoundMeter, only: set[int] | None = None) -> dict:
        """Extract (eval mode) and send batch by batch; at most one batch of maps in memory."""
        ctx = self.ctx
        data = ctx.train if split == "train" else ctx.test
        self.model.eval()
        loader = make_loader(data, cfg.upload_batch_samples, shuffle=False)
        batches = samples = 0
        for seq, (images, labels, sample_ids) in enumerate(loader):
            if only is not None and seq not in only:
                continue
            with meter.phase("compute"):
                features, logits = self._extract(images)  # (B, 16, H, W), (B, K)
            msg = GktFeatures(
                run=ctx.run_id, round=start.round, sender=ctx.agent_id, split=split, seq=seq, instance=ctx.instance,
                features=features, logits=logits,
                labels=labels.numpy().astype(np.int64), sample_ids=sample_ids.numpy().astype(np.int64),
            )
            ctx.send(msg, meter, codecs={"features": cfg.upload_codec})
            batches += 1
            samples += int(labels.shape[0])
        if split == "train":
            meter.train_flops += self.forward_flops_per_sample * samples
        return {"batches": batches, "samples": samples}

    @torch.no_grad()
    def _extract(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Feature maps and logits of one upload batch, computed a slice at a time
        (see ``EXTRACT_BATCH_SAMPLES``) into the arrays the message carries."""
        features = logits = None
        for start in range(0, images.shape[0], EXTRACT_BATCH_SAMPLES):
            part = self.model.extract(images[start : start + EXTRACT_BATCH_SAMPLES].to(self.ctx.device))  # (b, 16, H, W)
            part_logits = self.model.classify(part)  # (b, K)
            if features is None or logits is None:
                features = np.empty((images.shape[0], *part.shape[1:]), np.float32)
                logits = np.empty((images.shape[0], part_logits.shape[1]), np.float32)
            features[start : start + part.shape[0]] = part.cpu().numpy()
            logits[start : start + part.shape[0]] = part_logits.cpu().numpy()
        assert features is not None and logits is not None  # a loader never yields an empty batch
        return features, logits

    # -- local persistence -------------------------------------------------- #

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = {f"model/{k}": v for k, v in state_dict_to_arrays(self.model).items()}
        state["teacher/ids"] = self.teacher.ids
        state["teacher/logits"] = self.teacher.logits
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        load_arrays_into(self.model, {k[6:]: v for k, v in arrays.items() if k.startswith("model/")})
        self.trained = True
        if "teacher/ids" in arrays:
            self.teacher = TeacherLogits(self.num_classes)
            self.teacher.update(arrays["teacher/ids"], arrays["teacher/logits"])
