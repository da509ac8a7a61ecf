"""FedGKT server step (He et al. 2020, Algorithm 1 ServerExecute, Eq. 6).

The server trains a large model f_s (ResNet-55/109) on the feature maps H that
agents upload, with ``CE + alpha * KD(z_c -> z_s)`` against the edge logits
(bidirectional S<->E) or CE only (S->E and no-KD ablations). In the last of
``server_epochs`` it records its logits z_s for every uploaded sample, keyed by
sample id, and sends each agent its own (Algorithm 1, lines 11-15).

Sync mode trains on all agents' uploads of a round at once; async mode trains
on one agent's upload as soon as it is complete and answers that agent at once.
Staged features are kept as float16 to halve server memory, at most
``staged_memory_bytes`` of them in memory; beyond that, uploads are staged in
memory-mapped files (``spill_dir``) that the training loop reads back, deleted
once the round's training is done (``cloud_server/feature_store.py``).

Maps go up once (``reuse_maps``, with a frozen extractor): the server holds each agent's
accepted maps across rounds and takes later batches that reuse them as their rows
(``fedgkt_reuse.py``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models import build_model, count_parameters, get_model_spec, load_arrays_into, state_dict_to_arrays, training_flops_per_sample
from models.batchnorm import BnStatistics, batchnorm_layers
from models.losses import kd_loss
from models.training import make_lr_schedule, make_optimizer
from shared_protocol.errors import MapsNotHeldError, ShapeMismatchError, ValueRangeError
from shared_protocol.messages import Message, RoundEnd, check_labels
from shared_protocol.methods.fedgkt import GktFeatures, GktResendRequest, GktReusedMaps, GktServerLogits
from shared_protocol.methods.fedgkt_ort import GktOrtArtifactsRequest

from ..feature_store import AgentRows, ArrayStaging, HeldMaps, StagedUploads
from ..robust_config import ImplausibleUploadError
from ..server_step import TrainStep
from .base import AnswersUploads, RoundOutcome, ServerContext, ServerMethod, StreamedUploads, register_server_method
from .fedgkt_config import ALGORITHM_1, EDGE_KEYS, KD_MODES, PAPER_PRESETS, SERVER_ORDERS, FedGktConfig
from .fedgkt_evaluation import FedGktEvaluation
from .fedgkt_label_check import FedGktLabelCheck
from .fedgkt_plausibility import FedGktPlausibility
from .fedgkt_reuse import FedGktReuse
from .fedgkt_training import FedGktTraining

__all__ = ["ALGORITHM_1", "EDGE_KEYS", "KD_MODES", "PAPER_PRESETS", "SERVER_ORDERS", "FedGktConfig", "FedGktServer", "launcher_table"]

log = logging.getLogger("cloud_server.fedgkt")

@register_server_method
class FedGktServer(FedGktTraining, FedGktEvaluation, FedGktPlausibility, FedGktLabelCheck, FedGktReuse, StreamedUploads,
                   AnswersUploads, ServerMethod):
    """The server step; its training, evaluation, plausibility and label checks and held maps are in
    the modules beside it (``fedgkt_training``, ``_evaluation``, ``_plausibility``, ``_label_check``, ``_reuse``)."""

    name = "fedgkt"
    # Torch-free (--backend ort) agents ask for their training artifacts within their first round.
    upload_types = (GktFeatures, GktReusedMaps, GktOrtArtifactsRequest)
    answered_types = (GktOrtArtifactsRequest,)

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.config = FedGktConfig.from_dict(method_config)
        self.device = torch.device(ctx.device)
        # Drawn from the run's own stream, not torch's global RNG, which other threads of the
        # process (in-memory federations) draw from and reseed (models.seeding).
        self.model = build_model(self.config.server_model, ctx.num_classes,
                                 generator=torch.Generator().manual_seed(ctx.seed)).to(self.device)
        self.optimizer = self._make_optimizer()
        self.scheduler = make_lr_schedule(self.config.lr_schedule, self.optimizer)
        self.staged: dict[str, StagedUploads] = {}
        spill_dir = self.config.spill_dir or (str(Path(ctx.out_dir) / "staged") if ctx.out_dir else None)
        # On a GPU every upload is also copied there as it arrives, while it fits (server_step.py).
        self.staging = ArrayStaging(self.config.staged_memory_bytes, spill_dir, np.float16,
                                    prefix=f"fedgkt-{ctx.run_id}", device=self.device)
        self._step: TrainStep | None = None  # the shared server step, made for the current optimiser
        self._ort = None  # OrtArtifactServer, made on the first ort agent's request
        self.feature_shape: tuple[int, ...] | None = None
        # The agents' common starting point (edge_init = "shared"): the edge model drawn from
        # the run's seed, as the torch-free agents' artifacts are (cloud_server/ort_artifacts.py).
        self.edge_init_weights: dict[str, np.ndarray] = {}
        if self.config.edge_init == "shared":
            edge = build_model(self.config.edge_model, ctx.num_classes, ctx.in_channels,
                               generator=torch.Generator().manual_seed(ctx.seed))
            self.edge_init_weights = state_dict_to_arrays(edge)
        self.initialised_agents: set[str] = set()  # agents that finished a round (no initial weights needed)
        self.figures: dict[int, dict[str, Any]] = {}  # round -> the round's own figures (round_report)
        # round -> (server loss, samples) of each training call of the round, until it closes (end_round).
        self.round_losses: dict[int, list[tuple[float, int]]] = {}
        self.norms = batchnorm_layers(self.model)
        # agent -> its BatchNorm statistics, one (mean, var) per layer (the personalised evaluation).
        self.agent_bn: dict[str, BnStatistics] = {}
        # agent -> its test maps of the round it was asked to evaluate (evaluation's uploads).
        self.eval_staged: dict[str, StagedUploads] = {}
        # Async replay: agent -> its latest training maps (held in the staging, not checkpointed:
        # a resumed server replays what arrives after the resume).
        self.replay: dict[str, AgentRows] = {}
        self._init_held_maps()  # maps sent once (fedgkt_reuse.py)
        # Plausibility (cloud_server/robust.py): agent -> (instance, round, {(split, seq)}) of the
        # batches refused at the door (held as arrived: not asked for again), and per agent
        # its round's training maps' per-channel sums of squares, element counts and the
        # logits' sum of squares and count, for the comparison with the other agents.
        self.refused_seqs: dict[str, tuple[str, int, set[tuple[str, int]]]] = {}
        self.upload_stats: dict[str, tuple[str, int, np.ndarray, int, float, int]] = {}
        self.recent_losses: list[float] = []  # the server steps' last losses (the guard's running range)
        self.label_agreement_latest: dict[str, float] = {}  # the label check's figures (fedgkt_label_check.py)
        self.label_agreement_round: tuple[int, dict[str, dict[str, Any]]] = (0, {})

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        return make_optimizer(c.server_optimizer, self.model.parameters(), c.server_lr, c.server_momentum, c.server_weight_decay, self.device)

    def _trainer(self) -> TrainStep:
        """The shared server step (cloud_server/server_step.py) for the model and the current
        optimiser, with Eq. 6's loss: CE, plus alpha * KD(z_c -> z_s) when bidirectional."""
        if self._step is None or self._step.optimizer is not self.optimizer:
            alpha, temperature = self.config.edge.alpha, self.config.edge.temperature
            with_kd = self.config.kd == "bidirectional" and alpha > 0

            def loss_fn(logits: torch.Tensor, labels: torch.Tensor, edge_logits: torch.Tensor) -> torch.Tensor:
                loss = F.cross_entropy(logits, labels)  # (B, K) vs (B,)
                return loss + alpha * kd_loss(logits, edge_logits, temperature) if with_kd else loss

            self._step = TrainStep(self.model, self.optimizer, loss_fn, self.ctx.server_step, name="fedgkt")
        return self._step

    @property
    def schedule(self) -> str:  # type: ignore[override]
        """``mode``: "sync" or "async", the same method on either schedule."""
        return self.config.mode

    def welcome_settings(self) -> dict[str, Any]:
        settings = {"num_classes": self.ctx.num_classes, "edge_model": self.config.edge_model, "edge_init": self.config.edge_init}
        if self.config.private_extractor:  # the agents score extractor + server model themselves
            settings["server_model"] = self.config.server_model
        return settings

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        # The initial edge weights go with every RoundStart until the agent has finished a
        # round (a lost RoundStart must not leave it on its own initialisation); an agent that
        # has already trained ignores them.
        weights = self.edge_init_weights if agent not in self.initialised_agents else {}
        return asdict(self._with_held_maps(self.config.round_config(), agent)), dict(weights)

    def end_round(self, round_: int) -> None:
        """Step the lr schedule once per round with the round's sample-weighted server loss. In
        sync mode that is the one ``complete``'s loss; in async mode each agent's arrival trains
        on its own (label-skewed) maps, and stepping per arrival would count ``patience`` in
        arrivals and compare one agent's loss with another's (an easy agent's low loss would halve
        the rate at almost every later arrival)."""
        losses = self.round_losses.pop(round_, [])
        samples = sum(n for _, n in losses)
        if self.scheduler is not None and samples > 0:
            self.scheduler.step(sum(loss * n for loss, n in losses) / samples)

    def round_report(self, round_: int) -> dict[str, Any]:
        return self.figures.pop(round_, {})

    def model_info(self) -> dict[str, Any]:
        edge = build_model(self.config.edge_model, self.ctx.num_classes, self.ctx.in_channels)
        h, c = 32, get_model_spec(self.config.server_model).feature_channels  # maps are c x 32 x 32 for 32 x 32 inputs
        return {
            "edge": {
                "name": self.config.edge_model,
                "params": count_parameters(edge),
                "train_flops_per_sample": training_flops_per_sample(edge, (self.ctx.in_channels, h, h)),
            },
            "server": {
                "name": self.config.server_model,
                "params": count_parameters(self.model),
                # A fresh copy on the CPU: the counter must not move the training model.
                "train_flops_per_sample": training_flops_per_sample(build_model(self.config.server_model, self.ctx.num_classes), (c, h, h)),
            },
        }

    # -- uploads ------------------------------------------------------------ #

    def max_upload_bytes(self, agent: str) -> int | None:
        """A feature batch of ``upload_batch_samples`` samples with float32 maps, whatever the
        codec (a compressed one is smaller; zstd's worst case adds well under 1%), plus the
        logits, labels and ids; once the first upload told the map shape. Before, None."""
        if self.feature_shape is None:
            return None
        per_sample = 4 * math.prod(self.feature_shape) + 4 * self.ctx.num_classes + 8 + 8
        return int(1.02 * self.config.edge.upload_batch_samples * per_sample) + 256 * 1024  # + header and codec framing

    def answer(self, agent: str, msg: Message) -> Message | None:
        """A torch-free agent's request for its training artifacts (made on the first)."""
        if not isinstance(msg, GktOrtArtifactsRequest):
            raise ValueRangeError(f"fedgkt does not answer {msg.TYPE} uploads")
        if self._ort is None:
            from ..ort_artifacts import OrtArtifactServer

            self._ort = OrtArtifactServer(self.ctx.run_id, self.config.edge_model, self.ctx.num_classes, self.ctx.seed,
                                          train_extractor=self.config.edge.train_extractor)
        return self._ort.reply(msg)

    def on_upload(self, agent: str, msg: Message) -> None:
        if isinstance(msg, GktReusedMaps):
            self._on_reused(agent, msg)
            return
        if not isinstance(msg, GktFeatures):
            raise ValueRangeError(f"fedgkt does not take {msg.TYPE} uploads")
        if msg.logits.shape[1] != self.ctx.num_classes:
            raise ShapeMismatchError(f"edge logits have {msg.logits.shape[1]} classes, run has {self.ctx.num_classes}")
        check_labels(msg.TYPE, msg.labels, self.ctx.num_classes)
        shape = tuple(msg.features.shape[1:])
        if self.feature_shape is None:
            if shape[0] != (channels := get_model_spec(self.config.server_model).feature_channels):
                raise ShapeMismatchError(f"feature maps must have {channels} channels ({self.config.server_model}), got {shape}")
            self.feature_shape = shape
        elif shape != self.feature_shape:
            raise ShapeMismatchError(f"feature maps {shape}, earlier uploads were {self.feature_shape}")
        if self.ctx.robustness.plausibility_checks:
            try:
                self._check_plausible(agent, msg)
            except ImplausibleUploadError:
                instance, round_, seqs = self.refused_seqs.get(agent, (msg.instance, msg.round, set()))
                if (instance, round_) != (msg.instance, msg.round):
                    seqs = set()
                seqs.add((msg.split, msg.seq))
                self.refused_seqs[agent] = (msg.instance, msg.round, seqs)
                raise
        self._stage(agent, msg)

    def _stage(self, agent: str, msg: GktFeatures | GktReusedMaps, reused: tuple[HeldMaps, np.ndarray] | None = None) -> None:
        # Test maps are evaluation's: kept apart (in async mode the agent is in its next round by
        # the time they arrive, and its next round's training maps must not void them).
        if any(h.instance != msg.instance for h in (self.staged.get(agent), self.eval_staged.get(agent)) if h is not None):
            self.discard(agent)  # a new process (restart): everything its predecessor staged is void
        store = self.eval_staged if msg.split == "test" else self.staged
        held = store.get(agent)
        if held is None or held.round != msg.round:
            self._release(store, agent)  # a new round: this kind's earlier uploads are void
            held = store[agent] = StagedUploads(msg.instance, msg.round)
        held.add(msg, self.staging, self.config.max_staged_samples_per_agent, agent, reused=reused)

    def _release(self, store: dict[str, StagedUploads], agent: str) -> None:
        held = store.pop(agent, None)
        if held is not None:
            self.staging.release_all(held.staged_arrays())

    def discard(self, agent: str) -> None:
        """Forget ``agent``'s uploads of its current round; the maps held from rounds it
        completed stay (their digest, not the process, says what they are)."""
        self._release(self.eval_staged, agent)
        self._release(self.staged, agent)

    def missing_uploads(self, agent: str, end: RoundEnd) -> list[Message]:
        """Batches the agent says it sent but that never arrived (e.g. lost with a
        restarting broker): ask for exactly those; the agent re-extracts them."""
        staged = self.staged.get(agent)
        if staged is not None and (staged.instance != end.instance or staged.round != end.round):
            return []  # another process's uploads: nothing to complete
        requests: list[Message] = []
        refused = self.refused_seqs.get(agent)
        refused_seqs = refused[2] if refused is not None and refused[:2] == (end.instance, end.round) else set()
        for split in ("train", "test"):
            info = end.uploads.get(split)
            if not isinstance(info, dict) or not isinstance(info.get("batches"), int):
                continue
            have = set() if staged is None else set(staged.train if split == "train" else staged.test)
            have |= {seq for s, seq in refused_seqs if s == split}  # arrived, refused: not asked for again
            missing = sorted(set(range(info["batches"])) - have)
            requests += self._maps_requests(agent, end, split, missing)  # claims it could not serve: in full
            again = [seq for seq in missing if seq not in self._wanted(agent, end.instance, end.round, split)]
            if again:
                requests.append(GktResendRequest(run=self.ctx.run_id, round=end.round, sender="server", split=split, seqs=again))
        return requests

    # -- the server step ----------------------------------------------------- #

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        outcome = RoundOutcome()
        data: dict[str, AgentRows] = {}
        digests: dict[str, str] = {}  # agent -> the maps digest its round's batches gave ("": none)
        implausible = self._screen(round_, ends)
        try:
            for agent in sorted(ends):
                staged = self.staged.get(agent)
                why = implausible.get(agent) or ("no feature uploads" if staged is None else staged.why_unusable(ends[agent]))
                if why is not None:
                    outcome.excluded[agent] = why
                    log.warning("round %d: not using %s's upload: %s", round_, agent, why)
                    self.discard(agent)
                    continue
                staged = self.staged.pop(agent)
                try:
                    data[agent] = self._agent_rows(agent, "train", [staged.train[k] for k in sorted(staged.train)])
                    digests[agent] = staged.digest("train")
                except MapsNotHeldError as exc:  # never trained on maps it no longer holds
                    outcome.excluded[agent] = f"{exc.code}: {exc}"
                    log.warning("round %d: not using %s's upload: %s", round_, agent, outcome.excluded[agent])
                finally:
                    # Normally already released by gather_batches; after a failed gather (disk full) this frees the rest.
                    self.staging.release_all(staged.staged_arrays())
            for agent, why in self._check_labels(round_, data).items():  # before any training on them
                outcome.excluded[agent] = why
                log.warning("round %d: not using %s's upload: %s", round_, agent, why)
                self._release_rows(data.pop(agent)[0].staged)
            # A quarantined agent's maps were judged like the others' (what releases it), never trained on.
            for agent in [a for a in data if self.ctx.ledger.is_quarantined(a)]:
                outcome.excluded[agent] = self.ctx.ledger.exclude_quarantined(round_, agent)
                log.warning("round %d: not using %s's upload: %s", round_, agent, outcome.excluded[agent])
                self._release_rows(data.pop(agent)[0].staged)
            outcome.used_agents = list(data)
            self.initialised_agents.update(data)
            if not data:
                return outcome
            replayed = self._replayed(data)
            started = time.perf_counter()
            with self.ctx.device_meter.training():
                logits_by_agent, loss = self._train({**data, **replayed}, round_, fresh=list(data) if replayed else None)
            outcome.server_train_s = time.perf_counter() - started
            outcome.server_loss = loss
            outcome.samples = sum(len(d[3]) for d in data.values())
            if math.isfinite(loss):  # the schedule steps once per round, when it closes (end_round)
                self.round_losses.setdefault(round_, []).append((loss, outcome.samples))
            if self.config.kd != "none":
                for agent, (ids, logits) in logits_by_agent.items():
                    outcome.downloads.append(
                        (agent, GktServerLogits(run=self.ctx.run_id, round=round_, sender="server", sample_ids=ids, logits=logits))
                    )
            if evaluate and self._personalised(round_):
                # The agents' own BatchNorm statistics for the personalised evaluation, from the
                # maps they just sent (the same extractor is evaluated).
                for agent in data:
                    self.agent_bn[agent] = self._calibrate(data[agent][0])
            self._hold_trained(data, digests)  # for the next rounds' claims
            if self._replaying:
                for agent, rows in data.items():  # kept for the other agents' arrivals; the agent's older maps go
                    old = self.replay.pop(agent, None)
                    self.replay[agent] = rows
                    if old is not None:
                        self._release_rows(old[0].staged)
                data = {}
            return outcome
        finally:
            # The round's training is done (or failed): its staged features, and spill files, go
            # (unless held for reuse or replay).
            for rows in data.values():
                self._release_rows(rows[0].staged)

    # -- checkpoints ---------------------------------------------------------- #

    def state(self) -> Any:
        return {
            "model": state_dict_to_arrays(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "feature_shape": list(self.feature_shape) if self.feature_shape else None,
            "initialised_agents": sorted(self.initialised_agents),
            # Async: rounds still open when the checkpoint is taken (a later round's arrivals trained).
            "round_losses": {str(r): [[loss, n] for loss, n in v] for r, v in self.round_losses.items()},
            "agent_bn": {agent: {f"{i}/{part}": t.cpu().numpy() for i, pair in enumerate(stats) for part, t in zip(("mean", "var"), pair)}
                         for agent, stats in self.agent_bn.items()},
        }

    def load_state(self, state: Any) -> None:
        load_arrays_into(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._step = None  # a captured step would update the optimiser's old state tensors
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.feature_shape = tuple(state["feature_shape"]) if state.get("feature_shape") else None
        self.initialised_agents = set(state.get("initialised_agents", []))
        self.round_losses = {int(r): [(float(loss), int(n)) for loss, n in v] for r, v in (state.get("round_losses") or {}).items()}
        self.agent_bn = {
            agent: [(torch.as_tensor(arrays[f"{i}/mean"]).to(self.device), torch.as_tensor(arrays[f"{i}/var"]).to(self.device))
                    for i in range(len(self.norms))]
            for agent, arrays in (state.get("agent_bn") or {}).items()
        }


# -- edgesplit local: this method's [fedgkt] table --

from ..local_run import LocalRunOptions  # noqa: E402


LAUNCHER_KEYS = {"mode": "mode", "kd": "kd", "server_model": "server_model", "server_epochs": "server_epochs",
                 "edge_epochs": "edge_epochs", "codec": "upload_codec"}  # flag dest -> [fedgkt] key


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """Mode, KD direction, the server's model and epochs, the feature maps' codec: the flags
    given, and only those. A flag left out leaves its key unset, so FedGktConfig's default
    holds, or the preset's value when ``--set fedgkt.preset=paper-iid`` names one (a preset
    fills every key the table does not set: writing the flags' defaults here ran a "paper-iid"
    run with 1 server epoch instead of Table 10's 20). The flags' declared defaults are
    FedGktConfig's own (tests/test_fedgkt_defaults.py checks it)."""
    return {key: options.flag(dest) for dest, key in LAUNCHER_KEYS.items() if options.given(dest)}
