"""Split learning server step (vanilla SplitNN, Gupta & Raskar 2018; the FedGKT
paper's SL baseline for communication cost).

The network is ResNet-8's stem (on the agents) followed by ResNet-55/109 (here),
i.e. exactly ResNet-56/110 cut after the stem. Agents take turns, as in the
original SL: the coordinator starts one agent's round when the previous one
finished (``schedule = "sequential"``), and the extractor travels along the ring through the
server (each RoundStart carries the extractor the previous agent uploaded).
Every training batch is a real exchange over the broker: activations arrive in
``on_upload``, the server runs forward + backward of its part and one optimiser
step, and answers at once with the gradient w.r.t. the activations.

Evaluation (cloud_server/evaluation.py): the deployed model is the round's
final extractor followed by the server's part, both held here: the evaluator
scores it on the global test set. After an evaluated round the final extractor
also goes to the agents that took part (:class:`SplitExtractor`); answering the
evaluation request they stream their test activations, which the server's part
scores (the local figure).

``extractor = "private"``: each agent draws its own extractor from its private key and
keeps it; the server never holds one (RoundStart carries no weights, no extractor comes
back). The server's part is still one, trained turn by turn on every agent's activations.
Evaluation moves to the devices (``scores_on_device``): the server sends its part
(:class:`SplitServerModel`, evaluation's bytes) and each agent scores its extractor + that
part on the public global set and on its shard; the deployed model is per agent, so the
global figure is the mean over agents.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from models import (build_model, check_cut_pair, count_parameters, get_model_spec, load_arrays_into, state_dict_to_arrays,
                    training_flops_per_sample)
from models.training import make_optimizer
from shared_protocol.activation_guard import ActivationGuard
from shared_protocol.configs import EmbeddedRoundConfig, check_choice, check_optimizer, config_from_table
from shared_protocol.errors import ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import EvalReport, Message, RoundEnd, check_labels
from shared_protocol.methods.splitnn import (
    SplitActivations,
    SplitExtractor,
    SplitExtractorWeights,
    SplitGradients,
    SplitRoundConfig,
    SplitServerModel,
)

from ..activation_privacy import activation_defences
from ..evaluation import HEADLINE, EvalModel, Evaluation, global_results, local_results
from ..server_step import TrainStep
from .base import AnswersUploads, RoundOutcome, ServerContext, ServerMethod, register_server_method

log = logging.getLogger("cloud_server.splitnn")


# How the [splitnn] table names the fields of the SplitRoundConfig that SplitNNConfig holds.
EDGE_KEYS = EmbeddedRoundConfig(SplitRoundConfig, "edge", {
    "optimizer": "edge_optimizer", "lr": "edge_lr", "momentum": "edge_momentum", "weight_decay": "edge_weight_decay"})


#: splitnn.extractor: passed along the ring through the server, or each agent's own.
EXTRACTOR_MODES = ("ring", "private")


@dataclass(frozen=True)
class SplitNNConfig:
    # One line per key of the [splitnn] table (docs/configuration.md is rendered from it by
    # bench/render_results.py; keys sharing a line are comma-separated).
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "server_model, edge_model": "the edge model sets the cut: `resnet8` (server `resnet55_server` / "
                                    "`resnet109_server`) or the deeper `resnet8_stage1` (server "
                                    "`resnet55_server_stage1` / `resnet109_server_stage1`)",
        "server_optimizer, server_lr, server_momentum, server_weight_decay": "one step per agent batch",
        "local_epochs, edge_optimizer, edge_lr, edge_momentum, edge_weight_decay, batch_size":
            "each agent's turn, sent with every round",
        "upload_codec": "activations up: `raw`, `zstd`, `fp16-zstd`, `u8-zstd`, `u8-affine-zstd` (signed: noised maps; gradients come back fp32)",
        "reply_timeout_s, reply_attempts": "an agent asks again for a gradient that did not come",
        "eval_batch_samples": "test activations per evaluation message",
        "map_clip_norm, map_noise_multiplier, map_noise_delta":
            "sent to agents: each map clipped to L2 norm C, plus Gaussian noise of sd `map_noise_multiplier * C`; "
            "`0`: off; the report gives ε (δ: `map_noise_delta`) per map and per image "
            "([protecting activations](privacy.md#protecting-activations))",
        "extractor": "`ring`: one extractor passed from agent to agent through the server (vanilla split learning); "
                     "`private`: each agent keeps its own (`os.urandom`, or `[agent] private_seed`), the server sees "
                     "activations only, and the agents score their models themselves",
        "nopeek_alpha": "sent to agents: loss + `nopeek_alpha * dCor(images, activations)` (NoPeek); `0`: off",
    }

    server_model: str = "resnet55_server"  # or resnet109_server
    edge_model: str = "resnet8"  # the agents hold this model's stem (its extractor)
    server_optimizer: str = "adam"
    server_lr: float = 0.001
    server_momentum: float = 0.9
    server_weight_decay: float = 5e-4
    # The agents' half, sent as RoundStart.config: local_epochs (in each agent's turn),
    # edge_optimizer, edge_lr, edge_momentum, edge_weight_decay, batch_size, upload_codec
    # (vanilla SL, and the paper's Eq. 12, send fp32: "raw"), reply_timeout_s,
    # reply_attempts, eval_batch_samples; all written in the [splitnn] table itself (EDGE_KEYS).
    edge: SplitRoundConfig = field(default_factory=SplitRoundConfig)
    map_noise_delta: float = 1e-5  # δ of the report's ε for noised activations
    # "ring": the extractor travels along the ring through the server; "private": each agent keeps its own.
    extractor: str = "ring"

    def __post_init__(self) -> None:
        check_cut_pair(self.edge_model, self.server_model, "splitnn")
        check_choice(self.extractor, EXTRACTOR_MODES, "splitnn.extractor")
        if not 0 < self.map_noise_delta < 1:
            raise ValueError(f"splitnn.map_noise_delta must be in (0, 1), got {self.map_noise_delta}")
        check_optimizer(self.server_optimizer, "splitnn.server_optimizer")
        if self.server_lr <= 0 or self.server_weight_decay < 0:
            raise ValueError("splitnn.server_lr must be > 0 and server_weight_decay >= 0")
        get_model_spec(self.edge_model)

    def defences_report(self, rounds: int | None = None) -> dict[str, Any] | None:
        """The run report's ``defences``: the activation defences on, with their parameters and ε
        (every turn's epochs release each training image's activations again)."""
        guard, cut = ActivationGuard.of(self.edge), get_model_spec(self.edge_model).cut
        if not (guard.active or self.private_extractor or cut != "stem"):
            return None
        return activation_defences(guard, self.map_noise_delta, method="splitnn", private_extractor=self.private_extractor,
                                   extractor_trains=True, cut=cut, rounds=rounds,
                                   releases_per_round=self.edge.local_epochs) | {"extractor": self.extractor}

    @property
    def private_extractor(self) -> bool:
        """Whether each agent's extractor is its own, never held by the server."""
        return self.extractor == "private"

    def round_config(self) -> SplitRoundConfig:
        return self.edge

    def to_table(self) -> dict[str, Any]:
        """The flat ``[splitnn]`` table this config reads back from (reports, checkpoints)."""
        return EDGE_KEYS.table_of(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SplitNNConfig":
        return config_from_table(cls, raw, "splitnn", embedded=EDGE_KEYS)


@dataclass
class _Turn:
    """One agent's turn in one round."""

    agent: str
    round: int
    instance: str | None = None
    next_seq: int = 0
    last_reply: SplitGradients | None = None
    samples: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    train_s: float = 0.0
    extractor_received: bool = False


@register_server_method
class SplitNNServer(AnswersUploads, ServerMethod):
    name = "splitnn"
    upload_types = (SplitActivations, SplitExtractorWeights)
    answered_types = (SplitActivations,)  # a training batch is answered with its gradients at once
    schedule = "sequential"  # one agent at a time carries the extractor

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.config = SplitNNConfig.from_dict(method_config)
        self.device = torch.device(ctx.device)
        # The ring's starting extractor is made here, so every agent starts from the same one;
        # it and then the server model are drawn from the run's own stream, not torch's global
        # RNG, which other threads of the process (in-memory federations) use (models.seeding).
        generator = torch.Generator().manual_seed(ctx.seed)
        extractor = build_model(self.config.edge_model, ctx.num_classes, ctx.in_channels, generator=generator).extractor
        # A private extractor is the agents' own: the draw above still happens, so the server's
        # part starts from the same weights in either mode.
        self.extractor_state = {} if self.config.private_extractor else state_dict_to_arrays(extractor)
        self.feature_channels = get_model_spec(self.config.server_model).feature_channels
        self.model = build_model(self.config.server_model, ctx.num_classes, generator=generator).to(self.device)
        c = self.config
        self.optimizer = make_optimizer(c.server_optimizer, self.model.parameters(), c.server_lr, c.server_momentum,
                                        c.server_weight_decay, self.device)
        # Every batch is answered with dLoss/dActivations at once: the step runs eagerly (one
        # exchange per batch over the broker bounds it, not kernel launches).
        self.step = TrainStep(self.model, self.optimizer, lambda logits, labels: F.cross_entropy(logits, labels),
                              ctx.server_step, name="splitnn")
        self.turn: _Turn | None = None
        self.finished: dict[str, _Turn] = {}
        self.test_scores: dict[str, tuple[int, int, int]] = {}  # agent -> (round, correct, total) of its test activations
        self.turn_order: list[tuple[int, str]] = []  # (round, agent) as turns began: for reports and tests

    def welcome_settings(self) -> dict[str, Any]:
        settings = {"num_classes": self.ctx.num_classes, "edge_model": self.config.edge_model, "extractor": self.config.extractor}
        if self.config.private_extractor:  # the agents score their extractor + the server's part themselves
            settings["server_model"] = self.config.server_model
        return settings

    @property
    def scores_on_device(self) -> bool:  # type: ignore[override]
        """A private extractor never leaves the device: the agents score it."""
        return self.config.private_extractor

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Called as ``agent``'s turn begins: it gets the extractor the previous agent left (a
        private extractor: nothing, the agent holds its own)."""
        self._end_turn()
        self.turn = _Turn(agent, round_)
        self.turn_order.append((round_, agent))
        return self.config.round_config().to_dict(), dict(self.extractor_state)

    def _end_turn(self) -> None:
        if self.turn is not None:
            self.finished[self.turn.agent] = self.turn
            self.turn = None

    def model_info(self) -> dict[str, Any]:
        extractor = build_model(self.config.edge_model, self.ctx.num_classes, self.ctx.in_channels).extractor
        h = 32
        return {
            "edge": {
                "name": f"{self.config.edge_model}-extractor",
                "params": count_parameters(extractor),
                "train_flops_per_sample": training_flops_per_sample(extractor, (self.ctx.in_channels, h, h), loss="sum"),
            },
            "server": {
                "name": self.config.server_model,
                "params": count_parameters(self.model),
                "train_flops_per_sample": training_flops_per_sample(
                    build_model(self.config.server_model, self.ctx.num_classes), (self.feature_channels, h, h)),
            },
        }

    # -- uploads ---------------------------------------------------------------------- #

    def answer(self, agent: str, msg: Message) -> Message | None:
        """A batch of activations: a training batch is answered with dLoss/dActivations; a
        test batch (evaluation's) is scored, with nothing to answer."""
        if not isinstance(msg, SplitActivations):
            raise ValueRangeError(f"{self.name} does not answer {msg.TYPE} uploads")
        self._check_batch(msg)
        if msg.split == "train":
            return self._train_step(agent, msg)
        if self.config.private_extractor:
            raise ValueRangeError(f"test activations from {agent}: a private extractor is scored on the device, "
                                  "the server takes no test activations")
        self._score_test_batch(agent, msg)
        return None

    def on_upload(self, agent: str, msg: Message) -> None:
        if not isinstance(msg, SplitExtractorWeights):
            raise ValueRangeError(f"{self.name} does not take {msg.TYPE} uploads")
        if self.config.private_extractor:
            raise ValueRangeError(f"{msg.TYPE} from {agent}: the extractors are private (splitnn.extractor = 'private'), "
                                  "the server takes none")
        self._take_extractor(agent, msg)

    def _check_batch(self, msg: SplitActivations) -> None:
        if msg.activations.shape[1] != self.feature_channels:
            raise ShapeMismatchError(f"activations have {msg.activations.shape[1]} channels, {self.config.server_model} takes {self.feature_channels}")
        check_labels(msg.TYPE, msg.labels, self.ctx.num_classes)

    def _current_turn(self, agent: str, msg: SplitActivations | SplitExtractorWeights) -> _Turn:
        turn = self.turn
        if turn is None or turn.agent != agent or turn.round != msg.round:
            raise StaleMessageError(f"{msg.TYPE} from {agent} for round {msg.round}: not its turn")
        if turn.instance is None:
            turn.instance = msg.instance
        elif turn.instance != msg.instance:
            raise StaleMessageError(f"{msg.TYPE} from another process of {agent} than the one in this turn")
        return turn

    def _train_step(self, agent: str, msg: SplitActivations) -> SplitGradients:
        """Forward and backward of the server's part on one batch, one optimiser step;
        the answer is dLoss/dActivations, computed before the step."""
        turn = self._current_turn(agent, msg)
        if msg.seq == turn.next_seq - 1 and turn.last_reply is not None:
            return turn.last_reply  # a retry: the answer got lost, the batch was trained on already
        if msg.seq != turn.next_seq:
            raise ValueRangeError(f"expected batch {turn.next_seq} of {agent}'s turn, got {msg.seq}")
        started = time.perf_counter()
        h = torch.from_numpy(msg.activations).to(self.device)  # (B, 16, H, W)
        labels = torch.from_numpy(msg.labels).to(self.device)  # (B,)

        def refuse_non_finite(loss: torch.Tensor) -> None:
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueRangeError(f"server loss is {value} on {agent}'s batch {msg.seq}: training diverged")

        with self.ctx.device_meter.training():
            out, grad = self.step.step_with_input_grad(h, labels, check=refuse_non_finite)  # grad: (B, 16, H, W)
            # The reply needs all three on the host: one transfer each, once per batch.
            gradients = grad.cpu().numpy()
            loss_value = float(out.loss)
            correct = int((out.logits.argmax(1) == labels).sum())
        n = int(labels.shape[0])
        reply = SplitGradients(run=self.ctx.run_id, round=msg.round, sender="server", seq=msg.seq, loss=loss_value,
                               correct=correct, gradients=gradients)
        turn.next_seq += 1
        turn.last_reply = reply
        turn.samples += n
        turn.correct += correct
        turn.loss_sum += loss_value * n
        turn.train_s += time.perf_counter() - started
        return reply

    def _take_extractor(self, agent: str, msg: SplitExtractorWeights) -> None:
        turn = self._current_turn(agent, msg)
        if set(msg.weights) != set(self.extractor_state):
            raise ShapeMismatchError(f"extractor weights have names {sorted(msg.weights)[:4]}..., expected {sorted(self.extractor_state)[:4]}...")
        for name, array in msg.weights.items():
            if array.shape != self.extractor_state[name].shape:
                raise ShapeMismatchError(f"extractor {name!r} has shape {array.shape}, expected {self.extractor_state[name].shape}")
        # The next agent continues from this extractor (the original SL ring).
        self.extractor_state = {k: np.asarray(v) for k, v in msg.weights.items()}
        turn.extractor_received = True

    @torch.no_grad()
    def _score_test_batch(self, agent: str, msg: SplitActivations) -> None:
        """One batch of an agent's test activations (the coordinator passes them on only while
        that agent's evaluation of ``msg.round`` is awaited), scored by the server's part."""
        self.model.eval()
        logits = self.model(torch.from_numpy(msg.activations).to(self.device))  # (B, K)
        round_, correct, total = self.test_scores.get(agent, (msg.round, 0, 0))
        if round_ != msg.round:
            correct = total = 0
        self.test_scores[agent] = (msg.round, correct + int((logits.argmax(1).cpu() == torch.from_numpy(msg.labels)).sum()),
                                   total + int(msg.labels.shape[0]))

    def discard(self, agent: str) -> None:
        if self.turn is not None and self.turn.agent == agent:
            self.turn = None
        self.finished.pop(agent, None)
        self.test_scores.pop(agent, None)

    # -- closing the round ------------------------------------------------------------- #

    def _usable(self, turn: _Turn | None, end: RoundEnd) -> str | None:
        if turn is None or turn.round != end.round:
            return "no turn in this round"
        if turn.instance != end.instance:
            return "batches came from another agent process"
        declared = end.uploads.get("train", {})
        if declared.get("batches") != turn.next_seq or declared.get("samples") != turn.samples:
            return f"{turn.next_seq} batches / {turn.samples} samples trained, agent reported {declared}"
        if not turn.extractor_received and not self.config.private_extractor:
            return "extractor weights never arrived"
        return None

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        self._end_turn()
        outcome = RoundOutcome()
        turns: list[_Turn] = []
        for agent in sorted(ends):
            turn = self.finished.get(agent)
            why = self._usable(turn, ends[agent])
            if turn is None or why is not None:
                outcome.excluded[agent] = why or "no turn"
                log.warning("round %d: %s's turn does not count: %s", round_, agent, why)
                continue
            turns.append(turn)
            outcome.used_agents.append(agent)
            outcome.samples += turn.samples
            outcome.server_train_s += turn.train_s
        if outcome.samples:
            outcome.server_loss = sum(t.loss_sum for t in turns) / outcome.samples
        self.finished.clear()
        if evaluate and outcome.used_agents and not self.config.private_extractor:
            for agent in sorted(ends):
                outcome.downloads.append(
                    (agent, SplitExtractor(run=self.ctx.run_id, round=round_, sender="server", weights=dict(self.extractor_state))))
        return outcome

    # -- evaluation -------------------------------------------------------------------- #

    def evaluation_downloads(self, round_: int, agent: str) -> list[Message]:
        """A private extractor is scored on the device: the agent gets the server's part."""
        if not self.config.private_extractor:
            return []
        return [SplitServerModel(run=self.ctx.run_id, round=round_, sender="server", weights=state_dict_to_arrays(self.model))]

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        if self.config.private_extractor:  # every figure scored on the devices, checked on arrival
            return Evaluation(global_reported=global_results(reports), local=local_results(reports),
                              labels={HEADLINE: f"agent k's own extractor + the server's {self.config.server_model} "
                                                "(mean over agents)"})
        extractor = build_model(self.config.edge_model, self.ctx.num_classes, self.ctx.in_channels).extractor
        load_arrays_into(extractor, self.extractor_state)
        extractor = extractor.to(self.device).eval()
        self.model.eval()
        ev = Evaluation(
            global_models={HEADLINE: {Evaluation.GLOBAL: EvalModel(lambda x: self.model(extractor(x)))}},
            labels={HEADLINE: f"the round's final extractor + the server's {self.config.server_model}"},
        )
        for agent in sorted(reports):
            scored = self.test_scores.pop(agent, None)
            if scored is not None and scored[0] == round_:
                ev.local.setdefault(HEADLINE, {})[agent] = (scored[1], scored[2])
        return ev

    # -- checkpoints -------------------------------------------------------------------- #

    def state(self) -> Any:
        return {"model": state_dict_to_arrays(self.model), "optimizer": self.optimizer.state_dict(), "extractor": self.extractor_state}

    def load_state(self, state: Any) -> None:
        load_arrays_into(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step.reset()
        self.extractor_state = {k: np.asarray(v) for k, v in state["extractor"].items()}


# -- edgesplit local: this method's [splitnn] table --

from ..local_run import LocalRunOptions  # noqa: E402


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """The server's part of the model and epochs per turn; ``--codec`` for the activations
    (otherwise the config's default, raw)."""
    return {"server_model": options.flag("server_model"), "local_epochs": options.flag("edge_epochs"),
            **({"upload_codec": options.flag("codec")} if options.flag("codec") else {})}
