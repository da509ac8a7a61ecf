"""FedBE's server-side data and distillation (Algorithm 1's SWA): the server-held
unlabeled (and validation) set, and the ensemble distilled into the global model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from fldata import ArrayDataset, load_dataset, take
from models.losses import soft_cross_entropy
from models import load_arrays_into, state_dict_to_arrays
from models.swa import SwaAverage, recompute_bn_statistics, swa_collects_after, swa_learning_rate
from models.training import Batch, Trainer, make_optimizer

from ..server_step import TrainStep

if TYPE_CHECKING:
    from .fedbe import FedBEConfig

log = logging.getLogger("cloud_server.fedbe")

__all__ = ["DistillResult", "distill_swa", "load_server_data", "train_holdout"]


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


def train_holdout(dataset: str, agent_train_samples: int, agent_seed: int, root: str | None, download: bool,
                  too_many: str) -> ArrayDataset:
    """The training split of ``dataset`` less ``take(train, agent_train_samples, agent_seed)``,
    the seeded subset every agent of a local simulation takes before partitioning
    (``edge_agent.agent.load_agent_data``): no agent trains on a sample of it, whatever the
    partition. ``too_many`` (with ``{n}``, ``{k}``) says why nothing is left when the agents take all."""
    train = load_dataset(dataset, "train", root, download)
    if agent_train_samples >= len(train):
        raise ValueError(too_many.format(n=len(train), k=agent_train_samples) + "; nothing is left to hold out")
    agents = take(train, agent_train_samples, agent_seed)
    return train.subset(~np.isin(train.sample_ids, agents.sample_ids))


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
