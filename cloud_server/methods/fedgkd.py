"""FedGKD and FedGKD-Vote server step (Yao et al., "FedGKD: Local-Global
Knowledge Distillation in Heterogeneous Federated Learning", Algorithm 1).

Aggregation is FedAvg's sample-weighted mean (this class *is* a
:class:`FedAvgServer`). On top, the server keeps a buffer of the last ``M``
global models ``w_t, ..., w_{t-M+1}`` (the initial model counts; early rounds
hold fewer) and sends each round's participants their teachers with the
RoundStart (``shared_protocol.methods.fedgkd``):

* ``variant = "avg"`` (FedGKD, Eq. 4): one teacher, the parameter average
  ``w_t_bar = 1/M sum_m w_{t-m+1}`` of the buffer, coefficient ``gamma``. With
  one model in the buffer (``M = 1``, or the first round) the teacher is the
  global model itself and no extra bytes travel (the paper: "the same as FedAvg
  if M = 1"); otherwise one extra model travels ("twice").
* ``variant = "vote"`` (FedGKD-Vote, Eq. 5): every buffered model is a teacher
  with ``gamma_m / 2 = lambda * softmax_m(-L_m / beta)`` (the paper's
  Appendix, "Parameter Setting"), ``L_m`` the validation loss of buffered model
  ``m``, ``beta = 1 / M`` and ``lambda = 0.1`` by default
  (:func:`vote_coefficients`). Models the agent already holds are named, not
  resent: the newest is the round's global model, and older ones it confirmed
  having (it trained with them, or evaluated them) are "held".

Validation losses: the server holds no data, so ``L_m`` is measured on the
agents' test shards. After every vote round the new global model is evaluated
on the agents (the evaluation request every method answers; FedAvg's agents
add the summed cross-entropy of the model on their shards), whatever
``eval_every`` says; a model nobody evaluated yet (the initial model) is
measured by the agents at the start of the round it is the starting model of.
``L_m`` is the sample-weighted mean over the agents that answered.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shared_protocol.messages import EvalReport, RoundEnd
from shared_protocol.methods.fedavg import FedAvgUpdate, split_state
from shared_protocol.methods.fedgkd import CONFIG_KEY, VARIANTS, FedGkdTeachers, TeacherSpec, teacher_prefix

from ..aggregation import weighted_mean
from ..evaluation import HEADLINE, Evaluation
from .base import RoundOutcome, ServerContext, register_server_method
from .fedavg import FedAvgConfig, FedAvgServer

log = logging.getLogger("cloud_server.fedgkd")


@dataclass(frozen=True)
class FedGkdConfig(FedAvgConfig):
    """``[fedgkd]``: FedAvg's keys plus the distillation settings.

    Defaults are the paper's CV settings: ``gamma = 0.2`` (ResNet-8), ``M = 5``,
    vote ``lambda = 0.1`` and ``beta = 1 / M`` (``vote_temperature = 0``).
    """

    TABLE: ClassVar[str] = "fedgkd"
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "variant": "`avg`: one teacher, the mean of the last M global models (Eq. 4); `vote`: FedGKD-Vote, the M "
                   "models with their own coefficients (Eq. 5)",
        "gamma": "`avg`: loss + gamma / 2 x KL(teacher || local)",
        "buffer_size": "M, global models kept (the initial one included)",
        "vote_scale, vote_temperature": "`vote`: lambda, beta of gamma_m / 2 = lambda softmax(-L_m / beta); beta 0: 1 / M",
    }

    variant: str = "avg"  # avg: FedGKD (Eq. 4) | vote: FedGKD-Vote (Eq. 5)
    gamma: float = 0.2
    buffer_size: int = 5  # M
    vote_scale: float = 0.1  # lambda
    vote_temperature: float = 0.0  # beta; 0: 1 / buffer_size, as in the paper

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"fedgkd.variant must be one of {VARIANTS}, got {self.variant!r}")
        if not (isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"fedgkd.gamma must be > 0 (Eq. 3), got {self.gamma!r}")
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size < 1:
            raise ValueError(f"fedgkd.buffer_size must be an int >= 1, got {self.buffer_size!r}")
        if not (isinstance(self.vote_scale, (int, float)) and math.isfinite(self.vote_scale) and self.vote_scale > 0):
            raise ValueError(f"fedgkd.vote_scale must be > 0, got {self.vote_scale!r}")
        if not (isinstance(self.vote_temperature, (int, float)) and math.isfinite(self.vote_temperature) and self.vote_temperature >= 0):
            raise ValueError(f"fedgkd.vote_temperature must be >= 0 (0: 1 / buffer_size), got {self.vote_temperature!r}")

    @property
    def beta(self) -> float:
        return self.vote_temperature or 1.0 / self.buffer_size


def vote_coefficients(losses: list[float], scale: float, temperature: float) -> list[float]:
    """FedGKD-Vote's ``gamma_i`` from validation losses ``L_i``:
    ``gamma_i / 2 = scale * exp(-L_i / temperature) / sum_j exp(-L_j / temperature)``.

    Returns ``gamma_i`` itself (the loss applies ``gamma_i / 2``, Eq. 5), so they sum to ``2 * scale``.
    """
    if not losses:
        raise ValueError("no losses to vote with")
    z = -np.asarray(losses, dtype=np.float64) / temperature  # (M,)
    if not np.all(np.isfinite(z)):
        raise ValueError(f"validation losses must be finite, got {losses}")
    w = np.exp(z - z.max())  # shifted: a large 1/beta must not overflow
    return [float(2.0 * scale * x) for x in w / w.sum()]


class ModelBuffer:
    """The last ``size`` global models, newest first, each with its version (the round that made it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: deque[tuple[int, dict[str, np.ndarray]]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, version: int, state: dict[str, np.ndarray]) -> None:
        if self._entries and version <= self._entries[0][0]:
            raise ValueError(f"global version {version} is not newer than the buffer's newest {self._entries[0][0]}")
        self._entries.appendleft((version, state))

    def versions(self) -> list[int]:
        return [v for v, _ in self._entries]

    def entries(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        return list(self._entries)

    def average(self) -> dict[str, np.ndarray]:
        """``w_t_bar = 1/M sum_m w_{t-m+1}`` (Eq. 4's teacher), entry by entry, BatchNorm buffers included."""
        states = [s for _, s in self._entries]
        return weighted_mean(states, [1.0] * len(states))


@dataclass
class _RoundTeachers:
    """The teachers of one round, the same for every participant (only their sources differ)."""

    variant: str
    entries: list[tuple[tuple[int, ...], float, dict[str, np.ndarray]]]  # (versions, coefficient, state)
    losses: list[float | None]  # the validation loss behind each vote coefficient (None: avg)
    measure_start_loss: bool


@register_server_method
class FedGkdServer(FedAvgServer):
    name = "fedgkd"
    upload_types = FedAvgServer.upload_types  # FedAvg's, secure aggregation's included
    config_class = FedGkdConfig
    config: FedGkdConfig

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.buffer = ModelBuffer(self.config.buffer_size)
        self.buffer.push(self.version, self.global_state)  # w_0 is a historical global model too
        self.val_loss: dict[int, tuple[float, int]] = {}  # version -> (summed CE, samples) over the agents' test shards
        self.holds: dict[str, set[int]] = {}  # agent -> global versions it confirmed having (vote's "held")
        self._given: dict[tuple[str, int], set[int]] = {}  # (agent, round) -> versions it got in that RoundStart
        self._round_teachers: dict[int, _RoundTeachers] = {}
        self._reports: dict[int, dict[str, Any]] = {}

    @property
    def evaluate_every_round(self) -> bool:  # type: ignore[override]
        """The vote weighs the next round's teachers by the new model's validation loss on the
        agents' shards (their evaluation reports): every round is evaluated."""
        return self.config.variant == "vote"

    # -- validation losses -------------------------------------------------------- #

    def _add_loss(self, version: int, loss_sum: float, total: int) -> None:
        if total <= 0:
            return
        s, n = self.val_loss.get(version, (0.0, 0))
        self.val_loss[version] = (s + loss_sum, n + total)

    def mean_val_loss(self, version: int) -> float | None:
        s, n = self.val_loss.get(version, (0.0, 0))
        return s / n if n else None

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        """FedAvg's, and the validation loss of the new global model the vote needs."""
        ev = super().evaluation(round_, reports)
        for agent in ev.local.get(HEADLINE, {}):  # the answers about the current version
            figures = reports[agent].results[HEADLINE]
            if isinstance(figures.get("loss_sum"), (int, float)):
                self._add_loss(self.version, float(figures["loss_sum"]), int(figures["total"]))
        return ev

    # -- teachers ----------------------------------------------------------------------- #

    def _teachers_of(self, round_: int) -> _RoundTeachers:
        """Fixed at the round's first RoundStart, so every participant distils from the same teachers."""
        if round_ in self._round_teachers:
            return self._round_teachers[round_]
        entries = self.buffer.entries()  # newest first; entries[0] is the current global model
        if entries[0][0] != self.version:
            raise RuntimeError(f"the buffer's newest model is version {entries[0][0]}, the global model is {self.version}")
        measure = False
        if self.config.variant == "avg":
            state = self.global_state if len(entries) == 1 else self.buffer.average()
            teachers = _RoundTeachers("avg", [(tuple(v for v, _ in entries), self.config.gamma, state)], [None], False)
        else:
            losses = {v: self.mean_val_loss(v) for v, _ in entries}
            scored = [(v, s) for v, s in entries if losses[v] is not None]
            if len(entries) == 1 or not scored:
                # A softmax over one model is 1 whatever its loss: gamma / 2 = lambda.
                chosen, coefs = entries[:1], [2.0 * self.config.vote_scale]
            else:
                if len(scored) < len(entries):
                    # No agent's evaluation of it arrived: Eq. 5's rule cannot weigh it.
                    log.warning("round %d: no validation loss for global versions %s; they sit out the vote",
                                round_, [v for v, _ in entries if losses[v] is None])
                chosen = scored
                coefs = vote_coefficients([losses[v] for v, _ in scored], self.config.vote_scale, self.config.beta)  # type: ignore[misc]
            teachers = _RoundTeachers("vote", [((v,), c, s) for (v, s), c in zip(chosen, coefs)], [losses[v] for v, _ in chosen], False)
            # The starting model's loss is needed for the vote of later rounds (the initial model is never evaluated).
            measure = self.mean_val_loss(self.version) is None and self.config.buffer_size > 1
        teachers.measure_start_loss = measure
        self._round_teachers = {r: t for r, t in self._round_teachers.items() if r >= round_ - 1}
        self._round_teachers[round_] = teachers
        self._reports[round_] = {
            "variant": teachers.variant,
            "buffer_versions": self.buffer.versions(),
            "teacher_versions": [list(v) for v, _, _ in teachers.entries],
            "coefficients": [round(c, 6) for _, c, _ in teachers.entries],
            "teacher_val_losses": [None if l is None else round(l, 6) for l in teachers.losses],
            "teachers_sent": 0, "teachers_held": 0, "teachers_global": 0, "teacher_tensor_bytes": 0,
        }
        return teachers

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        config, weights = super().round_config(round_, agent, evaluate)
        teachers = self._teachers_of(round_)
        held = self.holds.get(agent, set()) | ({self.has_version[agent]} if agent in self.has_version else set())
        report = self._reports[round_]
        specs: list[TeacherSpec] = []
        given = {self.version}
        weights = dict(weights)
        for i, (versions, coefficient, state) in enumerate(teachers.entries):
            if versions == (self.version,):
                source = "global"
            elif teachers.variant == "vote" and versions[0] in held:
                source = "held"
            else:
                source = "sent"
            report[f"teachers_{source}"] += 1
            int_buffers: dict[str, int] = {}
            if source == "sent":
                floats, int_buffers = split_state(state)
                prefix = teacher_prefix(i)
                weights.update({prefix + name: array for name, array in floats.items()})
                report["teacher_tensor_bytes"] += sum(a.nbytes for a in floats.values())
            if len(versions) == 1:
                given.add(versions[0])
            specs.append(TeacherSpec(source=source, coefficient=coefficient, versions=versions, int_buffers=int_buffers))
        self._given[(agent, round_)] = given
        config[CONFIG_KEY] = FedGkdTeachers(variant=teachers.variant, buffer_size=self.config.buffer_size, teachers=tuple(specs),
                                            measure_start_loss=teachers.measure_start_loss).to_dict()
        return config, weights

    # -- uploads and the server step -------------------------------------------------------- #

    def _stage_update(self, agent: str, msg: FedAvgUpdate) -> None:
        super()._stage_update(agent, msg)
        # Its round ran, so it had the round's global model and teachers; the agent keeps them.
        given = self._given.pop((agent, msg.round), set())
        window = set(self.buffer.versions())
        self.holds[agent] = (self.holds.get(agent, set()) | given) & window

    def discard(self, agent: str) -> None:
        super().discard(agent)
        self.holds.pop(agent, None)  # a failed or restarted agent may have lost its copies

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        start_version = self.version
        for agent, end in ends.items():
            s, n = end.metrics.get("start_loss_sum"), end.metrics.get("start_loss_total")
            if isinstance(s, (int, float)) and isinstance(n, int) and not isinstance(n, bool) and s >= 0 and n > 0:
                self._add_loss(start_version, float(s), n)
        outcome = super().complete(round_, ends, evaluate)
        if self.version == round_ and self.version != start_version:
            self.buffer.push(self.version, self.global_state)
            window = set(self.buffer.versions())
            self.val_loss = {v: x for v, x in self.val_loss.items() if v in window}
            for agent in self.holds:
                self.holds[agent] &= window
        self._given = {k: v for k, v in self._given.items() if k[1] > round_}
        return outcome

    def round_report(self, round_: int) -> dict[str, Any]:
        report = dict(self._reports.get(round_, {}))
        if report:
            report["buffer_size"] = len(report["buffer_versions"])
            loss = self.mean_val_loss(round_)
            report["global_val_loss"] = None if loss is None else round(loss, 6)
        return report

    # -- checkpoints ---------------------------------------------------------------------------- #

    def state(self) -> Any:
        return {
            **super().state(),
            "buffer_versions": self.buffer.versions(),
            "buffer": [s for _, s in self.buffer.entries()],
            "val_loss": [[v, s, n] for v, (s, n) in sorted(self.val_loss.items())],
        }

    def load_state(self, state: Any) -> None:
        super().load_state(state)
        self.buffer = ModelBuffer(self.config.buffer_size)
        for version, entry in reversed(list(zip(state["buffer_versions"], state["buffer"]))):
            self.buffer.push(int(version), {k: np.asarray(a) for k, a in entry.items()})
        self.val_loss = {int(v): (float(s), int(n)) for v, s, n in state["val_loss"]}
        self.holds.clear()
        self._given.clear()
        self._round_teachers.clear()


# -- edgesplit local: this method's [fedgkd] table --

# FedAvg's keys (model, local epochs, codecs); gamma, M and the variant keep FedGkdConfig's
# defaults (the paper's CV settings: FedGKD with gamma = 0.2, M = 5).
from .fedavg import launcher_table  # noqa: E402,F401
