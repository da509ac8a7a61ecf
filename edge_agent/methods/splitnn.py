"""Split learning edge step (vanilla SplitNN; the FedGKT paper's SL baseline).

The agent holds only the extractor (ResNet-8's conv stem, as in the paper's
SL setup); the server holds the rest (ResNet-55/109). In its turn the agent
loads the extractor the previous agent left, then per mini-batch: forward,
send the activations, block until the server's gradient w.r.t. them arrives
(``ctx.request``; a real exchange over the broker for every batch), backward
and step. At the end it uploads the extractor for the next agent.

A private extractor (the server's ``extractor = "private"``) is drawn from the agent's
private key, trained in its turns and never sent: no weights come with RoundStart, none go
back, and the agent scores it + the server's part (:class:`SplitServerModel`, sent for
evaluation) on the public global set and on its shard itself.

The turn runs in the shared loop (:func:`edge_agent.trainer.train_epochs`): the
exchange is the loss, ``sum(activations * gradient)``, whose gradient with respect to
the activations is exactly the server's (``1 * g``), so the backward pass and the
step are the ones the server's answer asks for.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from fldata.torch_data import make_loader
from models import WeightsMismatchError, build_model, forward_flops_per_sample, load_arrays_into, state_dict_to_arrays
from models.training import INFERENCE_BATCH_SAMPLES, make_optimizer
from shared_protocol.errors import ShapeMismatchError, StaleMessageError
from shared_protocol.messages import EvalRequest, Message, RoundStart
from shared_protocol.methods.splitnn import (
    SplitActivations,
    SplitExtractor,
    SplitExtractorWeights,
    SplitGradients,
    SplitRoundConfig,
    SplitServerModel,
)

from shared_protocol.activation_guard import ActivationGuard

from ..activation_guard import NoPeek, clip_rows_torch, protect_maps
from ..costs import DeclaredFlops, RoundMeter
from ..trainer import LossFn, Trains, train_epochs
from .base import EdgeContext, EdgeMethod, EvalAnswer, RoundResult, register_edge_method, shard_result

log = logging.getLogger("edge_agent.splitnn")

@register_edge_method
class SplitNNEdge(EdgeMethod):
    name = "splitnn"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.edge_model = str(ctx.settings.get("edge_model", "resnet8"))
        self.num_classes = num_classes = int(ctx.settings["num_classes"])
        # A private extractor is drawn from the agent's own key, so the server cannot rebuild it.
        self.private = ctx.settings.get("extractor", "ring") == "private"
        generator = ctx.private_generator() if self.private else ctx.weights_generator()
        # Only the stem is used; the rest of the edge model is never built into the graph.
        self.extractor = build_model(self.edge_model, num_classes, ctx.train.in_channels,
                                     generator=generator).extractor.to(ctx.device)
        self.config = SplitRoundConfig()
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        # The stem alone: its output has no loss of its own (the backward pass starts from the
        # server's gradient), so its training is counted with a sum.
        self.trains = Trains.of((self.extractor,), shape, loss="sum")
        self.flops = self.trains.models[0]
        self.final_extractor: dict[str, np.ndarray] | None = None  # the round's last extractor, for evaluation
        self.server_part: SplitServerModel | None = None  # a private extractor's evaluation: the server's part
        self.server_model: torch.nn.Module | None = None  # built for the first private evaluation
        self.server_flops = DeclaredFlops()

    def _load(self, weights: dict[str, np.ndarray]) -> None:
        try:
            load_arrays_into(self.extractor, weights)
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"extractor weights do not fit {self.edge_model}'s stem: {exc}") from None

    # -- the turn ------------------------------------------------------------------ #

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = self.config = SplitRoundConfig.from_dict(start.config)
        ctx = self.ctx
        if self.private:
            if start.weights:
                raise ShapeMismatchError("round_start carries extractor weights, but this agent's extractor is private")
        elif not start.weights:
            raise ShapeMismatchError("round_start carries no extractor weights")
        else:
            self._load(start.weights)
        # A fresh optimiser every turn: the extractor arrives from another agent (a private one
        # does the same, so the two modes differ only in whose extractor trains).
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
        if not self.private:
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
        if isinstance(msg, SplitServerModel):
            self.server_part = msg
            return True
        return False

    @torch.no_grad()
    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """Stream the test shard's activations under the round's final extractor (sent just
        before the request); the server's part scores them. A private extractor is scored here (:meth:`_evaluate_private`)."""
        if self.private:
            if self.server_part is None or self.server_part.round != request.round:
                held = self.server_part.round if self.server_part is not None else None
                raise StaleMessageError(f"eval_request for round {request.round} without the server's part to score the "
                                        f"private extractor with (held: round {held})")
            return self._evaluate_private(request, self.server_part, meter)
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

    def _server_model_for(self, msg: SplitServerModel) -> torch.nn.Module:
        """The server's part as ``msg`` sends it, in eval mode (built once, loaded every time)."""
        if self.server_model is None:
            name = str(self.ctx.settings.get("server_model", "resnet55_server"))
            # Its initial weights are overwritten at once; a generator of its own keeps other streams untouched.
            self.server_model = build_model(name, self.num_classes, generator=torch.Generator().manual_seed(0)).to(self.ctx.device)
            x = torch.zeros((1, *self.ctx.train.images.shape[1:]), device=self.ctx.device)
            self.extractor.eval()
            map_shape = tuple(self.extractor(x).shape[1:])  # (C, H, W)
            self.server_flops = DeclaredFlops(forward=forward_flops_per_sample(self.server_model, map_shape))
        try:
            load_arrays_into(self.server_model, msg.weights)
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"{msg.TYPE}: the server's part does not fit {self.ctx.settings.get('server_model')}: {exc}") from None
        return self.server_model.eval()

    @torch.no_grad()
    def _evaluate_private(self, request: EvalRequest, server_part: SplitServerModel, meter: RoundMeter) -> EvalAnswer:
        """This extractor + the server's part on the public global set the request names and on
        the local test shard: figures only, nothing of the extractor or its activations."""
        public = self.ctx.public_set(request.public_set, meter, request.round)  # once per run; a download is network time
        with meter.phase("compute"):
            self.extractor.eval()
            server = self._server_model_for(server_part)
            global_results, results = {}, {}
            for data, out in ((public, global_results), (self.ctx.test, results)):
                correct = total = 0
                loss_sum = 0.0
                for images, labels, _ in make_loader(data, INFERENCE_BATCH_SAMPLES):
                    logits = server(self.extractor(images.to(self.ctx.device)))  # (B, K)
                    correct += int((logits.argmax(1).cpu() == labels).sum())
                    total += int(labels.shape[0])
                    loss_sum += float(F.cross_entropy(logits.float().cpu(), labels, reduction="sum"))
                out["model"] = shard_result(correct, total, loss_sum)
                meter.forward(self.flops, len(data))
                meter.forward(self.server_flops, len(data))
        return EvalAnswer(results=results, global_results=global_results)

    # -- local persistence --------------------------------------------------------- #

    def state_arrays(self) -> dict[str, np.ndarray]:
        """A private extractor exists nowhere else: a restarted agent resumes it (a ring
        extractor comes back with the next turn's RoundStart)."""
        if not self.private:
            return {}
        state = {f"extractor/{k}": v for k, v in state_dict_to_arrays(self.extractor).items()}
        state["guard/key"] = np.frombuffer(self.ctx.key(), dtype=np.uint8).copy()
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if "guard/key" in arrays:
            self.ctx.private_key = bytes(np.asarray(arrays["guard/key"], dtype=np.uint8))
        extractor = {k[len("extractor/"):]: v for k, v in arrays.items() if k.startswith("extractor/")}
        if extractor:
            self._load(extractor)


def _is_gradient_for(round_: int, seq: int):  # type: ignore[no-untyped-def]
    def match(msg: Message) -> bool:
        return isinstance(msg, SplitGradients) and msg.round == round_ and msg.seq == seq

    return match
