"""FedDistill edge step (Song et al.): FedAvg local training with the global model
as a decomposed teacher.

The round is FedAvg's (:class:`~edge_agent.methods.fedavg.FedAvgEdge`: receive
the global model, train it locally, upload it); only the loss differs. The
*global* model is the one received at the start of the round (the previous
round's aggregate, frozen, in eval mode); the *local* model starts from it and
is trained with Eq. 10::

    L = CE(y_ll, y) + beta_L * GD(y_gg || y_ll)        (Eq. 7,  L_L)
                    + beta_E * CE(y_lg, y)             (Eq. 8,  L_E)
                    + beta_FC * GD(y_gg || y_gl)       (Eq. 9,  L_FC)

with ``y_ab`` the output of classifier ``b`` on the features of extractor ``a``
(g: global, l: local; Fig. 4). A model is split at its final linear layer
(:mod:`models.heads`): "features" are that layer's input, the "classifier" is
the layer. Gradients: L_L trains the whole local model, L_E only the local
extractor (the global classifier is frozen), L_FC only the local classifier
(the global features are constants).

GD (Eq. 3) splits KL(q^g || q^l) by the agent's own class distribution: a class
is *rich* if its share of the local training set exceeds gamma (1/|C| by
default), otherwise *few*. See :func:`group_distillation_parts` for Eqs. 4-6
and ``docs/methods/feddistill.md`` for how they relate to plain KL.

:meth:`FedDistillEdge.forward_fn` hands the trainer a forward that returns the
local model's features and logits (:func:`models.heads.features_and_logits`)
together with the frozen global model's on exactly the same (possibly
augmented) batch; the loss takes all four.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from models import build_model, load_arrays_into
from models.heads import features_and_logits, linear_head
from shared_protocol.errors import StaleMessageError, ValueRangeError
from shared_protocol.messages import RoundStart
from shared_protocol.methods.fedavg import FedAvgRoundConfig
from shared_protocol.methods.feddistill import ROUND_CONFIG_KEY, FedDistillRoundConfig

from ..costs import RoundMeter
from ..trainer import Forward, LossFn, Trains
from .base import EdgeContext, RoundResult, register_edge_method
from .fedavg import FedAvgEdge

log = logging.getLogger("edge_agent.feddistill")

Weight = float | torch.Tensor  # a constant, or one weight per sample (B,)


# --------------------------------------------------------------------------- #
# The losses (pure functions of tensors; unit-tested against hand computation)
# --------------------------------------------------------------------------- #


def rich_classes(class_counts: np.ndarray | torch.Tensor, threshold: float) -> torch.Tensor:
    """``(K,)`` bool: class c is rich-sample iff n_c / n > gamma (Sec. III-C), else few-sample.

    Absent classes are few-sample classes. An empty dataset has no rich class.
    """
    counts = torch.as_tensor(np.asarray(class_counts), dtype=torch.float64)
    total = float(counts.sum())
    if total <= 0:
        return torch.zeros(counts.shape, dtype=torch.bool)
    return counts / total > threshold


def _masked_logsumexp(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log sum_{i in mask} exp(z_i)`` per row ``(B,)``; finite even where a row's set is empty.

    Rows with an empty set get an arbitrary finite value: callers zero their
    terms. Keeping it finite matters for the backward pass: a logsumexp over
    only ``-inf`` has a NaN gradient, which a later ``where`` would not mask.
    """
    filled = z.masked_fill(~mask, float("-inf"))  # (B, K)
    empty = ~mask.any(dim=1, keepdim=True)  # (B, 1)
    return torch.logsumexp(torch.where(empty, torch.zeros_like(z), filled), dim=1)  # (B,)


def _kl_term(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``p * log(p / q)`` elementwise, from log-probabilities."""
    return log_p.exp() * (log_p - log_q)


@dataclass(frozen=True)
class _GroupLogs:
    log_q_true: torch.Tensor  # (B,)   log q_t
    log_p_not_true: torch.Tensor  # (B,)   log p_\t = log sum_{i != t} q_i
    log_q_tilde: torch.Tensor  # (B, K) log q~_i = log(q_i / p_\t) (meaningful for i != t)
    log_p_rich: torch.Tensor  # (B,)   log p~_r = log(sum_{i in C_r \ t} q_i / p_\t)
    log_p_few: torch.Tensor  # (B,)   log p~_f


def _group_logs(logits: torch.Tensor, labels: torch.Tensor, rich_not_true: torch.Tensor, few_not_true: torch.Tensor) -> _GroupLogs:
    not_true = rich_not_true | few_not_true  # (B, K)
    lse_all = torch.logsumexp(logits, dim=1)  # (B,)
    lse_not_true = _masked_logsumexp(logits, not_true)  # (B,)
    return _GroupLogs(
        log_q_true=logits.gather(1, labels[:, None]).squeeze(1) - lse_all,
        log_p_not_true=lse_not_true - lse_all,
        log_q_tilde=logits - lse_not_true[:, None],
        log_p_rich=_masked_logsumexp(logits, rich_not_true) - lse_not_true,
        log_p_few=_masked_logsumexp(logits, few_not_true) - lse_not_true,
    )


def group_distillation_parts(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor, rich: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(TC-KD, RC-KD, FC-KD)``, each ``(B,)``: Eqs. 4, 5 and 6 for q^g = softmax(teacher), q^l = softmax(student).

    * TC-KD (Eq. 4): KL between the binary distributions (q_t, p_\\t).
    * RC-KD (Eq. 5): KL between the distributions over the non-true classes,
      normalised by p_\\t, with each rich class C_r \\ {t} on its own and the
      few classes lumped into one bin p~_f.
    * FC-KD (Eq. 6): the same with the roles swapped (few classes on their
      own, rich classes lumped into p~_r).

    ``rich``: ``(K,)`` bool from :func:`rich_classes`. No temperature (the
    paper uses none). The teacher is detached. A lumped bin whose class set is
    empty for a sample (e.g. the only few class is the true class) contributes 0.
    """
    if teacher_logits.shape != student_logits.shape or teacher_logits.dim() != 2:
        raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} and student logits {tuple(student_logits.shape)} must be the same (B, K)")
    batch, num_classes = student_logits.shape
    if num_classes < 2:
        raise ValueError("group distillation needs at least 2 classes")
    if labels.shape != (batch,):
        raise ValueError(f"labels {tuple(labels.shape)} do not match the batch of {batch}")
    if rich.shape != (num_classes,) or rich.dtype != torch.bool:
        raise ValueError(f"rich must be a ({num_classes},) bool mask, got {tuple(rich.shape)} {rich.dtype}")
    rich = rich.to(student_logits.device)
    not_true = ~F.one_hot(labels, num_classes).bool()  # (B, K)
    rich_not_true = not_true & rich[None, :]  # C_r \ {t}
    few_not_true = not_true & ~rich[None, :]  # C_f \ {t}
    t = _group_logs(teacher_logits.detach(), labels, rich_not_true, few_not_true)
    s = _group_logs(student_logits, labels, rich_not_true, few_not_true)
    zero = torch.zeros((), dtype=student_logits.dtype, device=student_logits.device)

    tc = _kl_term(t.log_q_true, s.log_q_true) + _kl_term(t.log_p_not_true, s.log_p_not_true)  # (B,)
    per_class = _kl_term(t.log_q_tilde, s.log_q_tilde)  # (B, K), finite everywhere
    rich_sum = torch.where(rich_not_true, per_class, zero).sum(dim=1)  # (B,)
    few_sum = torch.where(few_not_true, per_class, zero).sum(dim=1)  # (B,)
    few_bin = torch.where(few_not_true.any(dim=1), _kl_term(t.log_p_few, s.log_p_few), zero)  # (B,)
    rich_bin = torch.where(rich_not_true.any(dim=1), _kl_term(t.log_p_rich, s.log_p_rich), zero)  # (B,)
    return tc, rich_sum + few_bin, few_sum + rich_bin


def group_distillation(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor, rich: torch.Tensor,
    alpha_t: Weight, alpha_r: Weight, alpha_f: Weight,
) -> torch.Tensor:
    """GD(q^g || q^l) of Eq. 3, averaged over the batch (a scalar).

    The weights are constants (the method's config) or per-sample ``(B,)``
    tensors (e.g. ``alpha_r = alpha_f = p^g_\\t`` for the paper's KL identity;
    see the docs for what that identity gives with Eqs. 4-6 as printed).
    """
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    tc, rc, fc = group_distillation_parts(teacher_logits, student_logits, labels, rich)
    return (alpha_t * tc + alpha_r * rc + alpha_f * fc).mean()


@dataclass(frozen=True)
class FedDistillLoss:
    """The terms of Eq. 10 for one batch (each a scalar tensor)."""

    total: torch.Tensor
    ce: torch.Tensor  # CE(y_ll, y)
    local: torch.Tensor  # L_L, Eq. 7
    extractor: torch.Tensor  # L_E, Eq. 8
    classifier: torch.Tensor  # L_FC, Eq. 9


def feddistill_loss(
    local_features: torch.Tensor, local_logits: torch.Tensor, local_head: torch.nn.Linear,
    global_features: torch.Tensor, global_logits: torch.Tensor, global_head: torch.nn.Linear,
    labels: torch.Tensor, rich: torch.Tensor, cfg: FedDistillRoundConfig,
) -> FedDistillLoss:
    """Eq. 10 from the two models' features (B, D), logits (B, K) and linear heads.

    ``global_*`` are the frozen teacher's (treated as constants);
    ``local_head`` is the local model's own final layer, applied here to the
    global features with ``F.linear``.
    """
    global_features, global_logits = global_features.detach(), global_logits.detach()
    # y_lg: local features through the frozen global classifier; gradients reach the local extractor only.
    y_lg = F.linear(local_features, global_head.weight.detach(), None if global_head.bias is None else global_head.bias.detach())  # (B, K)
    # y_gl: global features through the local classifier; gradients reach the local classifier only.
    y_gl = F.linear(global_features, local_head.weight, local_head.bias)  # (B, K)
    gd = dict(alpha_t=cfg.alpha_t, alpha_r=cfg.alpha_r, alpha_f=cfg.alpha_f)
    ce = F.cross_entropy(local_logits, labels)
    local = group_distillation(global_logits, local_logits, labels, rich, **gd)
    extractor = F.cross_entropy(y_lg, labels)
    classifier = group_distillation(global_logits, y_gl, labels, rich, **gd)
    total = ce + cfg.beta_l * local + cfg.beta_e * extractor + cfg.beta_fc * classifier
    return FedDistillLoss(total=total, ce=ce, local=local, extractor=extractor, classifier=classifier)


# --------------------------------------------------------------------------- #
# The edge step
# --------------------------------------------------------------------------- #

_PART_METRICS = ("loss_ce", "loss_local_gd", "loss_extractor_ce", "loss_classifier_gd")


@register_edge_method
class FedDistillEdge(FedAvgEdge):
    name = "feddistill"

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        try:
            head = linear_head(self.model)
        except TypeError as exc:
            raise ValueRangeError(f"feddistill needs a model with a linear classifier head: {exc}") from None
        # The round's global model, frozen: the teacher of Eqs. 7-9.
        self.teacher = build_model(self.model_name, self.num_classes, ctx.train.in_channels, generator=ctx.weights_generator()).to(ctx.device)
        self.teacher.eval()
        self.teacher.requires_grad_(False)
        self.class_counts = np.bincount(np.asarray(ctx.train.labels, dtype=np.int64), minlength=self.num_classes)[: self.num_classes]
        self.distill: FedDistillRoundConfig | None = None
        self._sums: dict[str, float] = {}
        # The two cross-head passes of every trained sample (y_lg forward + its input gradient;
        # y_gl forward + its weight gradient), 2*D*K FLOPs each: work outside either model.
        self.head_flops_per_sample = 4 * 2 * head.in_features * head.out_features

    # -- the round ------------------------------------------------------------------ #

    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        config = dict(start.config)
        if ROUND_CONFIG_KEY not in config:
            raise ValueRangeError(f"feddistill round_start has no {ROUND_CONFIG_KEY!r} config")
        self.distill = distill = FedDistillRoundConfig.from_dict(config.pop(ROUND_CONFIG_KEY))
        self._sums = dict.fromkeys(_PART_METRICS, 0.0) | {"samples": 0.0}
        # FedAvg's round on FedAvg's own config; our part was taken out above.
        result = super().run_round(replace(start, config=config), meter)
        n = self._sums["samples"]
        if n:
            result.metrics.update({key: self._sums[key] / n for key in _PART_METRICS})
        result.metrics["few_sample_classes"] = int((~self._rich(distill)).sum())
        return result

    def _rich(self, distill: FedDistillRoundConfig) -> torch.Tensor:
        return rich_classes(self.class_counts, distill.threshold(self.num_classes))

    def _load_teacher(self, cfg: FedAvgRoundConfig) -> None:
        # FedAvgEdge.run_round has just made the round's global model current.
        if self.global_state is None or self.global_version != cfg.model_version:
            raise StaleMessageError(f"no global model {cfg.model_version} to distil from (holding {self.global_version})")
        load_arrays_into(self.teacher, self.global_state)
        self.teacher.eval()

    def loss_fn(self, cfg: FedAvgRoundConfig) -> LossFn:
        distill = self.distill
        if distill is None:
            raise ValueRangeError("feddistill loss weights not set: the round config has not been read")
        rich = self._rich(distill).to(self.ctx.device)
        self._load_teacher(cfg)
        sums = self._sums

        def loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
            local_features, local_logits, global_features, global_logits = output  # from forward_fn
            parts = feddistill_loss(
                local_features, local_logits, linear_head(self.model),
                global_features, global_logits, linear_head(self.teacher), labels, rich, distill,
            )
            n = float(labels.shape[0])
            for key, value in zip(_PART_METRICS, (parts.ce, parts.local, parts.extractor, parts.classifier)):
                sums[key] = sums.get(key, 0.0) + float(value.detach()) * n
            sums["samples"] = sums.get("samples", 0.0) + n
            return parts.total

        return loss

    def forward_fn(self, cfg: FedAvgRoundConfig) -> Forward:
        teacher = self.teacher

        def forward(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
            local_features, local_logits = features_and_logits(model, images)  # (B, D), (B, K)
            with torch.no_grad():
                global_features, global_logits = features_and_logits(teacher, images)  # (B, D), (B, K)
            return local_features, local_logits, global_features, global_logits

        return forward

    def trains(self, cfg: FedAvgRoundConfig) -> Trains:
        """The local model, the frozen global model's forward on the same batch, and the cross-head passes."""
        return Trains.of((self.model,), self.input_shape, teachers=(self.teacher,), extra_flops_per_sample=self.head_flops_per_sample)
