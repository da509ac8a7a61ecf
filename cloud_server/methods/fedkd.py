"""FedKD server step (Wu et al. 2022, Algorithm 1 lines 11-19; Eqs. 8-9).

The server holds the global mentee only; mentors never leave the agents. Each
round it receives every agent's SVD-factored mentee update
(:class:`FedKdUpdate`), rebuilds them, averages them (sample-weighted as
FedAvg does, or plainly as Algorithm 1's ``g / N``), factors the average again
with the same threshold T(t) (Eq. 9), adds the *factored* average to its own
copy of the global mentee and sends the factors to every agent whose update it
used (:class:`FedKdAggregate`). Agent and server add the same float32 values to
the same float32 copy, so all copies of the global mentee stay identical. An
agent that does not hold the version a round starts from gets the whole
mentee once, losslessly, in ``RoundStart.weights``.

With ``upload = "gradient"`` the agents send their mean mentee gradient and the
server turns the average into the update ``-gradient_lr * g`` (Algorithm 1
line 22 with the step taken once, on the server, so every copy takes the same
step); BatchNorm statistics travel as their change in both modes.

Evaluation (cloud_server/evaluation.py): FedKD infers with each agent's mentor
(the paper's test phase), so the deployed model, the round's ``accuracy``, is
the mean over agents of each agent's mentor on the global test set and
``local_accuracy`` the mentors on their own shards. The mentor never leaves the
device: each agent scores it on the run's public global test set itself (the
evaluation request names the set) and reports the figures, which the server
checks and averages. The global mentee (the federated model) stands beside it as
``mentee``, scored here on the global set and by the agents on their shards.

Per round the method keeps a record (:attr:`FedKdServer.history`, also in the
checkpoint) of the threshold, the rank of every factored tensor in every
upload and in the aggregate, and bytes: factored vs dense mentee update, and a
FedAvg of a mentor-sized model for comparison. :meth:`FedKdServer.round_report`
condenses it into the round's ``method`` entry of ``report.json`` (T, the rank
chosen per tensor, bytes per agent and their reductions); the full per-agent
record stays in the checkpoint.

Eq. 9's training progress t runs over the run's rounds (``ServerContext.rounds``)
unless ``[fedkd] schedule_rounds`` sets another horizon.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import models.mentor  # noqa: F401  (registers the mentor architectures, e.g. resnet20)
from models import (build_model, count_parameters, load_arrays_into, state_dict_to_arrays,
                    training_flops_per_sample)
from models.mentor import forward_with_hidden, hidden_dim
from shared_protocol import svd
from shared_protocol.errors import ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import EvalReport, Message, RoundEnd, RoundStart
from shared_protocol.methods.fedkd import FedKdAggregate, FedKdUpdate, factor_state, unfactor_state

from ..evaluation import HEADLINE, EvalModel, Evaluation, global_results, local_results
from ..robust.rules import aggregate_vectors, choose_rule, clip_rows
from ..robust.screening import screen_uploads
from ..staging import ModelUploadStage, StagedUpload
from .base import RoundOutcome, ServerContext, ServerMethod, register_server_method
from .fedkd_config import EDGE_KEYS, WEIGHTINGS, FedKdConfig
from .fedkd_factors import FACTOR_TOLERANCE, _check_factors, _eq8_rank, _ranks

log = logging.getLogger("cloud_server.fedkd")

__all__ = ["EDGE_KEYS", "FACTOR_TOLERANCE", "WEIGHTINGS", "FedKdConfig", "FedKdServer", "launcher_table"]

@dataclass
class _Staged(StagedUpload):
    delta: dict[str, np.ndarray]  # rebuilt update (or gradient), float32
    ranks: dict[str, int]  # factored tensors only
    svd_bytes: int
    dense_bytes: int


@dataclass
class _RoundLog:
    """What the history records for the round in progress."""

    threshold: float
    sync_bytes: int = 0  # whole-mentee float32 bytes sent in RoundStarts
    sync_agents: list[str] = field(default_factory=list)


@register_server_method
class FedKdServer(ServerMethod):
    name = "fedkd"
    upload_types = (FedKdUpdate,)
    aggregates_weights = True
    # DP-FedAvg: central clips the rebuilt updates here; client_clipping and local clip (and noise) the
    # dense update on the agent before factoring, and a truncated SVD never lengthens it.
    dp_fedavg_modes = ("central", "client_clipping", "local")
    scores_on_device = True  # the mentor is private: the agents score it on the global set

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.config = FedKdConfig.from_dict(method_config)
        self.schedule_rounds = self.config.horizon(ctx.rounds)  # Eq. 9's t = 1: the run's last round by default
        # The initial global mentee from the run's own stream, not torch's global RNG: in-memory
        # federations build the server while other threads of the process draw from and reseed
        # that one (the mentee torch.manual_seed(seed) gave before, bit for bit: models.seeding).
        generator = torch.Generator().manual_seed(ctx.seed)
        mentee = build_model(self.config.mentee_model, ctx.num_classes, ctx.in_channels, generator=generator)
        self.param_names = {name for name, _ in mentee.named_parameters()}
        # The global mentee as float32 arrays; integer counters stay with each agent.
        self.global_state = {k: v for k, v in state_dict_to_arrays(mentee).items() if v.dtype.kind == "f"}
        self.version = 0  # round whose aggregate global_state is (0: the initial mentee)
        # Only its size is used; drawn on the same stream, so that building the server never
        # touches the global RNG (tests/test_server_seeding.py).
        mentor = build_model(self.config.mentor_model, ctx.num_classes, ctx.in_channels, generator=generator)
        self.mentee_dense_bytes = sum(4 * v.size for v in self.global_state.values())
        # What FedAvg of a mentor-sized model moves per agent and direction (its float state).
        self.mentor_dense_bytes = sum(4 * v.size for v in state_dict_to_arrays(mentor).values() if v.dtype.kind == "f")
        self.holds: dict[str, int] = {}  # agent -> global version the server believes it holds
        self.staged: ModelUploadStage[_Staged] = ModelUploadStage("mentee update", log)
        self.history: list[dict[str, Any]] = []
        self._round_logs: dict[int, _RoundLog] = {}

    # -- configuration --------------------------------------------------------------- #

    def resolved_config(self) -> dict[str, Any]:
        return {**self.config.to_table(), "schedule_rounds": self.schedule_rounds}

    def threshold(self, round_: int) -> float:
        """This run's T(t) (Eq. 9) for ``round_``."""
        return self.config.threshold(round_, self.schedule_rounds)

    def welcome_settings(self) -> dict[str, Any]:
        return {"num_classes": self.ctx.num_classes, "mentor_model": self.config.mentor_model, "mentee_model": self.config.mentee_model}

    @property
    def download_codecs(self) -> dict[str, dict[str, str]]:  # type: ignore[override]
        return {RoundStart.TYPE: {"weights": self.config.sync_codec}}

    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        config = self.config.round_config(round_, self.version, self.schedule_rounds).to_dict()
        entry = self._round_logs.setdefault(round_, _RoundLog(config["threshold"]))
        if self.holds.get(agent) == self.version:
            return config, {}
        entry.sync_bytes += self.mentee_dense_bytes
        entry.sync_agents.append(agent)
        return config, dict(self.global_state)

    def model_info(self) -> dict[str, Any]:
        shape = (self.ctx.in_channels, 32, 32)
        mentor = build_model(self.config.mentor_model, self.ctx.num_classes, self.ctx.in_channels)
        mentee = build_model(self.config.mentee_model, self.ctx.num_classes, self.ctx.in_channels)
        projection_params = (hidden_dim(mentee) + 1) * hidden_dim(mentor)
        info = {
            role: {"name": name, "params": count_parameters(m), "train_flops_per_sample": training_flops_per_sample(m, shape)}
            for role, name, m in (("mentor", self.config.mentor_model, mentor), ("mentee", self.config.mentee_model, mentee))
        }
        return {
            # Both models train on the edge; the report's edge row is their sum (+ W_h).
            "edge": {
                "name": f"{self.config.mentor_model}+{self.config.mentee_model}",
                "params": info["mentor"]["params"] + info["mentee"]["params"] + projection_params,
                "train_flops_per_sample": info["mentor"]["train_flops_per_sample"] + info["mentee"]["train_flops_per_sample"],
            },
            "server": None,  # the server only averages and factors
            **info,
        }

    # -- uploads ------------------------------------------------------------------------ #

    def on_upload(self, agent: str, msg: Message) -> None:
        if not isinstance(msg, FedKdUpdate):
            raise ValueRangeError(f"{self.name} does not take {msg.TYPE} uploads")
        self._stage_update(agent, msg)

    def _stage_update(self, agent: str, msg: FedKdUpdate) -> None:
        """Algorithm 1, lines 11-12: check and rebuild one agent's update."""
        if msg.base_version != self.version:
            raise StaleMessageError(f"update computed from global mentee {msg.base_version}, current is {self.version}")
        if msg.payload != self.config.upload:
            raise ValueRangeError(f"update carries a {msg.payload}, this run uploads {self.config.upload}s")
        if not math.isclose(msg.threshold, self.threshold(msg.round), rel_tol=0.0, abs_tol=1e-9):
            # The agent did not factor with this round's T(t) (Eq. 9): a misconfigured or stale agent.
            raise ValueRangeError(f"update factored with T = {msg.threshold}, round {msg.round} uses T = {self.threshold(msg.round)}")
        packed = unfactor_state(msg.TYPE, msg.layout, msg.factors)
        if set(packed) != set(self.global_state):
            missing, extra = sorted(set(self.global_state) - set(packed)), sorted(set(packed) - set(self.global_state))
            raise ShapeMismatchError(f"update does not fit {self.config.mentee_model}: missing {missing[:5]}, unexpected {extra[:5]}")
        delta = {}
        for name, p in packed.items():
            if p.shape != self.global_state[name].shape:
                raise ShapeMismatchError(f"update {name!r} has shape {list(p.shape)}, mentee has {list(self.global_state[name].shape)}")
            if p.mode == "factored" and self.ctx.robustness.plausibility_checks:
                _check_factors(name, p)
            delta[name] = p.reconstruct()
            if not np.isfinite(delta[name]).all():
                raise ValueRangeError(f"update {name!r} rebuilds to non-finite values")
        if self.ctx.robustness.plausibility_checks:  # judged at the door: evidence for quarantine
            self.ctx.ledger.examined(msg.round, "implausible_factors", [agent])
        self.staged[agent] = _Staged(
            msg.instance, msg.round, msg.num_samples, delta, _ranks(packed),
            svd_bytes=sum(p.payload_bytes for p in packed.values()), dense_bytes=sum(4 * p.dense_elements for p in packed.values()),
        )

    def discard(self, agent: str) -> None:
        self.staged.pop(agent, None)
        # A failed or restarted agent may not hold the global mentee any more.
        self.holds.pop(agent, None)

    # -- the server step ------------------------------------------------------------------ #

    def aggregate(self, staged: list[_Staged], round_: int = 0, agents: list[str] | None = None) -> dict[str, np.ndarray]:
        """Algorithm 1, lines 13-16: the (weighted) mean of the rebuilt updates, as the
        update to add (gradient mode: one step of -gradient_lr along the mean gradient); or
        ``[server] aggregation``'s robust rule over them, after ``clip_update_norm``
        (cloud_server/robust/)."""
        weights = np.asarray([s.num_samples if self.config.weighting == "samples" else 1 for s in staged], dtype=np.float64)
        weights /= weights.sum()
        cfg = self.ctx.robustness
        out: dict[str, np.ndarray] = {}
        if self.ctx.privacy.cfg.server_noises:  # DP-FedAvg (cloud_server/privacy.py): uniform, clipped, noised
            who = agents or [f"#{k}" for k in range(len(staged))]
            mean = self.ctx.privacy.noised_mean(round_, who, [s.delta for s in staged])
            for name in self.global_state:
                step = -self.config.gradient_lr if self.config.upload == "gradient" and name in self.param_names else 1.0
                out[name] = (mean[name] * step).astype(np.float32)
            return out
        if not cfg.plain_mean:
            names = list(self.global_state)
            vectors = np.stack([np.concatenate([s.delta[n].astype(np.float64).ravel() for n in names]) for s in staged])  # (K, D)
            who = agents or [f"#{k}" for k in range(len(staged))]
            vectors, clipped = clip_rows(vectors, cfg.clip_update_norm)
            for row, norm in clipped:
                self.ctx.ledger.clip(round_, who[row], "update_norm", f"update norm {norm:.4g} clipped to {cfg.clip_update_norm:g}")
            choice = choose_rule(cfg.aggregation, len(staged), cfg.aggregation_tolerate)
            mean, used = aggregate_vectors(vectors, weights, choice.rule, choice.f)
            self.ctx.ledger.aggregation(round_, {"rule": choice.rule, "f": choice.f, "fallback": choice.fallback,
                                                 "used": [who[k] for k in used]})
            start = 0
            for name in names:
                size = self.global_state[name].size
                total = mean[start : start + size].reshape(self.global_state[name].shape)
                start += size
                if self.config.upload == "gradient" and name in self.param_names:
                    total = total * -self.config.gradient_lr
                out[name] = total.astype(np.float32)
            return out
        for name in self.global_state:
            total = np.zeros(self.global_state[name].shape, dtype=np.float64)
            for w, s in zip(weights, staged):
                total += w * s.delta[name].astype(np.float64)
            if self.config.upload == "gradient" and name in self.param_names:
                total *= -self.config.gradient_lr
            out[name] = total.astype(np.float32)
        return out

    def screen(self, round_: int, used: dict[str, _Staged], excluded: dict[str, str]) -> dict[str, _Staged]:
        """Plausibility and quarantine (cloud_server/robust/): each rebuilt update's norm
        against the global mentee's and the other agents' this round (an update's, not a
        gradient's, is compared with the mentee), and its direction against the round's median
        rebuilt update (a gradient's too: every agent's has the same sign convention), and,
        with a server validation set, by the validation loss of the global mentee plus the update;
        implausible ones refused, quarantined agents' judged but not used."""
        def measure() -> tuple[dict[str, float], float]:
            reference = 0.0
            if self.config.upload != "gradient":
                reference = float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in self.global_state.values())))
            norms = {a: float(np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2)) for d in s.delta.values())))
                     for a, s in used.items()}
            return norms, reference

        def blocks(agents: Sequence[str]) -> Iterator[np.ndarray]:
            for n in self.global_state:
                yield np.stack([used[a].delta[n].astype(np.float64).ravel() for a in agents])  # (K, entries)

        judge = None  # the server's validation set, when it holds one (cloud_server/robust/validation_screen.py)
        if self.ctx.validation is not None:
            gradient = self.config.upload == "gradient"

            def candidate(agent: str) -> dict[str, np.ndarray]:  # the global mentee plus the update, as aggregate() adds it
                return {n: base + (-self.config.gradient_lr * d if gradient and n in self.param_names else d)
                        for n, base in self.global_state.items() for d in (used[agent].delta[n].astype(np.float32),)}

            judge = self.ctx.validation.judge_states(
                round_, self.ctx.ledger, build_model(self.config.mentee_model, self.ctx.num_classes, self.ctx.in_channels),
                lambda m, x: forward_with_hidden(m, x).logits, self.global_state, candidate)
        return screen_uploads(round_, used, excluded, self.ctx.robustness, self.ctx.ledger, measure, blocks, judge)

    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        outcome = RoundOutcome()
        used, outcome.excluded = self.staged.take_usable(round_, ends)
        used = self.screen(round_, used, outcome.excluded)
        for agent in outcome.excluded:
            self.holds.pop(agent, None)  # it gets no aggregate this round
        outcome.used_agents = list(used)
        round_log = self._round_logs.pop(round_, _RoundLog(self.threshold(round_)))
        if not used:
            return outcome
        started = time.perf_counter()
        threshold = round_log.threshold
        mean_update = self.aggregate(list(used.values()), round_, list(used))
        # Lines 17-19: factor the aggregate with the same T; add exactly what the agents will add.
        layout, factors, packed = factor_state(mean_update, threshold)
        base_version = self.version
        self.global_state = {name: base + packed[name].reconstruct() for name, base in self.global_state.items()}
        self.version = round_
        outcome.server_train_s = time.perf_counter() - started
        outcome.samples = sum(s.num_samples for s in used.values())
        losses = [(float(ends[a].metrics["train_loss"]), s.num_samples) for a, s in used.items()
                  if isinstance(ends[a].metrics.get("train_loss"), (int, float))]
        if losses:
            # No server model is trained: report the agents' mean mentee loss (Eq. 7).
            outcome.server_loss = sum(l * n for l, n in losses) / sum(n for _, n in losses)
        for agent in used:
            msg = FedKdAggregate(run=self.ctx.run_id, round=round_, sender="server", version=self.version,
                                 base_version=base_version, threshold=threshold, layout=layout, factors=factors)
            outcome.downloads.append((agent, msg))
            self.holds[agent] = self.version
        self.history.append(self._record(round_, round_log, used, ends, packed))
        return outcome

    # -- evaluation ---------------------------------------------------------------------- #

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        ev = Evaluation(labels={
            HEADLINE: f"agent k's private mentor ({self.config.mentor_model}), the model FedKD infers with (mean over agents)",
            "mentee": f"the global mentee ({self.config.mentee_model}), the federated model",
        })
        # Each agent's mentor, scored on the global set by the agent (checked on arrival).
        ev.global_reported[HEADLINE] = global_results(reports).get(HEADLINE, {})
        mentee = build_model(self.config.mentee_model, self.ctx.num_classes, self.ctx.in_channels)
        ints = {k: v for k, v in state_dict_to_arrays(mentee).items() if v.dtype.kind != "f"}
        load_arrays_into(mentee, {**self.global_state, **ints})
        mentee = mentee.to(self.ctx.device).eval()
        ev.global_models["mentee"] = {Evaluation.GLOBAL: EvalModel(lambda x: forward_with_hidden(mentee, x).logits)}
        local = local_results(reports)
        ev.local[HEADLINE] = local.get(HEADLINE, {})
        ev.local["mentee"] = {a: r for a, r in local.get("mentee", {}).items()
                              if reports[a].results["mentee"].get("version") == self.version}
        return ev

    # -- checkpoints -------------------------------------------------------------------- #

    def state(self) -> Any:
        return {"global": self.global_state, "version": self.version, "history": self.history}

    def load_state(self, state: Any) -> None:
        global_state = {k: np.asarray(v, dtype=np.float32) for k, v in state["global"].items()}
        if set(global_state) != set(self.global_state) or any(v.shape != self.global_state[k].shape for k, v in global_state.items()):
            raise ValueError(f"checkpoint's global mentee does not fit {self.config.mentee_model}")
        self.global_state = global_state
        self.version = int(state["version"])
        self.history = list(state.get("history", []))
        self.holds.clear()  # agents get the whole mentee once after a restart


    # -- FedKD's own figures in the run report: per round, the bytes its SVD factors moved against
    # a dense mentee update and against FedAvg of a mentor-sized model, and Eq. 8's ranks.

    def _record(self, round_: int, round_log: _RoundLog, used: dict[str, _Staged], ends: dict[str, RoundEnd],
                packed: dict[str, svd.SvdTensor]) -> dict[str, Any]:
        """The round's FedKD-specific costs; bytes are float32 tensor payloads (frames add headers)."""
        down_svd = sum(p.payload_bytes for p in packed.values())
        agents = {}
        for agent, s in used.items():
            metrics, uploads = ends[agent].metrics, ends[agent].uploads
            fallback = uploads.get("dense_fallback_ranks")
            agents[agent] = {
                "ranks": s.ranks,
                "dense_fallback_ranks": dict(fallback) if isinstance(fallback, dict) else {},
                "svd_bytes": s.svd_bytes,
                "dense_bytes": s.dense_bytes,
                "frame_bytes": int(uploads.get("frame_bytes", 0)),
                **{k: metrics[k] for k in ("mentor_loss", "mentee_loss") if k in metrics},
            }
        up_svd = sum(a["svd_bytes"] for a in agents.values())
        return {
            "round": round_,
            "threshold": round_log.threshold,
            "version": self.version,
            "agents": agents,
            "aggregate": {
                "ranks": _ranks(packed),
                "dense_fallback_ranks": {name: p.eq8_rank for name, p in packed.items() if p.mode == "dense" and p.eq8_rank is not None},
                "energy": {name: p.energy for name, p in packed.items() if p.mode == "factored"},
                "svd_bytes": down_svd,
                "dense_bytes": self.mentee_dense_bytes,
            },
            # Per agent and round, both directions: what FedKD sent vs a dense mentee update
            # vs FedAvg of a model as large as the mentor.
            "bytes_per_agent": {
                "fedkd_svd": (up_svd / len(agents)) + down_svd,
                "dense_mentee": 2 * self.mentee_dense_bytes,
                "fedavg_mentor": 2 * self.mentor_dense_bytes,
            },
            "sync": {"agents": round_log.sync_agents, "bytes": round_log.sync_bytes},
        }

    def round_report(self, round_: int) -> dict[str, Any]:
        """The round's entry in ``report.json`` (``record["method"]``), from :attr:`history`.

        Bytes are float32 tensor payloads per agent and round, both directions
        (upload + aggregate): FedKD's factors vs the dense mentee update vs FedAvg of
        a mentor-sized model (its float state up and down); ``sync_bytes`` is the
        whole mentee sent in this round's RoundStarts (all agents). ``ranks`` has one
        entry per matrix of the mentee (vectors always travel dense): its 2-D view,
        ``max_factored_rank`` (the largest K whose factors are smaller than the
        matrix), Eq. 8's K of the aggregate (``down``) and of the agents' uploads
        (min / max / mean), and how many of those went dense because K exceeded it.
        """
        record = next((h for h in reversed(self.history) if h["round"] == round_), None)
        if record is None:
            return {"threshold": self.threshold(round_), "agents_used": 0}  # no update was used
        bytes_ = record["bytes_per_agent"]
        uploads = list(record["agents"].values())
        aggregate = record["aggregate"]
        ranks: dict[str, dict[str, Any]] = {}
        for name, array in self.global_state.items():
            dims = svd.matrix_shape(array.shape)
            if dims is None:
                continue
            p, q = dims
            limit = (p * q - 1) // (p + q + 1)  # K * (P + Q + 1) < P * Q
            up = [_eq8_rank(u, name, limit, min(p, q)) for u in uploads]
            known = [k for k in up if k is not None]
            ranks[name] = {
                "matrix": f"{p}x{q}", "max_factored_rank": limit,
                "down": _eq8_rank(aggregate, name, limit, min(p, q)),
                "down_dense": name not in aggregate["ranks"],
                "up_min": min(known) if known else None, "up_max": max(known) if known else None,
                "up_mean": round(float(np.mean(known)), 2) if known else None,
                "up_dense": sum(1 for u in uploads if name not in u["ranks"]),
            }
        return {
            "threshold": record["threshold"],
            "agents_used": len(uploads),
            "up_svd_bytes": round(float(np.mean([u["svd_bytes"] for u in uploads])), 1),
            "down_svd_bytes": aggregate["svd_bytes"],
            "fedkd_bytes": round(bytes_["fedkd_svd"], 1),
            "dense_mentee_bytes": bytes_["dense_mentee"],
            "fedavg_mentor_bytes": bytes_["fedavg_mentor"],
            "saved_vs_dense_mentee": round(1.0 - bytes_["fedkd_svd"] / bytes_["dense_mentee"], 4),
            "saved_vs_fedavg_mentor": round(1.0 - bytes_["fedkd_svd"] / bytes_["fedavg_mentor"], 4),
            "sync_bytes": record["sync"]["bytes"],
            "ranks": ranks,
        }


# -- edgesplit local: this method's [fedkd] table --

from ..local_run import LocalRunOptions  # noqa: E402


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """FedKdConfig's defaults: Eq. 9's schedule follows [server] rounds (schedule_rounds = 0)."""
    return {}
