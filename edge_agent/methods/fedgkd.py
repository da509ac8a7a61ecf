"""FedGKD / FedGKD-Vote edge step (Yao et al., Eqs. 3-5): FedAvg's local round
with the loss

    L = CE(h(w; x), y) + sum_m gamma_m / 2 * KL( h(w_m; x) || h(w; x) )

where ``h`` is the model's softmax output (temperature 1: the paper's ``h_k``
outputs a probability vector and no temperature appears in Eqs. 3-5), the KL
is summed over classes and averaged over the batch (the ``1 / n_k sum_i``),
and the teachers ``w_m`` with their coefficients come with the RoundStart
(``shared_protocol.methods.fedgkd``): FedGKD has one, the average of the last
``M`` global models, with ``gamma``; FedGKD-Vote has the ``M`` models with
``gamma_m``.

The round itself is :class:`FedAvgEdge`'s (same trainer, same upload); this
class only resolves the teachers before it and supplies the loss. Teachers run
in eval mode without gradients on the *same* (possibly augmented) batch the
local model sees: :meth:`FedGkdEdge.forward_fn` hands the trainer a forward that
returns the local output together with the teachers' logits on that batch.

A RoundStart without teachers, or naming a teacher this agent does not hold,
fails the round with a clear error: training without the teacher would
silently be FedAvg.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import WeightsMismatchError, build_model, load_arrays_into
from models.training import logits_of
from shared_protocol.errors import ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import Message, RoundStart
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgRoundConfig, join_state
from shared_protocol.methods.fedgkd import CONFIG_KEY, FedGkdTeachers, TeacherSpec

from ..costs import RoundMeter
from ..trainer import Forward, LossFn, Trains
from .base import EdgeContext, RoundResult, register_edge_method
from .fedavg import FedAvgEdge

log = logging.getLogger("edge_agent.fedgkd")

_TEACHER_KEY = re.compile(r"^teacher(\d+)/(.+)$")


def fedgkd_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: Sequence[torch.Tensor], coefficients: Sequence[float]) -> torch.Tensor:
    """``CE(logits, labels) + sum_m coefficients[m] / 2 * mean_i KL(softmax(teacher_m) || softmax(logits))``.

    logits: (B, K) of the local model; teacher_logits: M tensors (B, K), no gradient needed;
    coefficients: the paper's gamma (Eqs. 3, 4; M = 1) or gamma_1..gamma_M (Eq. 5).
    """
    if len(teacher_logits) != len(coefficients):
        raise ValueError(f"{len(teacher_logits)} teachers but {len(coefficients)} coefficients")
    loss = F.cross_entropy(logits, labels)
    log_p = F.log_softmax(logits, dim=1)  # (B, K) the local model
    for t, gamma in zip(teacher_logits, coefficients):
        if t.shape != logits.shape:
            raise ShapeMismatchError(f"teacher logits {tuple(t.shape)}, local logits {tuple(logits.shape)}")
        log_q = F.log_softmax(t.detach(), dim=1)  # (B, K) the teacher
        # kl_div(input=log p, target=log q) = sum_k q (log q - log p) = KL(q || p); batchmean: / B.
        loss = loss + gamma / 2 * F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)
    return loss


@register_edge_method
class FedGkdEdge(FedAvgEdge):
    name = "fedgkd"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.held: dict[int, dict[str, np.ndarray]] = {}  # global versions kept for the vote's "held" teachers
        self.buffer_size = 1  # M of the last round: how many recent global versions to keep
        self._teacher_models: list[nn.Module] = []  # built once, reloaded every round
        self._teachers: list[tuple[nn.Module, float]] = []  # this round's (teacher, gamma_m)

    # -- global models kept for the vote ------------------------------------------------ #

    def _remember(self, version: int, state: dict[str, np.ndarray]) -> None:
        self.held[version] = state
        newest = max(max(self.held), self.global_version)
        self.held = {v: s for v, s in self.held.items() if v > newest - self.buffer_size}

    def _held_state(self, version: int) -> dict[str, np.ndarray]:
        if version in self.held:
            return self.held[version]
        if self.global_state is not None and self.global_version == version:
            return self.global_state
        # The server believed we keep it (e.g. we restarted without local state): fail the
        # round; the server forgets what we hold and sends the teacher next time.
        raise StaleMessageError(f"round_start names held teacher version {version}; this agent holds {sorted(self.held)}")

    # -- teachers ------------------------------------------------------------------------ #

    def _split_weights(self, start: RoundStart, spec: FedGkdTeachers) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
        """(the global model's tensors, teacher index -> its tensors) of the RoundStart."""
        global_weights: dict[str, np.ndarray] = {}
        sent: dict[int, dict[str, np.ndarray]] = {}
        for key, array in start.weights.items():
            match = _TEACHER_KEY.match(key)
            if match is None:
                global_weights[key] = array
            else:
                sent.setdefault(int(match.group(1)), {})[match.group(2)] = array
        expected = {i for i, t in enumerate(spec.teachers) if t.source == "sent"}
        if set(sent) != expected:
            raise ShapeMismatchError(f"round_start carries tensors of teachers {sorted(sent)}, its config sends {sorted(expected)}")
        return global_weights, sent

    def _teacher_state(self, i: int, t: TeacherSpec, sent: dict[int, dict[str, np.ndarray]], cfg: FedAvgRoundConfig) -> dict[str, np.ndarray]:
        if t.source == "global":
            if t.versions[0] != cfg.model_version or self.global_state is None:
                raise ValueRangeError(f"teacher {i} is global version {t.versions[0]}, the round starts from {cfg.model_version}")
            return self.global_state
        if t.source == "held":
            return self._held_state(t.versions[0])
        return join_state(sent[i], t.int_buffers)

    def _load_teachers(self, states: list[dict[str, np.ndarray]], coefficients: list[float]) -> None:
        while len(self._teacher_models) < len(states):
            self._teacher_models.append(build_model(self.model_name, self.num_classes, self.ctx.train.in_channels,
                                                    generator=self.ctx.weights_generator()).to(self.ctx.device))
        self._teachers = []
        for i, (state, gamma) in enumerate(zip(states, coefficients)):
            teacher = self._teacher_models[i]
            try:
                load_arrays_into(teacher, state)
            except WeightsMismatchError as exc:
                raise ShapeMismatchError(f"teacher {i} does not fit {self.model_name}: {exc}") from None
            teacher.eval()  # BatchNorm from its running statistics; a teacher never updates them
            teacher.requires_grad_(False)
            self._teachers.append((teacher, gamma))

    def loss_fn(self, cfg: FedAvgRoundConfig) -> LossFn:
        gammas = [g for _, g in self._teachers]
        if not gammas:
            raise ValueRangeError("fedgkd: no teacher loaded for this round; refusing to train as plain FedAvg")

        def loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            local_output, teacher_logits = output  # from forward_fn
            return fedgkd_loss(logits_of(local_output), labels, teacher_logits, gammas)

        return loss

    def forward_fn(self, cfg: FedAvgRoundConfig) -> Forward:
        teachers = [t for t, _ in self._teachers]

        def forward(model: nn.Module, images: torch.Tensor) -> tuple[object, list[torch.Tensor]]:
            with torch.no_grad():
                teacher_logits = [logits_of(t(images)) for t in teachers]  # M x (B, K)
            return model(images), teacher_logits

        return forward

    def trains(self, cfg: FedAvgRoundConfig) -> Trains:
        """The local model, and every trained sample also goes forward through each teacher."""
        return Trains.of((self.model,), self.input_shape, teachers=[t for t, _ in self._teachers])

    # -- the global model (FedAvg's, kept for a later vote) ------------------------------ #

    def on_message(self, msg: Message) -> bool:
        handled = super().on_message(msg)
        if handled and isinstance(msg, FedAvgGlobalModel):
            self._remember(msg.model_version, self.global_state)  # type: ignore[arg-type]
        return handled

    # -- the round ----------------------------------------------------------------------- #

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        config = dict(start.config)
        if CONFIG_KEY not in config:
            raise ValueRangeError("fedgkd round_start carries no teachers; refusing to train as plain FedAvg")
        spec = FedGkdTeachers.from_dict(config.pop(CONFIG_KEY))
        global_weights, sent = self._split_weights(start, spec)
        base = dataclasses.replace(start, config=config, weights=global_weights)  # what FedAvg's round expects
        cfg = FedAvgRoundConfig.from_dict(config)
        metrics: dict = {}
        with meter.phase("compute"):
            self._receive_global(base, cfg)  # the global model may itself be a teacher
            states = [self._teacher_state(i, t, sent, cfg) for i, t in enumerate(spec.teachers)]
            self._load_teachers(states, [t.coefficient for t in spec.teachers])
            if spec.measure_start_loss:
                _, total, loss_sum = self._test_metrics()
                meter.forward(self.model_flops, total)
                metrics.update(start_loss_sum=loss_sum, start_loss_total=total)
        self.buffer_size = spec.buffer_size
        if spec.variant == "vote":
            # Keep what a later vote may name as "held" (the server counts on it once this round's update arrives).
            self._remember(cfg.model_version, self.global_state)  # type: ignore[arg-type]
            for t, state in zip(spec.teachers, states):
                self._remember(t.versions[0], state)
        try:
            result = super().run_round(base, meter)
        finally:
            self._teachers = []
        result.metrics.update(metrics)
        result.uploads["teachers"] = len(spec.teachers)
        return result

    # -- local persistence ------------------------------------------------------------------ #

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = super().state_arrays()
        for version, held in self.held.items():
            state.update({f"held/{version}/{k}": v for k, v in held.items()})
        if self.held:
            state["held_buffer_size"] = np.asarray(self.buffer_size, dtype=np.int64)
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        held: dict[int, dict[str, np.ndarray]] = {}
        for key, value in arrays.items():
            if key.startswith("held/"):
                version, name = key[5:].split("/", 1)
                held.setdefault(int(version), {})[name] = value
        self.held = held
        if "held_buffer_size" in arrays:
            self.buffer_size = int(arrays["held_buffer_size"])
