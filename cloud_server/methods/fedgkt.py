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
accepted maps across rounds and takes later batches that reuse them as their rows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from models import build_model, count_parameters, get_model_spec, load_arrays_into, state_dict_to_arrays, training_flops_per_sample
from models.batchnorm import (BnStatistics, batchnorm_layers, load_bn_statistics, measure_bn_statistics,
                              restoring_bn_statistics)
from models.losses import kd_loss
from models.train_step import DeviceSum
from models.training import INFERENCE_BATCH_SAMPLES, Batch, StepSkipped, Trainer, make_lr_schedule, make_optimizer
from models.weights import WeightsMismatchError
from shared_protocol.errors import MapsNotHeldError, ShapeMismatchError, ValueRangeError
from shared_protocol.messages import EvalReport, Message, RoundEnd, check_labels
from shared_protocol.methods.fedgkt import (GktEvalModel, GktFeatures, GktMapsRequest, GktResendRequest, GktReusedMaps,
                                            GktRoundConfig, GktServerLogits)
from shared_protocol.methods.fedgkt_ort import GktOrtArtifactsRequest

from ..evaluation import HEADLINE, EvalModel, Evaluation, global_results, local_results, models_from_report, module_digest
from ..feature_store import (AgentRows, ArrayStaging, HeldMaps, RowSource, StagedArray, StagedBatch, StagedUploads,
                             gather_batches, materialise, reused_whole)
from ..robust.config import MAD_TO_SD, ImplausibleUploadError
from ..robust.validation import LABEL_CHECK_FROM_ROUND, LABEL_MIN_OTHERS, implausible_labels
from ..row_bank import banks_for_staged_rows
from ..server_step import TrainStep
from .base import AnswersUploads, RoundOutcome, ServerContext, ServerMethod, StreamedUploads, register_server_method
from .fedgkt_config import ALGORITHM_1, EDGE_KEYS, KD_MODES, PAPER_PRESETS, SERVER_ORDERS, FedGktConfig

__all__ = ["ALGORITHM_1", "EDGE_KEYS", "KD_MODES", "PAPER_PRESETS", "SERVER_ORDERS", "FedGktConfig", "FedGktServer", "launcher_table"]

log = logging.getLogger("cloud_server.fedgkt")


def _rounded(value: float) -> float | None:
    """Strict JSON: NaN (an agent with no samples) is written as null."""
    return round(value, 6) if value == value else None


@register_server_method
class FedGktServer(StreamedUploads, AnswersUploads, ServerMethod):
    """The server step: configuring and taking a round, then (sections below) its training,
    evaluation, plausibility and label checks and the maps it holds across rounds."""

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
        self._init_held_maps()  # maps sent once (the section on held maps below)
        # Plausibility (cloud_server/robust/): agent -> (instance, round, {(split, seq)}) of the
        # batches refused at the door (held as arrived: not asked for again), and per agent
        # its round's training maps' per-channel sums of squares, element counts and the
        # logits' sum of squares and count, for the comparison with the other agents.
        self.refused_seqs: dict[str, tuple[str, int, set[tuple[str, int]]]] = {}
        self.upload_stats: dict[str, tuple[str, int, np.ndarray, int, float, int]] = {}
        # agent -> (maps digest, per-channel mean square) of the training maps it last had
        # accepted: a batch that reuses held maps counts with these in the comparison, so the
        # peers' yardstick stands while their maps are not sent again.
        self.accepted_map_ms: dict[str, tuple[str, np.ndarray]] = {}
        # agent -> (instance, round, the maps digests of the batches it sent in full this round).
        self.round_digests: dict[str, tuple[str, int, set[str]]] = {}
        self.recent_losses: list[float] = []  # the server steps' last losses (the guard's running range)
        self.label_agreement_latest: dict[str, float] = {}  # the label check's figures (its section below)
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

    # -- training: Algorithm 1's server epochs on the staged maps, the logits per sample id

    @property
    def _replaying(self) -> bool:
        return self.config.mode == "async" and self.config.async_replay

    def _replayed(self, fresh: dict[str, AgentRows]) -> dict[str, AgentRows]:
        """The other agents' latest maps to train with beside ``fresh`` (async replay; {} otherwise)."""
        if not self._replaying:
            return {}
        return {a: rows for a, rows in sorted(self.replay.items()) if a not in fresh}

    def _batches(self, data: dict[str, tuple], generator: torch.Generator) -> list[list[tuple[int, torch.Tensor]]]:
        """One epoch's batches, each a list of (agent position, sample indices into that
        agent's data) pieces.

        Eq. 8 sums the loss over all agents' samples; Algorithm 1 walks it agent by
        agent. ``server_order = "per_agent"`` keeps that walk; ``"shuffled"`` shuffles
        the order of the per-agent batches (each batch still one agent's maps), which keeps
        the server from forgetting earlier agents' feature maps within an epoch; the
        default ``"mixed"`` draws every batch from the union of all agents' maps, so no
        batch, and no BatchNorm batch statistic, belongs to one agent: with label-skewed
        agents, one-agent batches let the server tell the agents apart by their batch
        statistics and learn each one's label mix, and the running statistics it is evaluated
        with fit none of them (docs/methods/fedgkt.md).
        """
        c = self.config
        sizes = [len(d[3]) for d in data.values()]
        if c.server_order == "mixed":
            agent_of = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(sizes)])  # (N,)
            row_of = torch.cat([torch.arange(n) for n in sizes])  # (N,)
            plans = []
            for chunk in torch.randperm(len(agent_of), generator=generator).split(c.server_batch_size):
                pieces = [(k, row_of[chunk[agent_of[chunk] == k]]) for k in range(len(sizes))]
                plans.append([(k, rows) for k, rows in pieces if len(rows)])
            return plans
        per_agent = [
            [[(k, chunk)] for chunk in torch.randperm(n, generator=generator).split(c.server_batch_size)]
            for k, n in enumerate(sizes)
        ]
        flat = [b for batches in per_agent for b in batches]
        if c.server_order == "per_agent":
            return flat
        order = torch.randperm(len(flat), generator=generator).tolist()
        return [flat[i] for i in order]

    def _train(self, data: dict[str, tuple], round_: int,
               fresh: list[str] | None = None) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
        """Algorithm 1 lines 6-12: E_s epochs over the agents' uploads; z_s from the last epoch.

        ``fresh`` (async replay): the agents whose maps just arrived; the others in ``data`` are
        replayed. Each epoch then takes as many samples as the fresh agents sent, drawn from all
        of ``data`` (so over a round every map is drawn about as often as in a sync round), and
        z_s, for the fresh agents only, comes from the trained model with its running BatchNorm
        averages (not every fresh map is drawn in the last epoch).

        Through the shared server step: each agent's maps on the device when they fit (staged
        there as they arrived, or copied now), batches gathered by index there; z_s, the loss
        and the training accuracy stay on the device until the end and are read once."""
        c = self.config
        generator = torch.Generator().manual_seed(self.ctx.seed * 100_003 + round_)
        self.model.train()
        agents = list(data)
        device = self.device
        banks = banks_for_staged_rows([data[a][0] for a in agents], device)  # over each agent's (n, 16, H, W) float16 maps
        for a, bank in zip(agents, banks):
            if bank.placement == "host":
                log.info("round %d: %s's maps stay on the host: %s", round_, a, bank.why_host)
        edge_logits = [data[a][1].to(device) for a in agents]  # (n, K) each
        labels = [data[a][2].to(device) for a in agents]  # (n,) each
        z_s = [torch.zeros((len(data[a][3]), self.ctx.num_classes), dtype=torch.float32, device=device) for a in agents]
        train_correct = DeviceSum(device)

        per_epoch = None if fresh is None else math.ceil(sum(len(data[a][3]) for a in fresh) / c.server_batch_size)

        def batches(epoch: int):  # -> Iterator[Batch of maps (B, 16, H, W), labels (B,), edge logits (B, K)]
            for plan in self._batches(data, generator)[:per_epoch]:
                # (agent position, rows on the device); the host's copy of the rows gathers maps
                # left on the host without waiting for the device.
                pieces = [(k, idx, idx.to(device, non_blocking=True)) for k, idx in plan]
                if len(pieces) == 1:
                    (k, idx, index), = pieces
                    yield Batch(banks[k].gather(idx, torch.float32), (labels[k][index], edge_logits[k][index]),
                                meta=[(k, index)])
                    continue
                yield Batch(torch.cat([banks[k].gather(idx, torch.float32) for k, idx, _ in pieces]),
                            (torch.cat([labels[k][index] for k, _, index in pieces]),
                             torch.cat([edge_logits[k][index] for k, _, index in pieces])),
                            meta=[(k, index) for k, _, index in pieces])

        def keep_last_epoch_logits(trainer: Trainer) -> None:
            if trainer.last_epoch:
                logits = trainer.out.logits  # (B, K)
                start = 0
                for k, index in trainer.batch.meta:  # the batch's rows are its pieces', in order
                    if fresh is None:
                        z_s[k].index_copy_(0, index, logits[start : start + len(index)].float())  # keyed by row: by sample id
                    start += len(index)
                train_correct.add((logits.argmax(1) == trainer.batch.targets[0]).sum())

        if per_epoch is None:
            steps = sum(math.ceil(len(d[3]) / c.server_batch_size) for d in data.values()) * c.server_epochs
        else:
            steps = per_epoch * c.server_epochs
        step = self._trainer()
        guard = self._guard(round_, agents, step)
        trainer = Trainer(step, desc=f"server round {round_}", progress=tqdm if self.ctx.progress else None,
                          guard=guard[0] if guard else None)
        trainer.add_callback("on_batch_end", keep_last_epoch_logits)
        if guard:
            trainer.add_callback("on_batch_start", guard[1])
            trainer.add_callback("on_batch_skipped", guard[2])
        try:
            result = trainer.run(c.server_epochs, batches, planned_steps=steps)
            if fresh is not None:
                self.model.eval()
                with torch.no_grad():
                    for k, a in enumerate(agents):
                        if a in fresh:
                            for rows in torch.arange(len(data[a][3])).split(512):
                                z_s[k][rows.to(device)] = self.model(banks[k].gather(rows, torch.float32)).float()  # (b, K)
                self.model.train()
            # The call's other reads from the device: logits and accuracy to the host.
            logits_by_agent = {a: (data[a][3], z_s[k].cpu().numpy()) for k, a in enumerate(agents) if fresh is None or a in fresh}
            correct = train_correct.item()
        finally:
            for bank in banks:
                bank.release()
        if guard:
            step.max_grad_norm = 0.0
            if step.clipped:
                self.figures.setdefault(round_, {})["server_steps_clipped"] = step.clipped
            if trainer.skipped:
                self.figures.setdefault(round_, {})["server_steps_skipped"] = trainer.skipped
        if self.config.eval_diagnostics:
            self.figures.setdefault(round_, {})["server_train_accuracy"] = correct / max(result.last_epoch_samples, 1)
        return logits_by_agent, result.last_epoch_loss

    def _guard(self, round_: int, agents: list[str], step: TrainStep):
        """The server step's guard (``[server] server_grad_clip_norm``, ``server_loss_skip_factor``;
        None when both are off): (guard(loss), on_batch_start, on_batch_skipped). Gradients are
        clipped to the norm; a step whose loss is not finite, or above the factor x the median of
        the last 50 steps' losses (after 10), is skipped, the BatchNorm statistics its forward
        pass moved are put back, and the skip is attributed to the agent whose maps in the batch
        were the largest. Every guarded step runs eagerly (the loss is read before backward)."""
        cfg = self.ctx.robustness
        if not (cfg.server_grad_clip_norm or cfg.server_loss_skip_factor):
            return None
        step.max_grad_norm, step.clipped = float(cfg.server_grad_clip_norm), 0
        recent = self.recent_losses
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        buffers = [b for m in self.norms for b in (m.running_mean, m.running_var) if b is not None]
        why: list[str] = [""]

        def guard(loss: torch.Tensor) -> None:
            value = float(loss.detach())
            if not math.isfinite(value):
                why[0] = f"loss {value}"
                raise StepSkipped(why[0])
            if cfg.server_loss_skip_factor and len(recent) >= 10:
                limit = cfg.server_loss_skip_factor * float(np.median(recent))
                if value > limit:
                    why[0] = f"loss {value:.4g} > {cfg.server_loss_skip_factor:g} x the running median ({limit:.4g})"
                    raise StepSkipped(why[0])
            recent.append(value)
            del recent[:-50]

        def snapshot(trainer: Trainer) -> None:
            saved[:] = [(b, b.detach().clone()) for b in buffers]

        def skipped(trainer: Trainer) -> None:
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)
            batch, start, worst, culprit = trainer.batch, 0, -1.0, agents[0]
            for k, index in batch.meta:
                peak = float(batch.inputs[start : start + len(index)].abs().max())
                start += len(index)
                if peak > worst:
                    worst, culprit = peak, agents[k]
            self.ctx.ledger.skip_step(round_, culprit, why[0])

        return guard, snapshot, skipped

    def _calibrate(self, features: RowSource) -> BnStatistics:
        """BatchNorm statistics of the server model on one agent's maps (at most
        ``bn_calibration_samples``, an even spread), leaving the model as it was."""
        n = len(features)
        rows = torch.linspace(0, n - 1, min(n, self.config.bn_calibration_samples)).round().long().unique()
        return measure_bn_statistics(self.model, (features[chunk].to(self.device, torch.float32) for chunk in rows.split(256)))

    # -- evaluation: each agent's extractor followed by the server model, on the global set and the agent's own test maps

    @property
    def scores_on_device(self) -> bool:  # type: ignore[override]
        """A private extractor never leaves the device: the agents score it; the ResNet-8 is
        scored where it lives unless ``edge_scoring = "server"``."""
        return bool(self.config.private_extractor) or self.config.edge_scoring == "device"

    def _personalised(self, round_: int) -> bool:
        mode = self.config.personalised_eval
        return mode == "every" or (mode == "final" and round_ == self.ctx.rounds)

    def evaluation_downloads(self, round_: int, agent: str) -> list[Message]:
        """A private extractor is scored on the device: the agent gets the server model it
        needs (and its own BatchNorm statistics when the personalised figure is due)."""
        if not self.config.private_extractor:
            return []
        bn = {}
        if self._personalised(round_) and agent in self.agent_bn:
            bn = {f"{i}/{part}": t.detach().cpu().numpy() for i, pair in enumerate(self.agent_bn[agent])
                  for part, t in zip(("mean", "var"), pair)}
        return [GktEvalModel(run=self.ctx.run_id, round=round_, sender="server", weights=state_dict_to_arrays(self.model), bn=bn)]

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        """Agent k's deployed model is its extractor followed by the server model: on the global
        set through the ResNet-8 it reported, on its own shard through the test maps it streamed.
        The headline uses the server's running BatchNorm averages; ``personalised_bn`` agent k's
        own statistics; ``edge`` is the ResNet-8 left on the device."""
        ev = Evaluation(edge="edge", labels={
            HEADLINE: "agent k's extractor + the server model, the server's running BatchNorm statistics (mean over agents)",
            "personalised_bn": "agent k's extractor + the server model with agent k's own BatchNorm statistics "
                               "(personalised; mean over agents)",
            "edge": "agent k's ResNet-8 on its device (mean over agents)",
        })
        if self.config.private_extractor:  # every figure scored on the devices, checked on arrival
            ev.global_reported = global_results(reports)
            ev.local = local_results(reports)
            return ev
        personalised = self._personalised(round_)
        self.model.eval()
        ev.global_reported = global_results(reports)  # "edge": the ResNet-8 scored on its device
        for agent, report in sorted(reports.items()):
            arrays = models_from_report(report, "edge")
            if arrays:
                edge = build_model(self.config.edge_model, self.ctx.num_classes, self.ctx.in_channels)
                try:
                    load_arrays_into(edge, arrays)
                except WeightsMismatchError as exc:
                    log.warning("round %d: %s's edge model cannot be evaluated: %s", round_, agent, exc)
                else:
                    edge = edge.to(self.device).eval()
                    # Agents whose extractors are equal (the shared, frozen stem) have one pipeline: scored once.
                    ev.global_models.setdefault(HEADLINE, {})[agent] = replace(
                        self._pipeline(edge, None), identity=module_digest(edge.extractor, extra="extractor+server"))
                    if "edge" not in report.global_results:  # an agent that did not score it: scored here
                        ev.global_models.setdefault("edge", {})[agent] = EvalModel(lambda x, e=edge: e(x)[0],
                                                                                   identity=module_digest(edge, extra="edge"))
                    if personalised and agent in self.agent_bn:
                        ev.global_models.setdefault("personalised_bn", {})[agent] = self._pipeline(edge, self.agent_bn[agent])
        ev.local = local_results(reports)  # "edge": the ResNet-8 on the agent's shard
        for agent, report in sorted(reports.items()):
            wanted = self._wanted(agent, report.instance, round_, "test")
            if wanted:
                # Claims to reuse test maps the server did not hold: a figure would be on a part of
                # the shard. Left out; the next evaluation uploads them in full (none held then).
                log.warning("round %d: %s's local figure left out: %d test batches reused maps the server does not "
                            "hold (%s)", round_, agent, len(wanted), next(iter(wanted.values())))
                self.drop_held_test_maps(agent)
                self._release(self.eval_staged, agent)
        for agent, held in sorted(self.eval_staged.items()):
            if held.round != round_ or agent not in reports or not held.test:
                continue
            sent = reports[agent].uploads.get("test", {}).get("batches") if isinstance(reports[agent].uploads.get("test"), dict) else None
            if isinstance(sent, int) and sent != len(held.test):
                log.warning("round %d: %s's local figure left out: %d of the %d test batches it sent are staged",
                            round_, agent, len(held.test), sent)
                self._release(self.eval_staged, agent)
                continue
            staged = self.eval_staged.pop(agent)
            try:
                maps = self._agent_rows(agent, "test", [staged.test[k] for k in sorted(staged.test)])
            except MapsNotHeldError as exc:
                log.warning("round %d: %s's local figure left out: %s", round_, agent, exc)
                continue
            finally:
                self.staging.release_all(staged.staged_arrays())
            try:
                ev.local.setdefault(HEADLINE, {})[agent] = self._score_maps(maps, None)
                if personalised and agent in self.agent_bn:
                    ev.local.setdefault("personalised_bn", {})[agent] = self._score_maps(maps, self.agent_bn[agent])
            finally:
                digest = staged.digest("test")
                if self._holds_maps and digest:
                    self._hold(agent, "test", digest, maps)  # the next evaluations' claims
                else:
                    self._release_rows(maps[0].staged)
        return ev

    def drop_held_test_maps(self, agent: str) -> None:
        held = self.held.pop((agent, "test"), None)
        if held is not None:
            self._release_rows(held.rows.staged)

    def _pipeline(self, edge: torch.nn.Module, bn: BnStatistics | None) -> EvalModel:
        """Extractor + server model as one model; with ``bn``, the server's BatchNorm layers use
        those statistics for the pass (the server's own are restored after it)."""
        def forward(x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) images
            return self.model(edge.extract(x))  # (B, 16, H, W) maps -> (B, K)

        if bn is None:
            return EvalModel(forward)

        @contextlib.contextmanager
        def with_agent_bn():
            with restoring_bn_statistics(self.model):
                load_bn_statistics(self.model, bn)
                yield
        return EvalModel(forward, with_agent_bn)

    @torch.no_grad()
    def _score_maps(self, maps: AgentRows, bn: BnStatistics | None) -> tuple[int, int]:
        """(correct, total) of the server model on one agent's test maps."""
        features, _edge_logits, labels, _ids = maps
        correct = total = 0
        with restoring_bn_statistics(self.model):
            if bn is not None:
                load_bn_statistics(self.model, bn)
            for start in range(0, len(labels), INFERENCE_BATCH_SAMPLES):
                end = start + INFERENCE_BATCH_SAMPLES
                logits = self.model(features[start:end].to(self.device, torch.float32))  # (b, K)
                correct += int((logits.argmax(1).cpu() == labels[start:end]).sum())
                total += int(len(labels[start:end]))
        return correct, total

    # -- plausibility: uploads checked against what the server knows

    def _check_plausible(self, agent: str, msg: GktFeatures) -> None:
        """At the door: maps and logits within the range a ResNet-8 extractor and classifier
        produce (``[server] feature_abs_limit`` / ``logit_abs_limit``; honest ones stay orders
        of magnitude below), refused as ``out_of_range`` with the figure; then the batch's
        per-channel statistics are added to the agent's round (compared with the other agents'
        when the round completes)."""
        cfg = self.ctx.robustness
        features = np.asarray(msg.features, dtype=np.float32)  # (N, C, H, W)
        peak = float(np.max(np.abs(features))) if features.size else 0.0
        if not peak <= cfg.feature_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} feature maps reach |H| = {peak:.4g}, above "
                                                         f"server.feature_abs_limit = {cfg.feature_abs_limit:g}")
        peak = float(np.max(np.abs(msg.logits))) if msg.logits.size else 0.0
        if not peak <= cfg.logit_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} edge logits reach |z| = {peak:.4g}, above "
                                                         f"server.logit_abs_limit = {cfg.logit_abs_limit:g}")
        self.ctx.ledger.examined(msg.round, "out_of_range", [agent])
        if msg.split != "train":
            return
        f64 = features.astype(np.float64)
        self._add_stats(agent, msg, np.einsum("nchw,nchw->c", f64, f64), features.size // max(features.shape[1], 1))
        digests = self.round_digests.get(agent)
        if digests is None or digests[:2] != (msg.instance, msg.round):
            digests = self.round_digests[agent] = (msg.instance, msg.round, set())
        digests[2].add(msg.maps_digest or "")

    def _add_stats(self, agent: str, msg: GktFeatures | GktReusedMaps, sumsq: np.ndarray | None, elements: int) -> None:
        """Add one training batch to ``agent``'s round statistics: its maps' per-channel sums of
        squares over ``elements`` values a channel (None: no map figure), and its logits'."""
        held = self.upload_stats.get(agent)
        if held is None or held[:2] != (msg.instance, msg.round):
            held = (msg.instance, msg.round, np.zeros(0), 0, 0.0, 0)
        total = held[2]
        if sumsq is not None:
            total = sumsq if total.size == 0 else total + sumsq  # (C,)
        logits = np.asarray(msg.logits, dtype=np.float64)
        self.upload_stats[agent] = (msg.instance, msg.round, total, held[3] + (elements if sumsq is not None else 0),
                                    held[4] + float(np.sum(logits * logits)), held[5] + logits.size)

    def _implausible_statistics(self, round_: int, agents: list[str]) -> tuple[list[str], dict[str, str]]:
        """(the agents judged: three or more with statistics this round, else none; agent ->
        detail, for the agents whose maps' RMS in some channel, or
        whose logits' RMS, is far above the other agents' (above ``plausible_peer_ratio`` x their
        median and median + ``plausible_mad`` x 1.4826 MAD, and the channel above
        ``plausible_peer_ratio`` x the median channel's RMS of all agents: a channel dead for the
        others is not a yardstick))."""
        cfg = self.ctx.robustness
        stats = {a: self.upload_stats[a] for a in agents if a in self.upload_stats and self.upload_stats[a][1] == round_}
        # Maps: the agents with a map figure this round (sent, or the accepted figure of the held
        # maps a batch reused); logits: every agent that sent a batch.
        map_names = sorted(a for a in stats if stats[a][3] > 0)
        if len(map_names) < 3:
            map_names = []
        if len(stats) < 3:
            return [], {}
        names = sorted(stats)
        logit_rms = np.array([math.sqrt(stats[a][4] / max(stats[a][5], 1)) for a in names])  # (A,)
        out: dict[str, str] = {}
        if map_names:
            rms = np.stack([np.sqrt(stats[a][2] / stats[a][3]) for a in map_names])  # (A, C)
            out.update(self._implausible_maps(map_names, rms))
        for i, agent in enumerate(names):
            if agent in out:
                continue
            lo = np.delete(logit_rms, i)
            lmed = float(np.median(lo))
            lmad = float(np.median(np.abs(lo - lmed)))
            llimit = max(cfg.plausible_peer_ratio * lmed, lmed + cfg.plausible_mad * MAD_TO_SD * lmad)
            if not logit_rms[i] <= llimit:
                out[agent] = (f"edge logits' RMS {logit_rms[i]:.4g}, the other agents' median {lmed:.4g} "
                              f"(limit {llimit:.4g})")
        return names, out

    def _implausible_maps(self, names: list[str], rms: np.ndarray) -> dict[str, str]:
        """Agent -> detail for the agents whose maps' RMS (``rms``: (A, C)) is far above the others' in some channel."""
        cfg = self.ctx.robustness
        floor = cfg.plausible_peer_ratio * float(np.median(rms))
        out: dict[str, str] = {}
        for i, agent in enumerate(names):
            others = np.delete(rms, i, axis=0)  # (A - 1, C)
            med = np.median(others, axis=0)
            mad = np.median(np.abs(others - med), axis=0)
            limit = np.maximum.reduce([cfg.plausible_peer_ratio * med, med + cfg.plausible_mad * MAD_TO_SD * mad,
                                       np.full_like(med, floor)])
            over = np.nonzero(~(rms[i] <= limit))[0]
            if len(over):
                c = int(over[np.argmax(rms[i][over] / limit[over])])
                out[agent] = (f"feature maps' RMS in channel {c} is {rms[i, c]:.4g}, the other agents' median "
                              f"{med[c]:.4g} (limit {limit[c]:.4g}); {len(over)} of {rms.shape[1]} channels over")
        return out

    def _screen(self, round_: int, ends: dict[str, RoundEnd]) -> dict[str, str]:
        """Agent -> why its round's maps are not used: a batch refused at the door, or statistics
        far from the other agents'. A quarantined agent's maps are screened like the others' (and
        label-checked) and left out after (:meth:`FedGktServer.complete`): a judged round is what
        releases it (cloud_server/robust/ledger.py)."""
        ledger = self.ctx.ledger
        out: dict[str, str] = {}
        for agent in sorted(ends):
            refused = self.refused_seqs.get(agent)
            if refused is not None and refused[:2] == (ends[agent].instance, ends[agent].round):
                out[agent] = f"{len(refused[2])} upload(s) refused as implausible (robustness.refused)"
        if self.ctx.robustness.plausibility_checks:
            judged, refusals = self._implausible_statistics(round_, [a for a in sorted(ends) if a not in out])
            ledger.examined(round_, "implausible_statistics", judged)
            for agent, detail in refusals.items():
                ledger.refuse(round_, agent, "implausible_statistics", detail)
                out[agent] = f"implausible_statistics: {detail}"
            for agent in judged:
                stats, digests = self.upload_stats[agent], self.round_digests.get(agent)
                fresh = digests[2] if digests is not None and digests[:2] == stats[:2] else set()
                if agent not in out and len(fresh) == 1 and "" not in fresh and stats[3] > 0:
                    self.accepted_map_ms[agent] = (next(iter(fresh)), stats[2] / stats[3])
        for agent in ends:
            self.upload_stats.pop(agent, None)
            self.round_digests.pop(agent, None)
            if agent in self.refused_seqs and self.refused_seqs[agent][1] <= round_:
                self.refused_seqs.pop(agent)
        return out

    # -- label check: the server model's predictions against the labels an agent sent

    CHUNK_ROWS = 512

    def _agreement(self, rows: AgentRows) -> tuple[float, float]:
        """(the server model's, the edge logits') agreement with one agent's labels: the fraction
        of its samples whose label is the argmax. The server model in eval mode (running
        BatchNorm statistics, as it is evaluated), left as it was."""
        features, edge_logits, labels, _ids = rows
        n = len(labels)
        if n == 0:
            return float("nan"), float("nan")
        was_training = self.model.training
        self.model.eval()
        agree = 0
        try:
            with torch.no_grad():
                for chunk in torch.arange(n).split(self.CHUNK_ROWS):
                    maps = features[chunk].to(self.device, torch.float32)  # (b, 16, H, W)
                    agree += int((self.model(maps).argmax(1).cpu() == labels[chunk].cpu()).sum())
        finally:
            self.model.train(was_training)
        edge = float((edge_logits.argmax(1).cpu() == labels.cpu()).float().mean())
        return agree / n, edge

    def _check_labels(self, round_: int, data: dict[str, AgentRows]) -> dict[str, str]:
        """Agent -> why its maps are not trained on this round (``implausible_labels``, to the
        ledger); the round's figures go to the ledger (``robustness.label_agreement``), and the
        agents it could judge (``examined``: a quarantined agent's maps are judged too, and only
        a judged clean round releases it). Nothing
        when the check is off (``plausible_min_label_agreement`` 0), the plausibility checks are
        off, or before ``LABEL_CHECK_FROM_ROUND``."""
        defence = self.ctx.defence
        if not (defence.checks_labels and self.ctx.robustness.plausibility_checks) or round_ < LABEL_CHECK_FROM_ROUND or not data:
            return {}
        figures = {agent: self._agreement(rows) for agent, rows in sorted(data.items())}
        server = {a: f[0] for a, f in figures.items()}
        peers = {a: v for a, v in self.label_agreement_latest.items() if a not in server}
        refusals = implausible_labels(server, defence.plausible_min_label_agreement, defence.plausible_mad, peers)
        judged = [a for a, v in server.items() if v == v] if len({**peers, **server}) > LABEL_MIN_OTHERS else []  # NaN: no samples
        self.label_agreement_latest.update(server)
        # Async mode judges each arrival alone: the round's section gathers them.
        held_round, held = self.label_agreement_round
        if held_round != round_:
            held = {}
        held.update({a: {"server": _rounded(s), "edge": _rounded(e), "samples": len(data[a][2])} for a, (s, e) in figures.items()})
        self.label_agreement_round = (round_, held)
        ledger = self.ctx.ledger
        ledger.examined(round_, "implausible_labels", judged)
        ledger.record(round_, "label_agreement", {
            "threshold": defence.plausible_min_label_agreement, "agents": dict(sorted(held.items())),
            **({"peers": {a: round(v, 6) for a, v in sorted(peers.items())}} if peers else {})})
        out = {}
        for agent, (reason, detail) in refusals.items():
            ledger.refuse(round_, agent, reason, detail)
            out[agent] = f"{reason}: {detail}"
        return out

    # -- maps held across rounds (reuse_maps): each agent's maps go up once while its extractor stands still

    def _init_held_maps(self) -> None:
        # (agent, split) -> its last accepted maps, held in the staging across rounds (not
        # checkpointed: a resumed server holds none, names none, and so gets them in full).
        self.held: dict[tuple[str, str], HeldMaps] = {}
        # (agent, split) -> (instance, round, {seq: why}) of the reuse claims it could not serve:
        # asked for in full (train) or left out of the evaluation (test).
        self.maps_wanted: dict[tuple[str, str], tuple[str, int, dict[int, str]]] = {}

    def _with_held_maps(self, cfg: GktRoundConfig, agent: str) -> GktRoundConfig:
        """``agent``'s round config: the digests of its maps the server holds (``held_maps``)."""
        if not self._holds_maps:
            return cfg
        return replace(cfg, held_maps={split: held.digest for (a, split), held in sorted(self.held.items()) if a == agent})

    def _hold_trained(self, data: dict[str, AgentRows], digests: dict[str, str]) -> None:
        """After a round's training: hold each agent's trained-on maps that came with one digest."""
        if self._holds_maps:
            for agent, rows in data.items():
                if digests.get(agent):
                    self._hold(agent, "train", digests[agent], rows)

    def _maps_requests(self, agent: str, end: RoundEnd, split: str, missing: list[int]) -> list[Message]:
        """For the ``missing`` batches that were claims the server could not serve: the request
        for them in full ([] when none)."""
        wanted = self._wanted(agent, end.instance, end.round, split)
        in_full = [seq for seq in missing if seq in wanted]
        if not in_full:
            return []
        return [GktMapsRequest(run=self.ctx.run_id, round=end.round, sender="server", split=split, seqs=in_full,
                               reason=wanted[in_full[0]][:500])]

    @property
    def _holds_maps(self) -> bool:
        """Whether agents' maps are held across rounds: reuse on and the extractors frozen (a
        trained extractor gives other maps every round)."""
        edge = self.config.edge
        return edge.reuse_maps and not edge.train_extractor

    def _in_use(self, staged: StagedArray) -> bool:
        return any(h.rows.staged is staged for h in self.held.values()) or \
            any(rows[0].staged is staged for rows in self.replay.values())

    def _release_rows(self, staged: StagedArray) -> None:
        """Release a gathered array unless held maps or async replay still use it."""
        if not self._in_use(staged):
            self.staging.release(staged)

    def _hold(self, agent: str, split: str, digest: str, rows: AgentRows) -> None:
        """Keep ``rows`` as ``agent``'s ``split`` maps (digest ``digest``), replacing what was held."""
        old = self.held.get((agent, split))
        if old is not None and old.rows.staged is rows[0].staged:
            return  # the held maps, reused as they are
        self.held[(agent, split)] = HeldMaps(digest, rows[0], rows[2].numpy().astype(np.int64, copy=False), rows[3])
        if old is not None:
            self._release_rows(old.rows.staged)

    def drop_held_maps(self, agent: str | None = None) -> None:
        """Forget the maps held for ``agent`` (None: every agent), as a restart would: the
        next claims to reuse them are refused and the maps asked for again."""
        for key in [k for k in self.held if agent is None or k[0] == agent]:
            self._release_rows(self.held.pop(key).rows.staged)

    def _want_maps(self, agent: str, msg: GktReusedMaps, why: str) -> None:
        instance, round_, wanted = self.maps_wanted.get((agent, msg.split), (msg.instance, msg.round, {}))
        if (instance, round_) != (msg.instance, msg.round):
            wanted = {}
        wanted[msg.seq] = why
        self.maps_wanted[(agent, msg.split)] = (msg.instance, msg.round, wanted)
        self._count(msg.round, msg.split, "requested_batches", 1)
        log.warning("round %d: %s's %s batch %d reuses maps the server does not hold (%s); asking for them in full",
                    msg.round, agent, msg.split, msg.seq, why)

    def _wanted(self, agent: str, instance: str, round_: int, split: str) -> dict[int, str]:
        held = self.maps_wanted.get((agent, split))
        if held is None or held[:2] != (instance, round_):
            return {}
        return dict(held[2])

    def _count(self, round_: int, split: str, what: str, value: int) -> None:
        """The round's figures of maps sent once (report.json ``rounds[].method``)."""
        key = f"{'maps' if split == 'train' else 'test_maps'}_{what}"
        figures = self.figures.setdefault(round_, {})
        figures[key] = figures.get(key, 0) + value

    def _agent_rows(self, agent: str, split: str, batches: list[StagedBatch]) -> AgentRows:
        """One agent's batches of ``split`` as rows: the held maps as they are when the batches
        reuse all of them in order, else gathered (reused batches copied from the held maps).
        :class:`MapsNotHeldError` when maps a batch reused were dropped since it arrived."""
        held = self.held.get((agent, split))
        if any(b.held is not None and (b.held is not held or b.held.rows.staged.released) for b in batches):
            raise MapsNotHeldError(f"the held {split} maps some batches reused were dropped before they were used")
        whole = reused_whole(batches)
        if whole is not None:
            return whole
        return gather_batches([materialise(b, self.staging) for b in batches], self.staging)

    def _on_reused(self, agent: str, msg: GktReusedMaps) -> None:
        """A batch that reuses held maps: staged as their rows, with the batch's logits; a claim
        the server cannot serve is not staged, and its maps are asked for in full."""
        if msg.logits.shape[1] != self.ctx.num_classes:
            raise ShapeMismatchError(f"edge logits have {msg.logits.shape[1]} classes, run has {self.ctx.num_classes}")
        cfg = self.ctx.robustness
        peak = float(np.max(np.abs(msg.logits)))
        if self.ctx.robustness.plausibility_checks and not peak <= cfg.logit_abs_limit:
            raise ImplausibleUploadError("out_of_range", f"{msg.split} edge logits reach |z| = {peak:.4g}, above "
                                                         f"server.logit_abs_limit = {cfg.logit_abs_limit:g}")
        try:
            rows = self.reused_rows(agent, msg)
        except MapsNotHeldError as exc:
            self._want_maps(agent, msg, f"{exc.code}: {exc}")
            return
        if self.ctx.robustness.plausibility_checks and msg.split == "train":
            self._add_reused_stats(agent, msg)
        self._stage(agent, msg, reused=(self.held[(agent, msg.split)], rows))
        n = len(msg.sample_ids)
        self._count(msg.round, msg.split, "reused_batches", 1)
        self._count(msg.round, msg.split, "reused_samples", n)
        self._count(msg.round, msg.split, "reused_fp32_bytes", 4 * n * math.prod(self.feature_shape or ()))

    def _add_reused_stats(self, agent: str, msg: GktReusedMaps) -> None:
        """A reused batch in the peers' comparison: its logits as sent, its maps with the figure
        they had when accepted (none when they were held without one: its logits count alone)."""
        accepted = self.accepted_map_ms.get(agent)
        if accepted is None or accepted[0] != msg.maps_digest or self.feature_shape is None:
            self._add_stats(agent, msg, None, 0)
            return
        elements = len(msg.sample_ids) * math.prod(self.feature_shape[1:])
        self._add_stats(agent, msg, accepted[1] * elements, elements)

    def reused_rows(self, agent: str, msg: GktReusedMaps) -> np.ndarray:
        """The rows of the maps ``agent``'s claim reuses; :class:`MapsNotHeldError` (a specific
        reason) when the server holds none for the split, or other ones."""
        held = self.held.get((agent, msg.split)) if self._holds_maps else None
        if held is None:
            raise MapsNotHeldError(f"no {msg.split} maps of {agent} are held (none sent yet, a restarted or resumed "
                                   "server, or dropped)" if self._holds_maps else "this run does not hold maps (reuse_maps "
                                   "= false or train_extractor = true)")
        return held.rows_of(msg.maps_digest, msg.sample_ids)


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
