"""FedKD edge step (Wu et al. 2022, Algorithm 1 and Eqs. 1-9).

Each agent keeps a private *mentor* (large; never leaves the device, not even to
be evaluated: the agent scores it on the run's public test set itself; it is the
model used for inference) and a copy of the shared *mentee* (small). Every
round, on the agent's own data, both learn at once from the labels and from
each other (``fedkd_losses``, Eqs. 1-7):

* task losses ``L^t_t = CE(y, y^t)`` and ``L^t_s = CE(y, y^s)``;
* adaptive mutual distillation ``L^d_t = KL(y^s || y^t) / (L^t_t + L^t_s)``
  and ``L^d_s = KL(y^t || y^s) / (L^t_t + L^t_s)``;
* adaptive hidden loss ``L^h = (MSE(H^t, W_h H^s) + MSE(A^t, A^s)) / (L^t_t + L^t_s)``
  with ``H`` the pooled penultimate features, ``W_h`` a learnable linear map
  (mentee width -> mentor width, private to the agent) and ``A`` spatial
  attention maps of the last feature maps;
* ``L_t = L^t_t + L^d_t + L^h`` trains the mentor (and ``W_h``),
  ``L_s = L^t_s + L^d_s + L^h`` the mentee.

Then the mentee's change over the round (``upload = "update"``, the default)
or its mean gradient at the global mentee (``"gradient"``) goes up SVD-factored
with the round's threshold T (:class:`FedKdUpdate`), clipped (and noised) first under
``[server] dp_fedavg`` client_clipping (local); the server's aggregate
comes back factored (:class:`FedKdAggregate`) and is added to the agent's copy
of the global mentee, which all agents then share bit for bit.

Choices the paper leaves open, and why (docs/methods/fedkd.md has the rest):

* The task losses in the adaptive weight are the batch means (as in the
  authors' code), and the weight ``1 / (L^t_t + L^t_s)`` is treated as a
  constant (detached): with gradients through it, a model could lower its
  distillation loss by *raising* its task loss. A floor of 1e-8 only guards the
  division when both models fit a batch perfectly.
* Each model gets the gradient of its own loss only: in ``L_t`` the mentee's
  outputs are targets (detached), in ``L_s`` the mentor's are; ``W_h`` appears
  in both hidden terms and learns from both.
* The mentee's optimiser starts afresh every round (the global mentee moved);
  the mentor's persists, since the mentor only ever learns locally.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import models.mentor  # noqa: F401  (registers the mentor architectures, e.g. resnet20)
from fldata import ArrayDataset
from fldata.torch_data import make_loader
from models import WeightsMismatchError, build_model, load_arrays_into, state_dict_to_arrays
from models.mentor import HiddenOutputs, forward_with_hidden, hidden_dim
from models.seeding import build_seeded
from models.training import INFERENCE_BATCH_SAMPLES, accuracy_and_loss, make_optimizer
from shared_protocol.errors import ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import EvalRequest, Message, RoundStart
from shared_protocol.methods.fedkd import FedKdAggregate, FedKdRoundConfig, FedKdUpdate, factor_state, unfactor_state

from ..costs import RoundMeter
from ..privacy import agent_privacy, privatise_update
from ..trainer import LossFn, Trains, train_epochs
from .base import EdgeContext, EdgeMethod, EvalAnswer, RoundResult, register_edge_method, shard_result

log = logging.getLogger("edge_agent.fedkd")

#: Guards 1 / (L^t_t + L^t_s) when both task losses underflow to 0 (a perfectly fitted batch).
ADAPTIVE_WEIGHT_FLOOR = 1e-8


# --------------------------------------------------------------------------- #
# The losses (Eqs. 1-7)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class FedKdLosses:
    """One batch's FedKD losses. ``mentor`` and ``mentee`` carry gradients (each to its
    own model, both to ``W_h``); the rest are detached parts, for logs and tests."""

    mentor: torch.Tensor  # L_t, Eq. 6
    mentee: torch.Tensor  # L_s, Eq. 7
    task_mentor: torch.Tensor  # L^t_t, Eq. 1
    task_mentee: torch.Tensor  # L^t_s, Eq. 2
    distill_mentor: torch.Tensor  # L^d_t, Eq. 3
    distill_mentee: torch.Tensor  # L^d_s, Eq. 4
    hidden: torch.Tensor  # L^h_t = L^h_s, Eq. 5
    weight: torch.Tensor  # 1 / (L^t_t + L^t_s)


def kl_divergence(log_target: torch.Tensor, log_model: torch.Tensor) -> torch.Tensor:
    """``KL(a, b) = sum_i a_i log(a_i / b_i)`` per sample from log-probabilities, mean over the batch."""
    return (log_target.exp() * (log_target - log_model)).sum(dim=1).mean()  # (B, K) -> (B,) -> ()


def attention_map(feature_map: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Spatial attention of a feature map: channel-mean of squares, pooled to ``size``,
    flattened and L2-normalised per sample (Zagoruyko & Komodakis). (B, C, h, w) -> (B, size[0] * size[1])."""
    energy = feature_map.pow(2).mean(dim=1, keepdim=True)  # (B, 1, h, w)
    if tuple(energy.shape[-2:]) != tuple(size):
        energy = F.adaptive_avg_pool2d(energy, size)  # (B, 1, size)
    return F.normalize(energy.flatten(1), dim=1)  # (B, size[0] * size[1])


def fedkd_losses(
    mentor_out: HiddenOutputs,
    mentee_out: HiddenOutputs,
    labels: torch.Tensor,
    projection: nn.Module | None,
    attention: bool,
    *,
    mentor_distillation: bool = True,
    mentee_distillation: bool = True,
    adaptive_weight: bool = True,
) -> FedKdLosses:
    """Eqs. 1-7 for one batch. ``projection`` is W_h (None: no hidden-state term);
    ``attention`` adds the attention-map term of Eq. 5. The ablations of the paper's Figs. 2-3:
    ``mentor_distillation`` / ``mentee_distillation`` False leave that model's task loss alone
    (it learns from the labels only); ``adaptive_weight`` False weights the distillation and
    hidden terms 1 instead of ``1 / (L^t_t + L^t_s)``."""
    task_t = F.cross_entropy(mentor_out.logits, labels)  # Eq. 1
    task_s = F.cross_entropy(mentee_out.logits, labels)  # Eq. 2
    # A reliability gauge, not something to optimise: detached (see the module docstring).
    if adaptive_weight:
        weight = 1.0 / torch.clamp(task_t.detach() + task_s.detach(), min=ADAPTIVE_WEIGHT_FLOOR)
    else:
        weight = task_t.new_ones(())
    log_t = F.log_softmax(mentor_out.logits, dim=1)  # (B, K)
    log_s = F.log_softmax(mentee_out.logits, dim=1)  # (B, K)
    kl_t = kl_divergence(log_s.detach(), log_t)  # KL(y^s || y^t): the mentor learns from the mentee
    kl_s = kl_divergence(log_t.detach(), log_s)  # KL(y^t || y^s): the mentee learns from the mentor
    zero = task_t.new_zeros(())
    hidden_t, hidden_s = zero, zero
    if projection is not None:
        hidden_t = F.mse_loss(mentor_out.hidden, projection(mentee_out.hidden.detach()))  # (B, D_t) vs W_h (B, D_s)
        hidden_s = F.mse_loss(mentor_out.hidden.detach(), projection(mentee_out.hidden))
    if attention:
        size = (
            min(mentor_out.feature_map.shape[-2], mentee_out.feature_map.shape[-2]),
            min(mentor_out.feature_map.shape[-1], mentee_out.feature_map.shape[-1]),
        )
        att_t, att_s = attention_map(mentor_out.feature_map, size), attention_map(mentee_out.feature_map, size)
        hidden_t = hidden_t + F.mse_loss(att_t, att_s.detach())
        hidden_s = hidden_s + F.mse_loss(att_t.detach(), att_s)
    distill_t = weight * kl_t if mentor_distillation else zero
    distill_s = weight * kl_s if mentee_distillation else zero
    hidden_t = weight * hidden_t if mentor_distillation else zero
    hidden_s = weight * hidden_s if mentee_distillation else zero
    mentor = task_t + distill_t + hidden_t  # Eq. 6
    mentee = task_s + distill_s + hidden_s  # Eq. 7
    return FedKdLosses(
        mentor=mentor, mentee=mentee, task_mentor=task_t.detach(), task_mentee=task_s.detach(),
        distill_mentor=distill_t.detach(), distill_mentee=distill_s.detach(),
        hidden=(hidden_t if mentor_distillation else hidden_s).detach(), weight=weight,
    )


class MutualPair(nn.Module):
    """Mentor, mentee and W_h as one module for the generic trainer: one forward
    runs both models on the batch."""

    def __init__(self, mentor: nn.Module, mentee: nn.Module, projection: nn.Linear) -> None:
        super().__init__()
        self.mentor = mentor
        self.mentee = mentee
        self.projection = projection

    def forward(self, x: torch.Tensor) -> tuple[HiddenOutputs, HiddenOutputs]:  # (B, C, H, W)
        return forward_with_hidden(self.mentor, x), forward_with_hidden(self.mentee, x)


# --------------------------------------------------------------------------- #
# The edge step
# --------------------------------------------------------------------------- #


def float_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The float entries of a state dict (parameters, BatchNorm statistics): what the
    mentee shares. Integer counters (``num_batches_tracked``) stay local."""
    return {k: v for k, v in state_dict_to_arrays(model).items() if v.dtype.kind == "f"}


@register_edge_method
class FedKdEdge(EdgeMethod):
    name = "fedkd"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        settings = ctx.settings
        self.num_classes = int(settings["num_classes"])
        self.mentor_name = str(settings.get("mentor_model", "resnet56"))
        self.mentee_name = str(settings.get("mentee_model", "resnet8"))
        in_channels = ctx.train.in_channels
        generator = ctx.weights_generator()  # the agent's own stream: mentor, mentee, then W_h
        self.mentor = build_model(self.mentor_name, self.num_classes, in_channels, generator=generator).to(ctx.device)
        self.mentee = build_model(self.mentee_name, self.num_classes, in_channels, generator=generator).to(ctx.device)
        widths = (hidden_dim(self.mentee), hidden_dim(self.mentor))
        self.projection = build_seeded(lambda: nn.Linear(*widths), generator).to(ctx.device)  # W_h
        self.pair = MutualPair(self.mentor, self.mentee, self.projection)
        self.global_state: dict[str, np.ndarray] | None = None  # the global mentee this agent holds
        self.global_version = -1
        self.optimizer: torch.optim.Optimizer | None = None
        self._optimizer_key: tuple | None = None
        shape = tuple(ctx.train.images.shape[1:])  # (C, H, W)
        # A step trains both models (W_h's and the attention maps' work is not counted).
        self.trains = Trains.of((self.mentor, self.mentee), shape)
        self.mentor_flops, self.mentee_flops = self.trains.models
        # DP-FedAvg's client side (edge_agent/privacy.py): the mentee's update clipped (and noised)
        # before it is factored; the noise draws from OS entropy, not the run's seed.
        self.privacy = agent_privacy(settings)
        self._dp_rng = np.random.default_rng()

    # -- the global mentee ------------------------------------------------------- #

    def _load_global(self, state: dict[str, np.ndarray] | None = None) -> None:
        """Load ``state`` (default: the held global mentee) into the mentee; all or nothing.
        The mentee's integer counters (``num_batches_tracked``) are its own."""
        state = self.global_state if state is None else state
        assert state is not None
        ints = {k: v for k, v in state_dict_to_arrays(self.mentee).items() if v.dtype.kind != "f"}
        try:
            load_arrays_into(self.mentee, {**state, **ints})
        except WeightsMismatchError as exc:
            raise ShapeMismatchError(f"global mentee does not fit {self.mentee_name}: {exc}") from None

    def _receive_global(self, start: RoundStart, cfg: FedKdRoundConfig) -> None:
        if start.weights:
            state = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in start.weights.items()}
            self._load_global(state)  # checks names and shapes before the copy is adopted
            self.global_state, self.global_version = state, cfg.global_version
            return
        if self.global_state is None or self.global_version != cfg.global_version:
            # The server believed we hold this version (e.g. we restarted without local state,
            # or its aggregate never arrived): fail the round; it sends the whole mentee next time.
            raise StaleMessageError(f"round_start names global mentee {cfg.global_version} without weights; this agent holds {self.global_version}")
        self._load_global()

    def on_message(self, msg: Message) -> bool:
        if isinstance(msg, FedKdAggregate):
            self._apply_aggregate(msg)
            return True
        return False

    def _apply_aggregate(self, msg: FedKdAggregate) -> None:
        """Algorithm 1, lines 20-22: rebuild the aggregate and add it to the global mentee."""
        if self.global_state is None or msg.base_version != self.global_version:
            raise StaleMessageError(f"aggregate applies to global mentee {msg.base_version}; this agent holds {self.global_version}")
        tensors = unfactor_state(msg.TYPE, msg.layout, msg.factors)
        if set(tensors) != set(self.global_state):
            raise ShapeMismatchError(f"{msg.TYPE}: tensors {sorted(set(tensors) ^ set(self.global_state))[:5]} do not match the mentee")
        new_state = {}
        for name, base in self.global_state.items():
            if tensors[name].shape != base.shape:
                raise ShapeMismatchError(f"{msg.TYPE}: {name!r} has shape {tensors[name].shape}, mentee has {base.shape}")
            new_state[name] = base + tensors[name].reconstruct()  # float32 + float32: the server does the same sum
            if not np.isfinite(new_state[name]).all():
                raise ValueRangeError(f"{msg.TYPE}: applying {name!r} gives non-finite values")
        self.global_state, self.global_version = new_state, msg.version
        self._load_global()

    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """FedKD infers with the mentor (the paper's test phase): the deployed model, private, so
        scored here on the shard and on the public global set the request names. The global
        mentee (with the round's aggregate) stands beside it on the shard."""
        with meter.phase("compute"):
            mentor_correct, total, mentor_loss = self._scored(self.mentor, self.ctx.test)
            results = {"model": shard_result(mentor_correct, total, mentor_loss)}
            meter.forward(self.mentor_flops, total)
            if self.global_state is not None:
                self._load_global()
                mentee_correct, _, _ = self._scored(self.mentee, self.ctx.test)
                meter.forward(self.mentee_flops, total)
                results["mentee"] = shard_result(mentee_correct, total, version=self.global_version)
        global_results = {}
        if request.public_set.dataset:
            public = self.ctx.public_set(request.public_set, meter, request.round)  # once per run; a download is network time
            with meter.phase("compute"):
                correct, public_total, loss_sum = self._scored(self.mentor, public)
                meter.forward(self.mentor_flops, public_total)
            global_results["model"] = shard_result(correct, public_total, loss_sum)
        return EvalAnswer(results=results, global_results=global_results)

    # -- the round ---------------------------------------------------------------- #

    def _optimizer_for(self, cfg: FedKdRoundConfig) -> torch.optim.Optimizer:
        """Mentor and W_h keep their optimiser state across rounds; the mentee's starts
        afresh (and in gradient mode the mentee is not stepped locally at all)."""
        key = (cfg.optimizer, cfg.mentor_lr, cfg.mentee_lr, cfg.momentum, cfg.weight_decay, cfg.upload)
        if self.optimizer is None or key != self._optimizer_key:
            groups = [{"params": [*self.mentor.parameters(), *self.projection.parameters()], "lr": cfg.mentor_lr}]
            if cfg.upload == "update":
                groups.append({"params": list(self.mentee.parameters()), "lr": cfg.mentee_lr})
            self.optimizer = make_optimizer(cfg.optimizer, groups, cfg.mentor_lr, cfg.momentum, cfg.weight_decay)  # type: ignore[arg-type]
            self._optimizer_key = key
        else:
            for p in self.mentee.parameters():
                self.optimizer.state.pop(p, None)
        return self.optimizer

    def loss_fn(self, cfg: FedKdRoundConfig, stats: dict[str, float]) -> LossFn:
        """``L_t + L_s`` (each part reaches only its own model); accumulates per-part sums in ``stats``."""

        def loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            mentor_out, mentee_out = output  # type: ignore[misc]
            parts = fedkd_losses(mentor_out, mentee_out, labels, self.projection if cfg.hidden_loss else None, cfg.attention_loss,
                                 mentor_distillation=cfg.mentor_distillation, mentee_distillation=cfg.mentee_distillation,
                                 adaptive_weight=cfg.adaptive_weight)
            n = int(labels.shape[0])
            stats["samples"] += n
            stats["mentor_loss"] += float(parts.mentor.detach()) * n
            stats["mentee_loss"] += float(parts.mentee.detach()) * n
            stats["hidden_loss"] += float(parts.hidden) * n
            return parts.mentor + parts.mentee

        return loss

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        cfg = FedKdRoundConfig.from_dict(start.config)
        ctx = self.ctx
        stats = {"samples": 0.0, "mentor_loss": 0.0, "mentee_loss": 0.0, "hidden_loss": 0.0}
        with meter.phase("compute"):
            self._receive_global(start, cfg)
            optimizer = self._optimizer_for(cfg)
            self.mentee.zero_grad(set_to_none=True)  # gradient mode sums the round's gradients here
            loader = meter.deadline.batches(make_loader(ctx.train, cfg.batch_size, shuffle=True, augment=ctx.augment, seed=ctx.seed + start.round))
            result = train_epochs(
                self.pair, loader, optimizer, self.loss_fn(cfg, stats), cfg.local_epochs, meter=meter, trains=self.trains,
                device=ctx.device, progress=ctx.progress, desc=f"{ctx.agent_id} round {start.round}",
            )
        n = max(stats["samples"], 1.0)
        metrics: dict = {
            "train_loss": stats["mentee_loss"] / n,
            "mentor_loss": stats["mentor_loss"] / n,
            "mentee_loss": stats["mentee_loss"] / n,
            "hidden_loss": stats["hidden_loss"] / n,
        }
        uploads = self._upload(start, cfg, result.steps, meter, metrics)
        return RoundResult(num_samples=len(ctx.train), uploads=uploads, metrics={k: v for k, v in metrics.items() if v is not None})

    def _upload(self, start: RoundStart, cfg: FedKdRoundConfig, steps: int, meter: RoundMeter, metrics: dict) -> dict:
        """Algorithm 1, lines 8-10: factor the mentee's update (or mean gradient) and send it;
        under ``[server] dp_fedavg`` client_clipping or local, clipped (and noised) first."""
        assert self.global_state is not None
        with meter.phase("encode"):
            local = float_state(self.mentee)
            delta = {name: local[name] - base for name, base in self.global_state.items()}  # float32
            if cfg.upload == "gradient":
                # Parameters: the mean gradient at the global mentee; BatchNorm statistics
                # (no gradient) still travel as their change over the round.
                for name, p in self.mentee.named_parameters():
                    grad = p.grad.detach().cpu().numpy() / max(steps, 1) if p.grad is not None else np.zeros_like(delta[name])
                    delta[name] = np.ascontiguousarray(grad, dtype=np.float32)
            if self.privacy.agent_clips:
                # Before factoring: the SVD of a clipped (local: noised) update is post-processing,
                # which keeps the guarantee, and a truncated SVD's reconstruction is no longer in
                # Frobenius norm than the tensor, so what the server rebuilds stays within C.
                private, metrics["dp_update_norm"] = privatise_update(delta, self.privacy, self._dp_rng)
                delta = {name: np.ascontiguousarray(u, dtype=np.float32) for name, u in private.items()}
            layout, factors, packed = factor_state(delta, cfg.threshold)
        msg = FedKdUpdate(
            run=self.ctx.run_id, round=start.round, sender=self.ctx.agent_id, instance=self.ctx.instance,
            num_samples=len(self.ctx.train), base_version=self.global_version, payload=cfg.upload,
            threshold=cfg.threshold, layout=layout, factors=factors,
        )
        encoded_before = meter.encoded_bytes
        self.ctx.send(msg, meter)
        dense_bytes = sum(4 * p.dense_elements for p in packed.values())
        # The agent counted the factors as the raw size; for the codec ratio in the cost
        # report the raw size of an SVD upload is the dense update it stands for.
        meter.raw_bytes += dense_bytes - factors.nbytes
        return {
            "payload": cfg.upload,
            "threshold": cfg.threshold,
            "base_version": self.global_version,
            "ranks": {name: p.rank for name, p in packed.items() if p.mode == "factored"},
            # Matrices whose Eq. 8 rank was too high for factors to pay: sent dense.
            "dense_fallback_ranks": {name: p.eq8_rank for name, p in packed.items() if p.mode == "dense" and p.eq8_rank is not None},
            "factored_tensors": sum(1 for p in packed.values() if p.mode == "factored"),
            "dense_tensors": sum(1 for p in packed.values() if p.mode == "dense"),
            "svd_bytes": sum(p.payload_bytes for p in packed.values()),
            "dense_bytes": dense_bytes,
            "frame_bytes": meter.encoded_bytes - encoded_before,
        }

    @torch.no_grad()
    def _scored(self, model: nn.Module, data: ArrayDataset) -> tuple[int, int, float]:
        """(correct, total, summed cross-entropy) of ``model`` in eval mode on ``data``."""
        model.eval()
        return accuracy_and_loss(lambda x: forward_with_hidden(model, x).logits, make_loader(data, INFERENCE_BATCH_SAMPLES), self.ctx.device)

    # -- local persistence ------------------------------------------------------- #

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = {f"mentor/{k}": v for k, v in state_dict_to_arrays(self.mentor).items()}
        state.update({f"projection/{k}": v for k, v in state_dict_to_arrays(self.projection).items()})
        if self.global_state is not None:
            state.update({f"global/{k}": v for k, v in self.global_state.items()})
            state["global_version"] = np.asarray(self.global_version, dtype=np.int64)
        return state

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        def part(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

        if any(k.startswith("mentor/") for k in arrays):
            load_arrays_into(self.mentor, part("mentor/"))
            load_arrays_into(self.projection, part("projection/"))
        if "global_version" in arrays:
            self.global_state = part("global/")
            self.global_version = int(arrays["global_version"])
            self._load_global()
