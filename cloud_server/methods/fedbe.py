"""FedBE server step (Chen & Chao, "FedBE: Making Bayesian Model Ensemble
Applicable to Federated Learning", ICLR 2021; Algorithm 1).

The agents run plain FedAvg local training (``edge_agent/methods/fedbe.py``) and
upload their models with :class:`FedAvgUpdate`; the wire is FedAvg's. Only the
server step differs. After collecting the round's client models ``w_i`` the
server

1. builds the weight average ``w_bar`` (Eq. 2, :func:`cloud_server.aggregation.weighted_mean`);
2. fits a global model distribution to the client models: a diagonal Gaussian
   (Eq. 5, :func:`cloud_server.aggregation.fit_diagonal_gaussian`) or a Dirichlet over client mixtures
   (Eq. 7, :func:`cloud_server.aggregation.sample_dirichlet`), and samples ``M`` models from it;
3. ensembles ``{w_bar} u {w_i} u {w^(m)}`` on its unlabeled set by the mean of
   their softmax probabilities (Eq. 4, :func:`models.losses.ensemble_probabilities`), which
   gives the pseudo-labels ``p_hat_j``;
4. distils the ensemble into the global model with SWA, starting from
   ``w_bar``: SGD on the soft cross-entropy ``-1/J sum_j p_hat_j^T log p(y|x_j; w)``
   with a cyclical learning rate (:func:`models.swa.swa_learning_rate`), collecting the
   weights at the end of each cycle after the warm-up and averaging them
   (:class:`models.swa.SwaAverage`), through the shared training loop
   (:func:`distill_swa`).

BatchNorm: the running statistics of every *sampled* model, and of the SWA
average, are recomputed on the unlabeled set (a forward pass in train mode
with a cumulative average, :func:`models.swa.recompute_bn_statistics`); a sample of BN
statistics from a Gaussian has no meaning (and a negative variance is
possible). Client models keep their own statistics, ``w_bar`` the averaged ones.

The unlabeled set is the server's (:func:`load_server_data`): by default the
part of the federation's training split that the agents do not take
(``unlabeled_split = "train-holdout"``), or a whole split of any dataset.
Its labels, when it has any, are never used for training; they only give the
per-round figures in :meth:`FedBEServer.round_report`.

Evaluation on the agents' test shards is FedAvg's (the global model the agents
evaluate is the distilled one). The math is in small pure functions so it is
unit-testable; see ``docs/methods/fedbe.md`` for the equations and deviations.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from fldata import ArrayDataset, load_dataset, take, train_holdout
from models import build_model, count_parameters, forward_flops_per_sample, load_arrays_into, state_dict_to_arrays, training_flops_per_sample
from models.losses import soft_cross_entropy
from models.swa import SwaAverage, predict_probabilities, recompute_bn_statistics, swa_collects_after, swa_learning_rate
from models.training import Batch, Trainer, make_optimizer

from ..aggregation import build_sampled_state, fit_diagonal_gaussian, sample_dirichlet, sample_gaussian
from ..row_bank import normalised_images
from ..server_step import TrainStep
from .base import ServerContext, register_server_method
from .fedavg import FedAvgConfig, FedAvgServer

log = logging.getLogger("cloud_server.fedbe")

POSTERIORS = ("gaussian", "dirichlet")
UNLABELED_SPLITS = ("train-holdout", "train", "test", "valid")


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class FedBEConfig(FedAvgConfig):
    """``[fedbe]``: FedAvg's keys (local training, codecs) plus the server's ensemble
    and distillation. Defaults are the paper's method (Gaussian, M = 10, SWA
    1e-3 -> 4e-4 in cycles of 25 steps) at a CPU-friendly length; the paper
    distils 20 epochs of 10K images at batch 128 and starts SWA at step 250."""

    TABLE: ClassVar[str] = "fedbe"
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "unlabeled_dataset": "required: the `fldata` dataset of the server's unlabeled set (e.g. `\"fashion-mnist\"`)",
        "unlabeled_split": "`train-holdout`: its training split less the agents' seeded subset; `train`, `test`, "
                           "`valid`: that whole split",
        "unlabeled_root, unlabeled_download": "as an agent's `[data]` `root` and `download`",
        "unlabeled_samples": "images of the unlabeled set (0: all of the pool less `validation_samples`)",
        "validation_samples": "labelled held-out images for the report's figures (0: report on the unlabeled set)",
        "agent_train_samples, agent_data_seed": "`train-holdout`: the agents' `data.train_samples` and `data.seed` "
                                                "(unset: `[server] seed`)",
        "posterior, variance_scale, dirichlet_alpha": "the global model distribution: `gaussian`, N(mu, variance_scale x "
                                                      "Sigma_diag) (1: Eq. 5), or `dirichlet`, alpha = dirichlet_alpha x 1 "
                                                      "(Eq. 7)",
        "sampled_models": "M, models sampled for the ensemble",
        "ensemble_weight_average, ensemble_clients": "add the weight average w_bar, and the clients' models, to the ensemble",
        "distill_steps, distill_batch_size, distill_momentum, distill_weight_decay":
            "SWA distillation (SGD) of w_bar on the ensemble's soft labels",
        "swa_warmup_steps, swa_cycle_steps, swa_lr_max, swa_lr_min":
            "steps at the max lr before the first cycle; steps a cycle (weights collected at its end), its lr falling "
            "from max to min",
        "eval_batch_size": "forward passes (ensemble, BatchNorm statistics, accuracy): small suits CPU caches; raise it "
                           "on a GPU",
    }

    # The server's unlabeled data (see load_server_data).
    unlabeled_dataset: str = ""  # required: a fldata dataset name (usually the federation's)
    unlabeled_split: str = "train-holdout"  # train-holdout | train | test | valid
    unlabeled_root: str | None = None
    unlabeled_download: bool = False
    unlabeled_samples: int = 1000  # 0: all of the pool (less validation_samples)
    validation_samples: int = 0  # labelled held-out figures in the round report (0: report on the unlabeled set)
    agent_train_samples: int = 0  # train-holdout: the agents' data.train_samples (their seeded subset)
    agent_data_seed: int | None = None  # train-holdout: the agents' data.seed (None: the server's seed)
    # The global model distribution and the ensemble (Algorithm 1).
    posterior: str = "gaussian"  # gaussian (Eq. 5) | dirichlet (Eq. 7)
    sampled_models: int = 10  # M
    variance_scale: float = 1.0  # Gaussian: sample from N(mu, scale * Sigma_diag); 1 is Eq. 5
    dirichlet_alpha: float = 1.0  # Dirichlet: alpha = dirichlet_alpha * 1
    ensemble_weight_average: bool = True  # include w_bar in the ensemble
    ensemble_clients: bool = True  # include the client models
    # Distillation with SWA.
    distill_steps: int = 200
    distill_batch_size: int = 64
    swa_warmup_steps: int = 100  # constant lr_max before the first cycle (the paper: 250)
    swa_cycle_steps: int = 25  # collect the weights at the end of every cycle
    swa_lr_max: float = 1e-3
    swa_lr_min: float = 4e-4
    distill_momentum: float = 0.9
    distill_weight_decay: float = 0.0
    # Forward passes (ensemble, BN statistics, accuracy). Small batches stay in the CPU caches, so ResNet-56
    # inference is faster per image at 32-64 than at 256 on a CPU; on a GPU raise it (e.g. 1024).
    eval_batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.unlabeled_dataset:
            raise ValueError("fedbe.unlabeled_dataset is required: the dataset of the server's unlabeled set "
                             "(usually the federation's, e.g. \"fashion-mnist\")")
        if self.unlabeled_split not in UNLABELED_SPLITS:
            raise ValueError(f"fedbe.unlabeled_split must be one of {UNLABELED_SPLITS}, got {self.unlabeled_split!r}")
        if self.unlabeled_split == "train-holdout" and self.agent_train_samples < 1:
            raise ValueError("fedbe.unlabeled_split = \"train-holdout\" needs agent_train_samples >= 1 (the agents' "
                             "data.train_samples): agents that take the whole training split leave nothing to hold out")
        for name in ("unlabeled_samples", "validation_samples", "agent_train_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"fedbe.{name} must be >= 0, got {getattr(self, name)}")
        if self.posterior not in POSTERIORS:
            raise ValueError(f"fedbe.posterior must be one of {POSTERIORS}, got {self.posterior!r}")
        if self.sampled_models < 0:
            raise ValueError(f"fedbe.sampled_models must be >= 0, got {self.sampled_models}")
        if not self.variance_scale >= 0 or not self.dirichlet_alpha > 0:
            raise ValueError("fedbe.variance_scale must be >= 0 and dirichlet_alpha > 0")
        if self.sampled_models == 0 and not (self.ensemble_weight_average or self.ensemble_clients):
            raise ValueError("fedbe: the ensemble is empty (sampled_models = 0 and neither the weight average nor the clients)")
        for name in ("distill_steps", "distill_batch_size", "swa_cycle_steps", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"fedbe.{name} must be >= 1, got {getattr(self, name)}")
        if self.swa_warmup_steps < 0:
            raise ValueError(f"fedbe.swa_warmup_steps must be >= 0, got {self.swa_warmup_steps}")
        if self.distill_steps < self.swa_warmup_steps + self.swa_cycle_steps:
            raise ValueError(f"fedbe.distill_steps ({self.distill_steps}) must be >= swa_warmup_steps + swa_cycle_steps "
                             f"({self.swa_warmup_steps} + {self.swa_cycle_steps}): SWA would collect no model")
        if not 0 < self.swa_lr_min <= self.swa_lr_max:
            raise ValueError(f"fedbe: need 0 < swa_lr_min <= swa_lr_max, got {self.swa_lr_min} and {self.swa_lr_max}")
        if self.distill_momentum < 0 or self.distill_weight_decay < 0:
            raise ValueError("fedbe.distill_momentum and distill_weight_decay must be >= 0")

    @property
    def swa_models_per_round(self) -> int:
        return (self.distill_steps - self.swa_warmup_steps) // self.swa_cycle_steps


# --------------------------------------------------------------------------- #
# The server step
# --------------------------------------------------------------------------- #


@register_server_method
class FedBEServer(FedAvgServer):
    sums_updates = False  # it samples models around the agents' own: secure aggregation cannot stand in
    name = "fedbe"
    config_class = FedBEConfig
    # The ensemble samples around the agents' own models: only noise they add themselves keeps them private.
    dp_fedavg_modes = ("local",)

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        super().__init__(ctx, method_config)
        self.config: FedBEConfig  # type: ignore[assignment]  # set by FedAvgServer from config_class
        self.device = torch.device(ctx.device)
        unlabeled, validation = load_server_data(self.config, ctx.seed)
        if unlabeled.in_channels != ctx.in_channels:
            raise ValueError(f"fedbe: the unlabeled set ({self.config.unlabeled_dataset}) has {unlabeled.in_channels} "
                             f"channels, the federation's models take {ctx.in_channels}")
        self.unlabeled, self.validation = unlabeled, validation
        # Held once on the device: the ensemble, BN statistics and distillation make ~M + 10 passes a round.
        self._images = normalised_images(unlabeled).to(self.device)  # (J, C, H, W)
        self._val_images = normalised_images(validation).to(self.device) if validation is not None else None
        # Labels only measure the round (never train): meaningful when the set has the federation's classes.
        same_task = unlabeled.num_classes == ctx.num_classes
        self._labels = torch.from_numpy(unlabeled.labels) if same_task else None
        self._val_labels = torch.from_numpy(validation.labels) if same_task and validation is not None else None
        self._work = build_model(self.config.model, ctx.num_classes, ctx.in_channels).to(self.device)
        self._param_names = [name for name, _ in self._work.named_parameters()]
        self._flops: tuple[int, int] | None = None
        self._distill_step: TrainStep | None = None  # made by the first distillation, reused after
        self._reports: dict[int, dict[str, Any]] = {}
        log.info("fedbe: %d unlabeled samples from %s/%s%s, device %s", len(unlabeled), self.config.unlabeled_dataset,
                 self.config.unlabeled_split, f", {len(validation)} for validation" if validation is not None else "", self.device)

    def resolved_config(self) -> dict[str, Any]:
        return self.config.to_table()

    def _flops_per_sample(self) -> tuple[int, int]:
        """(training, forward) FLOPs per server-set sample, counted once."""
        if self._flops is None:
            shape = tuple(self._images.shape[1:])
            cpu_model = self.model  # counted on the CPU copy: the work model may be on a GPU
            self._flops = (training_flops_per_sample(cpu_model, shape), forward_flops_per_sample(cpu_model, shape))
        return self._flops

    def model_info(self) -> dict[str, Any]:
        info = super().model_info()
        # The server trains the same architecture (distillation on its unlabeled set).
        info["server"] = {"name": self.config.model, "params": count_parameters(self.model),
                          "train_flops_per_sample": self._flops_per_sample()[0]}
        return info

    def round_report(self, round_: int) -> dict[str, Any]:
        return dict(self._reports.get(round_, {}))

    def _probabilities_of(self, state: Mapping[str, np.ndarray], recompute_bn: bool) -> torch.Tensor:
        load_arrays_into(self._work, state)
        if recompute_bn:
            recompute_bn_statistics(self._work, self._images, self.config.eval_batch_size)
        return predict_probabilities(self._work, self._images, self.config.eval_batch_size)  # (J, K)

    def _sample_states(self, round_: int, states: list[dict[str, np.ndarray]], num_samples: list[int],
                       template: dict[str, np.ndarray]) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
        """M models from the global model distribution fitted to the clients (Eq. 5 or 7)."""
        c = self.config
        rng = np.random.default_rng([self.ctx.seed, round_, 0xFEDBE])
        info: dict[str, Any] = {}
        sampled: list[dict[str, np.ndarray]] = []
        if c.posterior == "gaussian":
            mean, variance = fit_diagonal_gaussian(states, num_samples, self._param_names)
            info["mean_std"] = float(np.mean([np.sqrt(v).mean() for v in variance.values()]))  # how far the clients spread
            for _ in range(c.sampled_models):
                sampled.append(build_sampled_state(template, sample_gaussian(mean, variance, rng, c.variance_scale)))
        else:
            gammas = []
            for _ in range(c.sampled_models):
                state, gamma = sample_dirichlet(states, num_samples, c.dirichlet_alpha, rng)
                sampled.append(build_sampled_state(template, state))
                gammas.append(gamma)
            if gammas:
                info["gamma_max_mean"] = float(np.mean([g.max() for g in gammas]))
        return sampled, info

    def aggregate(self, round_: int, states: list[dict[str, np.ndarray]], num_samples: list[int]) -> dict[str, np.ndarray]:
        c = self.config
        timing: dict[str, float] = {}
        started = time.perf_counter()
        average = self.average(round_, states, num_samples)  # w_bar, Eq. 2 ([server] aggregation)
        sampled, posterior_info = self._sample_states(round_, states, num_samples, average)
        timing["posterior"] = time.perf_counter() - started

        # Eq. 4 over {w_bar} u {w_i} u {w^(m)}: the pseudo-labels p_hat_j.
        mark = time.perf_counter()
        average_probs = self._probabilities_of(average, recompute_bn=False)  # (J, K)
        members: list[torch.Tensor] = [average_probs] if c.ensemble_weight_average else []
        client_accs = []
        if c.ensemble_clients:
            for state in states:
                probs = self._probabilities_of(state, recompute_bn=False)
                members.append(probs)
                client_accs.append(_accuracy(probs, self._labels))
        sample_accs = []
        for state in sampled:
            probs = self._probabilities_of(state, recompute_bn=True)
            members.append(probs)
            sample_accs.append(_accuracy(probs, self._labels))
        # Softmax outputs were averaged one model at a time: the mean of probabilities is Eq. 4.
        targets = torch.stack(members).mean(dim=0)  # (J, K)
        timing["ensemble"] = time.perf_counter() - mark

        mark = time.perf_counter()
        load_arrays_into(self._work, average)  # SWA(w_bar, T, eta_SWA) starts from the weight average
        generator = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + round_)
        with self.ctx.device_meter.training():
            result = distill_swa(self._work, self._images, targets.to(self.device), c, generator,
                                 progress=self.ctx.progress, desc=f"fedbe round {round_} distillation",
                                 server_step=self.ctx.server_step, trainer=self._distill_step)
        self._distill_step = self._distill_step or result.trainer
        timing["distill"] = time.perf_counter() - mark

        mark = time.perf_counter()
        if result.failed is None:
            new_state = state_dict_to_arrays(self._work)
        else:
            log.warning("round %d: %s; the global model is the weight average", round_, result.failed)
            new_state = average
        # Accuracies: on the validation split when there is one, else on the unlabeled set itself
        # (the distilled model saw those images, with pseudo-labels, so its figure there is optimistic).
        if self._val_images is not None:
            eval_labels = self._val_labels
            average_acc = _accuracy(predict_probabilities(_loaded(self._work, average), self._val_images, c.eval_batch_size), eval_labels)
            distilled_acc = _accuracy(predict_probabilities(_loaded(self._work, new_state), self._val_images, c.eval_batch_size), eval_labels)
        else:
            average_acc = _accuracy(average_probs, self._labels)
            distilled_acc = _accuracy(predict_probabilities(_loaded(self._work, new_state), self._images, c.eval_batch_size), self._labels)
        timing["evaluate"] = time.perf_counter() - mark
        timing["total"] = time.perf_counter() - started

        train_flops, forward_flops = self._flops_per_sample()
        j = self._images.shape[0]
        forwards = j * (len(states) * c.ensemble_clients + 2 * len(sampled) + 2 + 1)  # ensemble, BN passes, w_bar, SWA BN, eval
        if self._val_images is not None:
            forwards += 2 * self._val_images.shape[0] - j
        batch = min(c.distill_batch_size, j)
        self._reports[round_] = {
            "posterior": c.posterior,
            "clients": len(states),
            "sampled_models": len(sampled),
            "ensemble_size": len(members),
            "unlabeled_samples": j,
            "distill_steps": result.steps,
            "distill_batch_size": batch,
            "swa_models": result.swa_models,
            "distill_loss": None if math.isnan(result.mean_loss) else result.mean_loss,
            "distill_failed": result.failed,
            "accuracy_set": "validation" if self._val_images is not None else "unlabeled",
            "weight_average_accuracy": average_acc,
            "distilled_accuracy": distilled_acc if result.failed is None else None,
            "pseudo_label_accuracy": _accuracy(targets, self._labels),  # the ensemble's, on the unlabeled set
            "client_accuracy_mean": _mean_or_none(client_accs),
            "sampled_accuracy_mean": _mean_or_none(sample_accs),
            **posterior_info,
            "server_flops": int(train_flops * batch * result.steps + forward_flops * forwards),
            "server_time_s": timing,
        }
        log.info("round %d: fedbe ensemble of %d, %d SWA models, weight average %s -> distilled %s (%s set), %.1f s",
                 round_, len(members), result.swa_models, _pct(average_acc), _pct(distilled_acc), self._reports[round_]["accuracy_set"], timing["total"])
        return new_state


def _loaded(model: nn.Module, state: Mapping[str, np.ndarray]) -> nn.Module:
    load_arrays_into(model, state)
    return model


def _mean_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# -- edgesplit local: this method's [fedbe] table --


# -- FedBE's server-side data and distillation (Algorithm 1's SWA): the server-held unlabeled
# (and validation) set, and the ensemble distilled into the global model.

# --------------------------------------------------------------------------- #
# The server's unlabeled (and validation) data
# --------------------------------------------------------------------------- #


def load_server_data(config: FedBEConfig, seed: int) -> tuple[ArrayDataset, ArrayDataset | None]:
    """(unlabeled set, validation set or None) of the server.

    ``train-holdout``: the training split minus ``take(train, agent_train_samples,
    agent_data_seed)``, which is exactly the seeded subset every agent of a local
    simulation takes before partitioning (``edge_agent.agent.load_agent_data``),
    so no agent trains on a held-out sample whatever the partition. Other splits:
    that whole split of ``unlabeled_dataset`` (e.g. another dataset's, or the
    training split when the agents' data live elsewhere).

    From that pool, a stratified seeded subset (``take``) of ``unlabeled_samples +
    validation_samples`` is drawn and ``validation_samples`` of it (again
    stratified) are set aside for the report; the rest is the unlabeled set.
    """
    c = config
    if c.unlabeled_split == "train-holdout":
        agent_seed = seed if c.agent_data_seed is None else c.agent_data_seed
        pool = train_holdout(c.unlabeled_dataset, c.agent_train_samples, agent_seed, c.unlabeled_root, c.unlabeled_download,
                             "fedbe: the agents take all {n} training samples (fedbe.agent_train_samples = {k})")
    else:
        pool = load_dataset(c.unlabeled_dataset, c.unlabeled_split, c.unlabeled_root, c.unlabeled_download)
    wanted = (c.unlabeled_samples or max(len(pool) - c.validation_samples, 0)) + c.validation_samples
    if wanted > len(pool) or wanted - c.validation_samples < 1:
        raise ValueError(f"fedbe: {c.unlabeled_split} of {c.unlabeled_dataset} holds {len(pool)} samples; "
                         f"asked for {c.unlabeled_samples} unlabeled + {c.validation_samples} validation")
    chosen = take(pool, wanted, seed) if wanted < len(pool) else pool
    if not c.validation_samples:
        return chosen, None
    validation = take(chosen, c.validation_samples, seed + 1)
    unlabeled = chosen.subset(~np.isin(chosen.sample_ids, validation.sample_ids))
    return unlabeled, validation


# --------------------------------------------------------------------------- #
# Distillation (Algorithm 1's SWA)
# --------------------------------------------------------------------------- #


@dataclass
class DistillResult:
    steps: int
    swa_models: int
    mean_loss: float  # over the last cycle's steps (NaN when it failed)
    failed: str | None = None  # why the distilled model was not used (the weight average is kept)
    trainer: Any = None  # the TrainStep that ran it (to reuse next round)


def distill_swa(
    model: nn.Module, images: torch.Tensor, targets: torch.Tensor, config: FedBEConfig,
    generator: torch.Generator, progress: bool = False, desc: str = "distil",
    snapshots: list[dict[str, np.ndarray]] | None = None, server_step: str = "auto", trainer: TrainStep | None = None,
) -> DistillResult:
    """Algorithm 1's ``SWA(w_bar, T, eta_SWA)``: SGD from the model's current weights on
    the soft cross-entropy to ``targets`` (``(N, K)`` on the model's device), cyclical lr,
    weights collected after every cycle past the warm-up; the model ends with their
    average and BN statistics recomputed on ``images``. Batches are drawn from a
    fresh permutation of the set each epoch (``generator`` on the CPU). ``snapshots``,
    when given, receives a copy of every collected state (for tests).

    Steps run through the shared training loop (``models/training.py``) with the server
    step (``server_step``, see ``cloud_server/server_step.py``); callbacks set the
    cyclical rate and collect the weights. The step losses stay on the device and are read
    when the weights are collected (a host copy anyway) and at the end. A non-finite
    loss fails the distillation at its first such step, with the models collected
    before it counted, as if it had stopped there. ``trainer``: a step of ``model`` to reuse
    (its compiled forward survives across rounds); it gets this call's fresh optimiser."""
    c = config
    n = images.shape[0]
    batch = min(c.distill_batch_size, n)
    optimizer = make_optimizer("sgd", model.parameters(), c.swa_lr_max, c.distill_momentum, c.distill_weight_decay, images.device)
    if trainer is None:
        trainer = TrainStep(model, optimizer, soft_cross_entropy, server_step, name="fedbe distillation")
    elif trainer.model is not model:
        raise ValueError("distill_swa: the trainer steps another model than the one to distil")
    else:
        trainer.use_optimizer(optimizer)
    swa = SwaAverage()
    losses = torch.zeros(c.distill_steps, dtype=torch.float32, device=images.device)  # (T,) step losses, on the device
    failures: list[DistillResult] = []

    def failure(upto: int) -> DistillResult | None:
        seen = losses[:upto].cpu()
        bad = (~torch.isfinite(seen)).nonzero()
        if not len(bad):
            return None
        first = int(bad[0, 0]) + 1
        return DistillResult(first, swa.count, float("nan"), failed=f"distillation loss became {float(seen[first - 1])} at step {first}",
                             trainer=trainer)

    def batches(_epoch: int):  # -> Iterator[Batch of images (B, C, H, W), targets (B, K)]: distill_steps of them
        order, position = torch.randperm(n, generator=generator), 0
        for _ in range(c.distill_steps):
            if position + batch > n:  # a new epoch: full batches only, every sample once per epoch
                order, position = torch.randperm(n, generator=generator), 0
            index = order[position : position + batch].to(images.device)
            position += batch
            yield Batch(images[index], (targets[index],))

    def cyclical_lr(loop: Trainer) -> None:
        lr = swa_learning_rate(loop.steps_done + 1, c.swa_warmup_steps, c.swa_cycle_steps, c.swa_lr_max, c.swa_lr_min)
        for group in optimizer.param_groups:
            group["lr"] = lr

    def collect(loop: Trainer) -> None:
        step = loop.steps_done
        losses[step - 1] = loop.out.loss
        if swa_collects_after(step, c.swa_warmup_steps, c.swa_cycle_steps):
            failed = failure(step)
            if failed is not None:
                failures.append(failed)
                loop.stop()
                return
            collected = state_dict_to_arrays(model)
            swa.add(collected)
            if snapshots is not None:
                snapshots.append(collected)

    model.train()
    loop = Trainer(trainer, desc=desc, progress=tqdm if progress else None)
    loop.add_callback("on_batch_start", cyclical_lr).add_callback("on_batch_end", collect)
    loop.run(1, batches, planned_steps=c.distill_steps)
    failed = failures[0] if failures else failure(c.distill_steps)
    if failed is not None:
        return failed
    load_arrays_into(model, swa.average())
    recompute_bn_statistics(model, images, c.eval_batch_size)
    return DistillResult(c.distill_steps, swa.count, float(losses[-c.swa_cycle_steps:].double().mean()), trainer=trainer)


def _accuracy(probabilities: torch.Tensor, labels: torch.Tensor | None) -> float | None:
    if labels is None or labels.numel() == 0:
        return None
    return float((probabilities.argmax(dim=1) == labels).float().mean())


from ..local_run import LocalRunOptions  # noqa: E402


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """FedAvg's local training; the server's unlabeled set is the training samples the agents do not
    take (they take a ``--train-samples`` subset seeded by ``--seed``, which is also the server's seed)."""
    from .fedavg import launcher_table as fedavg_table

    table = {**fedavg_table(options), "unlabeled_dataset": options.dataset, "agent_train_samples": options.train_samples}
    if options.data_root:
        table["unlabeled_root"] = options.data_root
    return table
