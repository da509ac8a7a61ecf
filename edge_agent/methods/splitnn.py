"""Split learning edge step (vanilla SplitNN; the FedGKT paper's SL baseline).

The agent holds only the extractor (ResNet-8's conv stem, as in the paper's
SL setup); the server holds the rest (ResNet-55/109). In its turn the agent
loads the extractor the previous agent left, then per mini-batch: forward,
send the activations, block until the server's gradient w.r.t. them arrives
(``ctx.request``; a real exchange over the broker for every batch), backward
and step. At the end it uploads the extractor for the next agent.

The turn runs in the shared loop (:func:`edge_agent.trainer.train_epochs`): the
exchange is the loss, ``sum(activations * gradient)``, whose gradient with respect to
the activations is exactly the server's (``1 * g``), so the backward pass and the
step are the ones the server's answer asks for.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fldata.torch_data import make_loader
from models import WeightsMismatchError, build_model, load_arrays_into, state_dict_to_arrays
from models.training import make_optimizer
from shared_protocol.errors import ShapeMismatchError
from shared_protocol.messages import EvalRequest, Message, RoundStart
from shared_protocol.methods.splitnn import (
    SplitActivations,
    SplitExtractor,
    SplitExtractorWeights,
    SplitGradients,
    SplitRoundConfig,
)

from shared_protocol.activation_guard import ActivationGuard

from ..activation_guard import NoPeek, clip_rows_torch, protect_maps
from ..costs import RoundMeter
from ..trainer import LossFn, Trains, train_epochs
from .base import EdgeContext, EdgeMethod, EvalAnswer, RoundResult, register_edge_method

log = logging.getLogger("edge_agent.splitnn")

@register_edge_method
class SplitNNEdge(EdgeMethod):
    name = "splitnn"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.edge_model = str(ctx.settings.get("edge_model", "resnet8"))
        num_classes = int(ctx.settings["num_classes"])
        # Only the stem is used; the rest of the edge model is never built into the graph.
        self.extractor = build_model(self.edge_model, num_classes, ctx.train.in_channels,
                                     generator=ctx.weights_generator()).extractor.to(ctx.device)
        self.config = SplitRoundConfig()
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        # The stem alone: its output has no loss of its own (the backward pass starts from the
        # server's gradient), so its training is counted with a sum.
        self.trains = Trains.of((self.extractor,), shape, loss="sum")
        self.flops = self.trains.models[0]
        self.final_extractor: dict[str, np.ndarray] | None = None  # the round's last extractor, for evaluation

    def _load(self, weights: dict[str, np.ndarray]) -> None:
        try:
            load_arrays_into(self.extractor, weights)
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"extractor weights do not fit {self.edge_model}'s stem: {exc}") from None

    # -- the turn ------------------------------------------------------------------ #

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = self.config = SplitRoundConfig.from_dict(start.config)
        ctx = self.ctx
        if not start.weights:
            raise ShapeMismatchError("round_start carries no extractor weights")
        self._load(start.weights)
        # A fresh optimiser every turn: the extractor arrives from another agent.
        optimizer = make_optimizer(cfg.optimizer, self.extractor.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay,
                                   lean=self.ctx.device == "cpu")
        loader = meter.deadline.batches(make_loader(ctx.train, cfg.batch_size, shuffle=True, augment=ctx.augment, seed=ctx.seed + start.round))
        turn = {"seq": 0, "samples": 0, "correct": 0, "loss_sum": 0.0}
        guard = ActivationGuard.of(cfg)
        nopeek = NoPeek(guard.nopeek_alpha).watch(self.extractor) if guard.nopeek else None
        try:
            train_epochs(self.extractor, loader, optimizer, self._exchange(start, cfg, meter, turn, nopeek), cfg.local_epochs,
                         meter=meter, trains=self.trains, device=ctx.device, progress=ctx.progress,
                         desc=f"{ctx.agent_id} round {start.round}")
        finally:
            if nopeek is not None:
                nopeek.close()
        seq, samples, correct, loss_sum = turn["seq"], turn["samples"], turn["correct"], turn["loss_sum"]
        ctx.send(
            SplitExtractorWeights(run=ctx.run_id, round=start.round, sender=ctx.agent_id, instance=ctx.instance,
                                  batches=seq, weights=state_dict_to_arrays(self.extractor)),
            meter,
        )
        metrics = {"train_loss": loss_sum / samples if samples else 0.0, "train_accuracy": correct / samples if samples else 0.0}
        return RoundResult(num_samples=samples, uploads={"train": {"batches": seq, "samples": samples}}, metrics=metrics)

    def _exchange(self, start: RoundStart, cfg: SplitRoundConfig, meter: RoundMeter, turn: dict,
                  nopeek: NoPeek | None = None) -> LossFn:
        """The loss of one batch: send its activations (clipped and noised when the round's
        guard says so), wait for the server's gradient g with respect to them, and return
        ``sum(clipped activations * g)`` (its gradient is g, through the clipping; the noise is
        a constant), plus NoPeek's ``alpha * dCor(images, activations)`` when it is on; ``turn``
        keeps the batch number and the server's loss and correct counts."""
        ctx = self.ctx
        guard = ActivationGuard.of(cfg)

        def loss(activations: torch.Tensor, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            seq = turn["seq"]
            sent = clip_rows_torch(activations, guard.map_clip_norm)  # (B, C, H, W)
            # Each batch of a turn is a release of its own (the extractor moves every step).
            shown = protect_maps(sent.detach().cpu().numpy(), guard, ctx.key(), f"train/{start.round}/{seq}",
                                 sample_ids.cpu().numpy())
            upload = SplitActivations(
                run=ctx.run_id, round=start.round, sender=ctx.agent_id, split="train", seq=seq, instance=ctx.instance,
                activations=shown, labels=labels.cpu().numpy().astype(np.int64),
            )  # activations (B, C, H, W)
            reply = ctx.request(
                upload, meter, _is_gradient_for(start.round, seq), cfg.reply_timeout_s,
                codecs={"activations": cfg.upload_codec}, attempts=cfg.reply_attempts,
            )
            if not isinstance(reply, SplitGradients) or reply.gradients.shape != tuple(activations.shape):
                raise ShapeMismatchError(f"answer {reply.TYPE} does not fit activations {tuple(activations.shape)}")
            n = int(labels.shape[0])
            turn.update(seq=seq + 1, samples=turn["samples"] + n, correct=turn["correct"] + reply.correct,
                        loss_sum=turn["loss_sum"] + reply.loss * n)
            value = (sent * torch.from_numpy(reply.gradients).to(activations.device)).sum()  # d/d(sent) = g
            return value + nopeek.penalty(activations) if nopeek is not None else value

        return loss

    # -- evaluation after the round --------------------------------------------------- #

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, SplitExtractor):
            self._load(msg.weights)
            self.final_extractor = dict(msg.weights)
            return True
        return False

    @torch.no_grad()
    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """Stream the test shard's activations under the round's final extractor (sent just
        before the request); the server's part scores them."""
        if self.final_extractor is None:
            return EvalAnswer()
        ctx, cfg = self.ctx, self.config
        self._load(self.final_extractor)
        self.extractor.eval()
        batches = samples = 0
        guard = ActivationGuard.of(cfg)
        for seq, (images, labels, ids) in enumerate(make_loader(ctx.test, cfg.eval_batch_samples)):
            with meter.phase("compute"):
                activations = self.extractor(images.to(ctx.device))  # (B, C, H, W)
                shown = protect_maps(activations.cpu().numpy(), guard, ctx.key(), f"test/{request.round}", ids.numpy())
            ctx.send(
                SplitActivations(run=ctx.run_id, round=request.round, sender=ctx.agent_id, split="test", seq=seq,
                                 instance=ctx.instance, activations=shown,
                                 labels=labels.numpy().astype(np.int64)),
                meter, codecs={"activations": cfg.upload_codec},
            )
            batches, samples = batches + 1, samples + int(labels.shape[0])
        meter.forward(self.flops, samples)
        return EvalAnswer(uploads={"test": {"batches": batches, "samples": samples}})


def _is_gradient_for(round_: int, seq: int):  # type: ignore[no-untyped-def]
    def match(msg: Message) -> bool:
        return isinstance(msg, SplitGradients) and msg.round == round_ and msg.seq == seq

    return match
