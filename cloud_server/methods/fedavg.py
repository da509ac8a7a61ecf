"""FedAvg server step (McMahan et al. 2017; the FedGKT paper's accuracy baseline).

Each round every agent receives the global model, trains the *full* model
(ResNet-56 / ResNet-110, or ResNet-8 as a small full model) for
``local_epochs`` on its shard, and uploads it with its sample count; the
server's new global model is the sample-weighted mean
(:func:`cloud_server.aggregation.weighted_mean`, which documents how BatchNorm
buffers are averaged).

Evaluation (cloud_server/evaluation.py): the deployed model is the round's
aggregate, held here; the evaluator scores it on the run's global test set. In
an evaluated round the new global model also goes to the agents that finished
(:class:`FedAvgGlobalModel`), before the evaluation request, so they score it on
their own shards (the local figure). The agents keep that model, so the next
RoundStart names its version instead of carrying the weights again.

Subclass hooks for the FedAvg family (FedGKD, FedDistill, FedBE): override
:meth:`FedAvgServer.aggregate` (e.g. distil after averaging) and
:meth:`FedAvgServer.extra_round_config`; the edge side's loss lives in
``edge_agent/methods/fedavg.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from models import build_model, count_parameters, get_model_spec, load_arrays_into, state_dict_to_arrays, training_flops_per_sample
from models.training import logits_of
from shared_protocol.configs import EmbeddedRoundConfig, config_from_table
from shared_protocol.errors import SecAggError, ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import EvalReport, Message, RoundEnd, RoundStart
from shared_protocol.secagg_messages import SECAGG_UPLOADS
from shared_protocol.methods.fedavg import (
    WEIGHT_CODECS,
    FedAvgGlobalModel,
    FedAvgRoundConfig,
    FedAvgUpdate,
    join_state,
    split_state,
)

from ..aggregation import weighted_mean
from ..evaluation import HEADLINE, EvalModel, Evaluation
from ..robust.rules import robust_state_aggregate
from ..robust.screening import screen_uploads
from ..staging import ModelUploadStage, StagedUpload
from .base import RoundOutcome, ServerContext, ServerMethod, register_server_method

log = logging.getLogger("cloud_server.fedavg")


# How a FedAvg-family table names the fields of the FedAvgRoundConfig its config holds: by
# their own names; the global model's version and counters are the server's, per round.
EDGE_KEYS = EmbeddedRoundConfig(FedAvgRoundConfig, "edge", derived=("model_version", "int_buffers"))


@dataclass(frozen=True)
class FedAvgConfig:
    """``[fedavg]``. Defaults are CPU-friendly; the paper's (Tables 10-12: Adam,
    lr 0.001, wd 1e-4, batch 64, 20 local epochs) are in ``deploy/configs/paper``."""

    TABLE: ClassVar[str] = "fedavg"  # the TOML table (the FedAvg family's configs extend this one)
    # One line per key of the [fedavg] table, which the FedAvg family's tables extend
    # (docs/configuration.md is rendered from it by bench/render_results.py).
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "model": "`resnet56`, `resnet110`, or `resnet8` (small)",
        "local_epochs, optimizer, lr, momentum, weight_decay, batch_size": "local training, sent with every round",
        "upload_codec, download_codec": "weights codec up / down: `zstd` (lossless), `fp16-zstd`, `raw`; BatchNorm "
                                        "counters always exact",
    }

    model: str = "resnet56"  # resnet56 | resnet110 | resnet8 (a small full model)
    # The agents' local training, sent as RoundStart.config: local_epochs, optimizer, lr,
    # momentum, weight_decay, batch_size, upload_codec (zstd (lossless) | fp16-zstd | raw);
    # all written in the table itself (EDGE_KEYS).
    edge: FedAvgRoundConfig = field(default_factory=FedAvgRoundConfig)
    download_codec: str = "zstd"

    def __post_init__(self) -> None:
        if get_model_spec(self.model).input_kind != "image":
            raise ValueError(f"{self.TABLE}.model must take images (a full model), {self.model!r} takes feature maps")
        if self.download_codec not in WEIGHT_CODECS:
            raise ValueError(f"{self.TABLE}.download_codec must be one of {WEIGHT_CODECS}, got {self.download_codec!r}")

    def round_config(self, model_version: int, int_buffers: dict[str, int]) -> FedAvgRoundConfig:
        return replace(self.edge, model_version=model_version, int_buffers=dict(int_buffers))

    def to_table(self) -> dict[str, Any]:
        """The flat table this config reads back from (reports, checkpoints)."""
        return EDGE_KEYS.table_of(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "FedAvgConfig":
        return config_from_table(cls, raw, cls.TABLE, embedded=EDGE_KEYS)


@dataclass
class _Staged(StagedUpload):
    state: dict[str, np.ndarray]


@register_server_method
class FedAvgServer(ServerMethod):
    name = "fedavg"
    upload_types = (FedAvgUpdate, *SECAGG_UPLOADS)
    aggregates_weights = True
    sums_updates = True  # secure aggregation applies ([server] secure_aggregation)
    config_class: type[FedAvgConfig] = FedAvgConfig

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.config = self.config_class.from_dict(method_config)
        # The global model lives on the CPU: the server only averages arrays. Its initial weights
        # come from the run's own stream, not torch's global RNG, which other threads of the
        # process (in-memory federations) draw from and reseed (models.seeding).
        self.model = build_model(self.config.model, ctx.num_classes, ctx.in_channels,
                                 generator=torch.Generator().manual_seed(ctx.seed))
        self.global_state = state_dict_to_arrays(self.model)
        self.version = 0  # round whose aggregate global_state is (0: the initial model)
        self.staged: ModelUploadStage[_Staged] = ModelUploadStage("model upload", log)
        self.has_version: dict[str, int] = {}  # agent -> global version it confirmed holding
        self._aggregating: list[str] = []  # the agents whose states aggregate() is averaging (in order)
        self.secagg = None  # cloud_server.secagg_server.SecAggRounds when [server] secure_aggregation is on
        if ctx.secagg is not None:
            from ..secagg_server import SecAggRounds  # needs cryptography and pycryptodome

            floats, _ = split_state(self.global_state)
            self.secagg = SecAggRounds(ctx.run_id, ctx.secagg, list(floats), sum(a.size for a in floats.values()))

    # -- configuration --------------------------------------------------------- #

    def welcome_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {"num_classes": self.ctx.num_classes, "model": self.config.model}
        if self.secagg is not None:
            settings["secagg"] = self.secagg.params.to_dict()
        return settings

    @property
    def download_codecs(self) -> dict[str, dict[str, str]]:  # type: ignore[override]
        weights = {"weights": self.config.download_codec}
        return {RoundStart.TYPE: weights, FedAvgGlobalModel.TYPE: weights}

    def extra_round_config(self, round_: int, agent: str) -> dict[str, Any]:
        """Method-specific additions to RoundStart.config (for subclasses)."""
        return {}

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        floats, ints = split_state(self.global_state)
        config = {**self.config.round_config(self.version, ints).to_dict(), **self.extra_round_config(round_, agent)}
        # An agent that confirmed holding this version (it evaluated it) needs no second copy.
        weights = {} if self.has_version.get(agent) == self.version else floats
        if self.secagg is not None:
            self.secagg.expect(round_, agent)
        return config, weights

    def model_info(self) -> dict[str, Any]:
        shape = (self.ctx.in_channels, 32, 32)
        return {
            "edge": {
                "name": self.config.model,
                "params": count_parameters(self.model),
                "train_flops_per_sample": training_flops_per_sample(self.model, shape),
            },
            "server": None,  # the server only averages
        }

    # -- uploads ----------------------------------------------------------------- #

    def on_upload(self, agent: str, msg: Message) -> None:
        if isinstance(msg, SECAGG_UPLOADS) and self.secagg is not None:
            self.secagg.receive(agent, msg)
        elif not isinstance(msg, FedAvgUpdate) or self.secagg is not None:
            raise ValueRangeError(f"{self.name} does not take {msg.TYPE} uploads with [server] secure_aggregation "
                                  f"{'on' if self.secagg is not None else 'off'}")
        else:
            self._stage_update(agent, msg)

    def due_messages(self) -> list[tuple[str, Message]]:
        return self.secagg.due() if self.secagg is not None else []

    def secagg_report(self, round_: int) -> dict[str, Any]:
        return self.secagg.report(round_) if self.secagg is not None else {}

    def _stage_update(self, agent: str, msg: FedAvgUpdate) -> None:
        if msg.model_version != self.version:
            raise StaleMessageError(f"update trained from global version {msg.model_version}, current is {self.version}")
        state = join_state(msg.weights, msg.int_buffers)
        if set(state) != set(self.global_state):
            missing, extra = sorted(set(self.global_state) - set(state)), sorted(set(state) - set(self.global_state))
            raise ShapeMismatchError(f"update does not fit {self.config.model}: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, array in state.items():
            if array.shape != self.global_state[name].shape:
                raise ShapeMismatchError(f"update {name!r} has shape {array.shape}, model has {self.global_state[name].shape}")
        self.staged[agent] = _Staged(msg.instance, msg.round, msg.num_samples, state)

    def discard(self, agent: str) -> None:
        self.staged.pop(agent, None)
        if self.secagg is not None:
            self.secagg.drop(agent)
        # A failed or restarted agent may not hold the global model any more.
        self.has_version.pop(agent, None)

    # -- the server step ------------------------------------------------------------ #

    def aggregate(self, round_: int, states: list[dict[str, np.ndarray]], num_samples: list[int]) -> dict[str, np.ndarray]:
        """The new global state from the agents' states (FedAvg: the sample-weighted mean, or
        the run's robust rule: :meth:`average`)."""
        return self.average(round_, states, num_samples)

    def average(self, round_: int, states: list[dict[str, np.ndarray]], num_samples: list[int]) -> dict[str, np.ndarray]:
        """``[server] aggregation`` over the agents' states (cloud_server/robust/): the
        sample-weighted mean by default, exactly as before; a robust rule or clipping works on
        the updates (state - global) and its figures go to the round's robustness record; with
        ``[server] dp_fedavg`` central or client-side clipping, the noised mean of the clipped
        updates (cloud_server/privacy.py)."""
        if self.secagg is not None:  # the secure sum's one state, noised already where DP-FedAvg asks (_secure_sum)
            return states[0]
        agents = self._aggregating or [f"#{k}" for k in range(len(states))]
        if self.ctx.privacy.cfg.server_noises:  # DP-FedAvg: the noised mean of clipped updates, uniform
            return self.ctx.privacy.noised_state_mean(round_, agents, self.global_state, states)
        cfg = self.ctx.robustness
        if cfg.plain_mean:
            return weighted_mean(states, num_samples)
        new_state, figures = robust_state_aggregate(self.global_state, states, num_samples, cfg)
        for row, norm in figures.pop("clipped"):
            self.ctx.ledger.clip(round_, agents[row], "update_norm",
                                 f"update norm {norm:.4g} clipped to {cfg.clip_update_norm:g}")
        figures["used"] = [agents[k] for k in figures["used"]]
        self.ctx.ledger.aggregation(round_, figures)
        return new_state

    def screen(self, round_: int, used: dict[str, _Staged], excluded: dict[str, str]) -> dict[str, _Staged]:
        """Plausibility and quarantine (cloud_server/robust/): each update's norm against the
        global model's and the other agents' this round, and its direction against the round's
        median update, and, with a server validation set, by the validation loss of the global model
        plus the update; an implausible one is refused (to the ledger, and ``excluded`` with its
        reason), a quarantined agent's is judged but not used."""
        floats = [n for n, a in self.global_state.items() if a.dtype.kind == "f"]

        def measure() -> tuple[dict[str, float], float]:
            base = {n: self.global_state[n].astype(np.float64) for n in floats}
            reference = float(np.sqrt(sum(float(np.sum(b * b)) for b in base.values())))
            norms = {a: float(np.sqrt(sum(float(np.sum((s.state[n].astype(np.float64) - base[n]) ** 2)) for n in floats)))
                     for a, s in used.items()}
            return norms, reference

        def blocks(agents: Sequence[str]) -> Iterator[np.ndarray]:
            for n in floats:
                base = self.global_state[n].astype(np.float64).ravel()
                yield np.stack([used[a].state[n].astype(np.float64).ravel() - base for a in agents])  # (K, entries)

        judge = None  # the server's validation set, when it holds one (cloud_server/robust/validation_screen.py)
        if self.ctx.validation is not None:
            judge = self.ctx.validation.judge_states(round_, self.ctx.ledger, self.model, lambda m, x: logits_of(m(x)),
                                                     self.global_state, lambda a: used[a].state)
        return screen_uploads(round_, used, excluded, self.ctx.robustness, self.ctx.ledger, measure, blocks, judge)

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        outcome = RoundOutcome()
        if self.secagg is not None:
            outcome.used_agents, states, counts = self._secure_sum(round_, ends, outcome)
        else:
            used, outcome.excluded = self.staged.take_usable(round_, ends)
            used = self.screen(round_, used, outcome.excluded)
            outcome.used_agents = list(used)
            states, counts = [s.state for s in used.values()], [s.num_samples for s in used.values()]
        if not states:
            return outcome
        started = time.perf_counter()
        self._aggregating = list(outcome.used_agents) if len(states) == len(outcome.used_agents) else []
        try:
            new_state = self.aggregate(round_, states, counts)
        finally:
            self._aggregating = []
        load_arrays_into(self.model, new_state)  # checks names, shapes and finiteness
        self.global_state = new_state
        self.version = round_
        outcome.server_train_s = time.perf_counter() - started
        outcome.samples = sum(counts)
        losses = [(float(ends[a].metrics["train_loss"]), ends[a].num_samples) for a in outcome.used_agents
                  if a in ends and isinstance(ends[a].metrics.get("train_loss"), (int, float))]
        if losses:
            # No server model is trained: report the agents' mean local training loss.
            outcome.server_loss = sum(l * n for l, n in losses) / sum(n for _, n in losses)
        if evaluate:
            # The deployed model to the agents, ahead of the evaluation request (they keep it).
            floats, ints = split_state(self.global_state)
            for agent in sorted(ends):
                msg = FedAvgGlobalModel(run=self.ctx.run_id, round=round_, sender="server", model_version=self.version,
                                        int_buffers=ints, weights=floats)
                outcome.downloads.append((agent, msg))
        return outcome

    def _secure_sum(self, round_: int, ends: dict[str, RoundEnd],
                    outcome: RoundOutcome) -> tuple[list[str], list[dict[str, np.ndarray]], list[int]]:
        """(survivors, states, sample counts) of a secure-aggregation round: one state, the global
        model plus the weighted mean update the survivors' masked inputs sum to (so the method's
        aggregate of it is itself). No single update is seen, so none is screened. With DP-FedAvg
        (``client_clipping``; the agents clipped before masking) the noise goes on the unmasked sum
        (cloud_server/privacy.py)."""
        self.secagg.agent_costs[round_] = {a: float(e.metrics["secagg_s"]) for a, e in ends.items()
                                           if isinstance(e.metrics.get("secagg_s"), (int, float))}
        privacy = self.ctx.privacy
        mean_of = None
        if privacy.cfg.server_noises:
            def mean_of(update_sum: dict[str, np.ndarray], result: Any) -> dict[str, np.ndarray]:
                return privacy.noised_secure_mean(round_, result.survivors, update_sum, result.weight_sum, result.sampled)
        try:
            finished = self.secagg.finish(round_, self.global_state, mean_of)
        except SecAggError as exc:
            log.error("round %d: the secure sum is not DP-FedAvg's: %s", round_, exc)
            finished = None
        if finished is None:
            outcome.excluded.update({a: "secure aggregation did not finish" for a in ends})
            return [], [], []
        state, result = finished
        outcome.excluded.update({a: "not among the secure sum's survivors" for a in ends if a not in result.survivors})
        return list(result.survivors), [state], [sum(result.num_samples.values())]

    # -- evaluation ------------------------------------------------------------------- #

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        """The global model (with its averaged BatchNorm statistics) on the global set; on the
        agents' shards, the answers about this very version."""
        self.model.eval()
        ev = Evaluation(
            global_models={HEADLINE: {Evaluation.GLOBAL: EvalModel(lambda x: logits_of(self.model(x)), device="cpu")}},
            labels={HEADLINE: f"the global {self.config.model} (sample-weighted mean of the agents' models, BatchNorm "
                              "statistics averaged with them)"},
        )
        for agent, report in sorted(reports.items()):
            figures = report.results.get(HEADLINE)
            if figures is None:
                continue
            if figures.get("version") != self.version:
                log.warning("round %d: %s evaluated global version %s, current is %d: not counted", round_, agent,
                            figures.get("version"), self.version)
                continue
            self.has_version[agent] = self.version
            ev.local.setdefault(HEADLINE, {})[agent] = (int(figures["correct"]), int(figures["total"]))
        return ev

    # -- checkpoints ------------------------------------------------------------------ #

    def state(self) -> Any:
        return {"global": self.global_state, "version": self.version}

    def load_state(self, state: Any) -> None:
        self.global_state = {k: np.asarray(v) for k, v in state["global"].items()}
        load_arrays_into(self.model, self.global_state)
        self.version = int(state["version"])
        self.has_version.clear()


# -- edgesplit local: this method's [fedavg] table --

from ..local_run import LocalRunOptions  # noqa: E402


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """The model and local epochs; ``--codec`` sets one codec both ways (otherwise the
    config's default, lossless zstd)."""
    table: dict[str, Any] = {"model": options.flag("model"), "local_epochs": options.flag("edge_epochs")}
    if options.flag("codec"):
        table.update(upload_codec=options.flag("codec"), download_codec=options.flag("codec"))
    return table
