"""FedGKT edge step on torch (He et al. 2020, Algorithm 1 ClientTrain, Eq. 7).

Each round: train the ResNet-8 for ``edge_epochs`` with
``CE + alpha * KD(server logits -> edge)`` (CE only until server logits exist),
then run the extractor in eval mode over the shard and stream feature maps H,
edge logits z_c, labels and sample ids batch by batch, never holding all maps
in memory. Server logits come back keyed by sample id and are looked up by id
in the next round, whatever order the loader shuffles the samples into.

The protocol is :class:`edge_agent.fedgkt_edge.FedGktEdgeBase`, shared with the
torch-free ort backend; this file is the torch model and its training.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fldata.torch_data import make_loader
from models import build_model, load_arrays_into, state_dict_to_arrays
from models.losses import kd_loss
from models.training import make_optimizer
from shared_protocol.messages import RoundStart
from shared_protocol.methods.fedgkt import GktRoundConfig

from ..costs import RoundMeter
from ..fedgkt_edge import FedGktEdgeBase
from ..memory import lighten_model
from ..trainer import LossFn, Trains, train_epochs
from .base import EdgeContext, register_edge_method


@register_edge_method
class FedGktEdge(FedGktEdgeBase):
    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.model = build_model(self.edge_model, self.num_classes, ctx.train.in_channels, generator=ctx.weights_generator()).to(ctx.device)
        self.trained = False  # True once this model has trained a round (or was restored)
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        self.trains = Trains.of((self.model,), shape)
        self.flops = self.trains.models[0]
        # After counting: the reported FLOPs are the method's; [memory] checkpoint_blocks' recomputation
        # (about +30 % of a training step's FLOPs for ResNet-8) is documented, not counted.
        self.model = lighten_model(self.model, ctx.memory)

    def _prepare(self, start: RoundStart, meter: RoundMeter) -> None:
        if start.weights and not self.trained:
            # The server's common initialisation (fedgkt.edge_init = "shared"): every agent's
            # extractor starts in the same feature space.
            load_arrays_into(self.model, start.weights)
        self.trained = True

    def _new_optimizer(self, cfg: GktRoundConfig) -> torch.optim.Optimizer:
        # train_extractor = False: the extractor's parameters take no gradient and no update.
        for p in self.model.extractor.parameters():
            p.requires_grad_(cfg.train_extractor)
        params = self.model.parameters() if cfg.train_extractor else self.model.classifier.parameters()
        return make_optimizer(cfg.edge_optimizer, params, cfg.edge_lr, cfg.edge_momentum, cfg.edge_weight_decay,
                              lean=self.ctx.device == "cpu")

    def loss_fn(self, cfg: GktRoundConfig) -> LossFn:
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

    def _train(self, start: RoundStart, cfg: GktRoundConfig, optimizer: torch.optim.Optimizer,
               meter: RoundMeter) -> tuple[int, float]:
        ctx = self.ctx
        loader = meter.deadline.batches(make_loader(ctx.train, cfg.batch_size, shuffle=True, augment=ctx.augment, seed=ctx.seed + start.round))
        result = train_epochs(
            self.model, loader, optimizer, self.loss_fn(cfg), cfg.edge_epochs, meter=meter, trains=self.trains,
            device=ctx.device, progress=ctx.progress, desc=f"{ctx.agent_id} round {start.round}",
            micro_batch=ctx.memory.micro_batch_samples or None,
            # A frozen extractor stays in eval mode: its BatchNorm statistics do not move either.
            frozen=None if cfg.train_extractor else self.model.extractor,
        )
        return result.samples, result.mean_loss

    def _upload_batches(self, split: str, batch_samples: int):  # -> Iterator[(images (B, C, H, W), labels, ids)]
        self.model.eval()
        data = self.ctx.train if split == "train" else self.ctx.test
        for images, labels, sample_ids in make_loader(data, batch_samples, shuffle=False):
            yield images, labels.numpy(), sample_ids.numpy()

    @torch.no_grad()
    def _extract(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        def slices():  # -> Iterator[(start, maps (b, 16, H, W), logits (b, K))]
            for start in range(0, images.shape[0], self.slice_samples):
                part = self.model.extract(images[start : start + self.slice_samples].to(self.ctx.device))  # (b, 16, H, W)
                yield start, part.cpu().numpy(), self.model.classify(part).cpu().numpy()

        return self._fill_slices(images.shape[0], slices())

    def _model_arrays(self) -> dict[str, np.ndarray]:
        return state_dict_to_arrays(self.model)

    def _load_model_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        load_arrays_into(self.model, arrays)
        self.trained = True
