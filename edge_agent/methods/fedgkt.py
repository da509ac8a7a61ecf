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

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fldata import ArrayDataset
from fldata.torch_data import make_loader
from models import WeightsMismatchError, build_model, forward_flops_per_sample, load_arrays_into, state_dict_to_arrays
from models.batchnorm import load_bn_statistics, restoring_bn_statistics
from models.losses import kd_loss
from models.training import INFERENCE_BATCH_SAMPLES, make_optimizer
from shared_protocol.errors import ShapeMismatchError
from shared_protocol.messages import EvalRequest, RoundStart
from shared_protocol.methods.fedgkt import GktEvalModel, GktRoundConfig

from shared_protocol.activation_guard import ActivationGuard

from ..activation_guard import NoPeek
from ..costs import DeclaredFlops, RoundMeter
from ..fedgkt_edge import FedGktEdgeBase
from ..memory import lighten_model
from ..trainer import LossFn, Trains, train_epochs
from .base import EdgeContext, EvalAnswer, register_edge_method, shard_result


@register_edge_method
class FedGktEdge(FedGktEdgeBase):
    supports_nopeek = True
    private_init = True
    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        # edge_init = "per_agent": drawn from the agent's private key, so the server cannot rebuild it.
        generator = ctx.private_generator() if ctx.settings.get("edge_init") == "per_agent" else ctx.weights_generator()
        self.model = build_model(self.edge_model, self.num_classes, ctx.train.in_channels, generator=generator).to(ctx.device)
        self.trained = False  # True once this model has trained a round (or was restored)
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        self.trains = Trains.of((self.model,), shape)
        self.flops = self.trains.models[0]
        # After counting: the reported FLOPs are the method's; [memory] checkpoint_blocks' recomputation
        # (bench/results/step_memory.json, ``recompute_flops_ratio``) is documented, not counted.
        self.model = lighten_model(self.model, ctx.memory)
        self.server_model: torch.nn.Module | None = None  # built for the first private evaluation
        self.server_flops = DeclaredFlops()
        self.nopeek: NoPeek | None = None  # while a round trains with nopeek_alpha > 0

    # -- a private extractor's evaluation --------------------------------------- #

    def _server_model_for(self, msg: GktEvalModel, map_shape: tuple[int, ...]) -> torch.nn.Module:
        """The server's model as ``msg`` sends it, in eval mode (built once, loaded every time)."""
        if self.server_model is None:
            name = str(self.ctx.settings.get("server_model", "resnet55_server"))
            # Its initial weights are overwritten at once; a generator of its own keeps torch's global RNG untouched.
            self.server_model = build_model(name, self.num_classes, generator=torch.Generator().manual_seed(0)).to(self.ctx.device)
            self.server_flops = DeclaredFlops(forward=forward_flops_per_sample(self.server_model, map_shape))
        try:
            load_arrays_into(self.server_model, msg.weights)
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"{msg.TYPE}: the server model does not fit {self.ctx.settings.get('server_model')}: {exc}") from None
        return self.server_model.eval()

    @torch.no_grad()
    def _evaluate_private(self, request: EvalRequest, server_model: GktEvalModel, meter: RoundMeter) -> EvalAnswer:
        public = self.ctx.public_set(request.public_set, meter, request.round)  # once per run; a download is network time
        with meter.phase("compute"):
            self.model.eval()
            server = self._server_model_for(server_model, self._map_shape())
            bn = [(torch.from_numpy(server_model.bn[f"{i}/mean"]), torch.from_numpy(server_model.bn[f"{i}/var"]))
                  for i in range(len(server_model.bn) // 2)]
            global_results, results = {}, {}
            for data, out in ((public, global_results), (self.ctx.test, results)):
                counts = self._score(server, data, bn)
                for label, (correct, total, loss_sum) in counts.items():
                    out[label] = shard_result(correct, total, loss_sum)
                passes = 2 if bn else 1
                meter.forward(self.flops, len(data))
                meter.forward(self.server_flops, passes * len(data))
        return EvalAnswer(results=results, global_results=global_results)

    def _map_shape(self) -> tuple[int, ...]:
        """One feature map's shape (C, H, W) for this agent's images."""
        x = torch.zeros((1, *self.ctx.train.images.shape[1:]), device=self.ctx.device)
        return tuple(self.model.extract(x).shape[1:])

    def _score(self, server: torch.nn.Module, data: ArrayDataset, bn: list) -> dict[str, tuple[int, int, float]]:
        """(correct, total, summed cross-entropy) on ``data`` of extractor + server model (``model``;
        ``personalised_bn`` with ``bn`` loaded into the server model) and of the ResNet-8 (``edge``)."""
        sums = {label: [0, 0, 0.0] for label in ("model", "edge", *(("personalised_bn",) if bn else ()))}
        for images, labels, _ in make_loader(data, INFERENCE_BATCH_SAMPLES):
            images = images.to(self.ctx.device)
            maps = self.model.extract(images)  # (B, 16, H, W)
            outputs = {"model": server(maps), "edge": self.model.classify(maps)}  # (B, K) each
            if bn:
                with restoring_bn_statistics(server):
                    load_bn_statistics(server, bn)
                    outputs["personalised_bn"] = server(maps)
            for label, logits in outputs.items():
                entry = sums[label]
                entry[0] += int((logits.argmax(1).cpu() == labels).sum())
                entry[1] += int(labels.shape[0])
                entry[2] += float(F.cross_entropy(logits.float().cpu(), labels, reduction="sum"))
        return {label: (int(c), int(t), float(l)) for label, (c, t, l) in sums.items()}

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
            logits, features = output  # (B, K), (B, C, H, W)
            value = F.cross_entropy(logits, labels)
            if self.nopeek is not None:
                value = value + self.nopeek.penalty(features)
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
        guard = ActivationGuard.of(cfg)
        self.nopeek = NoPeek(guard.nopeek_alpha).watch(self.model) if guard.nopeek else None
        try:
            result = self._train_epochs(start, cfg, optimizer, meter, loader)
        finally:
            if self.nopeek is not None:
                self.nopeek.close()
            self.nopeek = None
        return result.samples, result.mean_loss

    def _train_epochs(self, start: RoundStart, cfg: GktRoundConfig, optimizer: torch.optim.Optimizer, meter: RoundMeter,
                      loader: Any) -> Any:
        ctx = self.ctx
        return train_epochs(
            self.model, loader, optimizer, self.loss_fn(cfg), cfg.edge_epochs, meter=meter, trains=self.trains,
            device=ctx.device, progress=ctx.progress, desc=f"{ctx.agent_id} round {start.round}",
            micro_batch=ctx.memory.micro_batch_samples or None,
            # A frozen extractor stays in eval mode: its BatchNorm statistics do not move either.
            frozen=None if cfg.train_extractor else self.model.extractor,
        )

    def _batches(self, data: ArrayDataset, batch_samples: int):  # -> Iterator[(images (B, C, H, W), labels, ids)]
        self.model.eval()
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
