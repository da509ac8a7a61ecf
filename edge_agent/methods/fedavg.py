"""FedAvg edge step: train the full model locally, upload it with the sample count.

Each round: load the global model (from ``RoundStart.weights``, or the copy
kept from the last :class:`FedAvgGlobalModel` when the RoundStart names that
version and carries no weights), train ``local_epochs`` with a fresh optimiser
(the global model moved; moments from another model would be stale), and
upload the trained weights. After an evaluated round the server sends the new
global model, then its evaluation request: the agent evaluates that model (the
deployed one) on its test shard (the run's ``local_accuracy``; the server scores
the same model on the global test set).

The FedAvg family (FedGKD, FedDistill) subclasses :class:`FedAvgEdge` and
overrides :meth:`FedAvgEdge.loss_fn` (and :meth:`FedAvgEdge.forward_fn` when the
loss needs more of the batch than the local model's output, with
:meth:`FedAvgEdge.trains` saying what that forward runs besides the local model).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from fldata.torch_data import make_loader
from models import WeightsMismatchError, build_model, cached_flops_per_sample, load_arrays_into, state_dict_to_arrays
from models.training import INFERENCE_BATCH_SAMPLES, logits_of, make_optimizer
from shared_protocol.errors import ShapeMismatchError, StaleMessageError
from shared_protocol.messages import EvalRequest, Message, RoundStart
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgRoundConfig, FedAvgUpdate, join_state, split_state

from ..costs import RoundMeter
from ..privacy import DpSgd, agent_privacy, privatise_state, privatise_update
from ..trainer import Forward, LossFn, Trains, train_epochs
from .base import EdgeContext, EdgeMethod, EvalAnswer, RoundResult, register_edge_method, shard_result

if TYPE_CHECKING:
    from ..secagg_client import SecAggClient

log = logging.getLogger("edge_agent.fedavg")

@register_edge_method
class FedAvgEdge(EdgeMethod):
    name = "fedavg"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.num_classes = int(ctx.settings["num_classes"])
        self.model_name = str(ctx.settings.get("model", "resnet56"))
        self.model = build_model(self.model_name, self.num_classes, ctx.train.in_channels, generator=ctx.weights_generator()).to(ctx.device)
        self.global_state: dict[str, np.ndarray] | None = None  # the last global model received
        self.global_version = -1
        self.input_shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        self.model_flops = cached_flops_per_sample(self.model, self.input_shape)  # the deployed model's, per sample
        # Differential privacy (edge_agent/privacy.py): the update clipped (and noised) before it is
        # sent, and DP-SGD through Opacus; the noise draws from OS entropy, not the run's seed.
        self.privacy = agent_privacy(ctx.settings)
        self.dpsgd = DpSgd(self.privacy, self.model, self.model_name) if self.privacy.dpsgd else None
        self._dp_rng = np.random.default_rng()

    # -- the global model -------------------------------------------------------- #

    def _load(self, state: dict[str, np.ndarray]) -> None:
        try:
            load_arrays_into(self.model, state)
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"global model does not fit {self.model_name}: {exc}") from None

    def _receive_global(self, start: RoundStart, cfg: FedAvgRoundConfig) -> None:
        if start.weights:
            state = join_state(start.weights, cfg.int_buffers)
            self._load(state)
            self.global_state, self.global_version = state, cfg.model_version
        elif self.global_state is not None and self.global_version == cfg.model_version:
            self._load(self.global_state)
        else:
            # The server believed we hold this version (e.g. we restarted without local state):
            # fail the round; the server then sends the weights next time.
            raise StaleMessageError(f"round_start names global version {cfg.model_version} without weights; this agent holds {self.global_version}")

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, FedAvgGlobalModel):
            state = join_state(msg.weights, msg.int_buffers)
            self._load(state)
            self.global_state, self.global_version = state, msg.model_version
            return True
        return False

    def held_global(self, version: int) -> dict[str, np.ndarray] | None:
        return self.global_state if self.global_state is not None and self.global_version == version else None

    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """The global model this agent holds (the round's aggregate, downloaded just before the
        request) on the test shard; ``version`` says which aggregate it was."""
        if self.global_state is None:
            return EvalAnswer()
        self._load(self.global_state)
        with meter.phase("compute"):
            correct, total, loss_sum = self._test_metrics()
        meter.forward(self.model_flops, total)
        return EvalAnswer(results={"model": shard_result(correct, total, loss_sum, version=self.global_version)})

    @torch.no_grad()
    def _test_metrics(self) -> tuple[int, int, float]:
        """(correct, total, summed cross-entropy) of the loaded model on the test shard."""
        self.model.eval()
        correct = total = 0
        loss_sum = 0.0
        for images, labels, _ in make_loader(self.ctx.test, INFERENCE_BATCH_SAMPLES):
            logits = logits_of(self.model(images.to(self.ctx.device))).float()  # (B, K)
            labels = labels.to(logits.device)
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(dim=1) == labels).sum())
            total += int(labels.shape[0])
        return correct, total, loss_sum

    # -- the round ------------------------------------------------------------------ #

    def loss_fn(self, cfg: FedAvgRoundConfig) -> LossFn:
        """Cross-entropy on the full model's logits; the FedAvg family adds terms here."""

        def loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits_of(output), labels)

        return loss

    def forward_fn(self, cfg: FedAvgRoundConfig) -> Forward | None:
        """What the trainer computes per batch for :meth:`loss_fn` (None: ``model(images)``);
        the FedAvg family adds a teacher's outputs on the same batch here."""
        return None

    def trains(self, cfg: FedAvgRoundConfig) -> Trains:
        """What a step trains, for the meter: the local model; the FedAvg family adds the
        teachers its :meth:`forward_fn` runs."""
        return Trains.of((self.model,), self.input_shape)

    def shared_update(self, update: dict[str, np.ndarray], cfg: FedAvgRoundConfig) -> dict[str, np.ndarray]:
        """What of ``update`` (the model's floats minus the global model's, float64) this agent lets
        the secure sum see. DP-FedAvg's client side happens here, before masking, since the server
        cannot clip what it never sees: ``client_clipping`` clips to C, ``local`` clips and noises
        (edge_agent/privacy.py); otherwise the update as it is."""
        if self.privacy.agent_clips:
            update, _ = privatise_update(update, self.privacy, self._dp_rng)  # the norm stays here: it is one update's
        return update

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = FedAvgRoundConfig.from_dict(start.config)
        ctx = self.ctx
        secagg = None
        if "secagg" in ctx.settings:  # [server] secure_aggregation: keys and shares before training
            from ..secagg_client import SecAggClient  # needs cryptography and pycryptodome
            from shared_protocol.secagg_params import SecAggParams

            secagg = SecAggClient(ctx, SecAggParams.from_dict(ctx.settings["secagg"]), start.round,
                                  time.monotonic() + start.deadline_s)
            secagg.setup(meter, len(ctx.train))
        with meter.phase("compute"):
            self._receive_global(start, cfg)
            optimizer = make_optimizer(cfg.optimizer, self.model.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay,
                                       lean=ctx.device == "cpu")
            loader = make_loader(ctx.train, cfg.batch_size, shuffle=True, augment=ctx.augment, seed=ctx.seed + start.round)
            loss_fn = self.loss_fn(cfg)
            trains = self.trains(cfg)
            if self.dpsgd is not None:  # the per-sample gradients: work the model's own count leaves out
                trains = replace(trains, extra_flops_per_sample=trains.extra_flops_per_sample
                                 + self.dpsgd.extra_flops_per_sample(self.model, self.input_shape))
            private = self.dpsgd.private(self.model, optimizer, loader) if self.dpsgd else contextlib.nullcontext((self.model, optimizer, loader))
            with private as (model, optimizer, batches):
                result = train_epochs(
                    model, meter.deadline.batches(batches), optimizer, loss_fn, cfg.local_epochs, meter=meter, trains=trains,
                    device=ctx.device, progress=ctx.progress, desc=f"{ctx.agent_id} round {start.round}", forward=self.forward_fn(cfg),
                )
        metrics: dict = {"train_loss": result.mean_loss}
        state = state_dict_to_arrays(self.model)
        if self.privacy.agent_clips and self.global_state is not None and secagg is None:  # secure: shared_update
            state, metrics["dp_update_norm"] = privatise_state(state, self.global_state, self.privacy, self._dp_rng)
        if self.dpsgd is not None:
            metrics.update(self.dpsgd.figures())
        weights, int_buffers = split_state(state)
        update = FedAvgUpdate(
            run=ctx.run_id, round=start.round, sender=ctx.agent_id, instance=ctx.instance, num_samples=len(ctx.train),
            model_version=cfg.model_version, int_buffers=int_buffers, weights=weights,
        )
        if secagg is None:
            ctx.send(update, meter, codecs={"weights": cfg.upload_codec})
        else:
            self._secure_upload(secagg, cfg, meter, weights, int_buffers)
            metrics.update(secagg.metrics())
        return RoundResult(num_samples=len(ctx.train), uploads={"model_version": cfg.model_version, "tensors": len(weights)}, metrics=metrics)

    def _secure_upload(self, secagg: "SecAggClient", cfg: FedAvgRoundConfig, meter: RoundMeter,
                       weights: dict[str, np.ndarray], int_buffers: dict[str, int]) -> None:
        """The update masked into the secure sum (edge_agent/secagg_client.py), the model's floats
        flattened in name order as the server unflattens them."""
        if self.global_state is None:
            raise StaleMessageError("secure aggregation needs the global model this round started from")
        update = self.shared_update({n: weights[n].astype(np.float64) - self.global_state[n] for n in weights}, cfg)
        flat = np.concatenate([update[n].ravel() for n in sorted(update)])  # (params,)
        with meter.phase("encode"):
            masked = secagg.mask(flat, len(self.ctx.train), uniform=self.privacy.mode == "client_clipping")
        secagg.upload(meter, masked, cfg.model_version, int_buffers)

    # -- local persistence ------------------------------------------------------------ #

    def state_arrays(self) -> dict[str, np.ndarray]:
        if self.global_state is None:
            return {}
        state = {f"global/{k}": v for k, v in self.global_state.items()}
        state["global_version"] = np.asarray(self.global_version, dtype=np.int64)
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if "global_version" not in arrays:
            return
        self.global_state = {k[7:]: v for k, v in arrays.items() if k.startswith("global/")}
        self.global_version = int(arrays["global_version"])
