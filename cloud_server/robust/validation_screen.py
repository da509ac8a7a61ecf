"""The server's validation set at work (cloud_server/robust/validation.py): it loads the
labelled images and judges the weight-sharing methods' updates by the validation loss of the
global model plus each update (Zeno's score, Xie et al. 2019).

Cost: a forward pass over the set of the global model and, per screened update, of the global
model plus the update and plus its share (1 / K): (2K + 1) x ``validation_samples`` forward
passes of the shared model each round (recorded in the round's ``robustness.update_validation``),
and the images in memory.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fldata import ArrayDataset
from fldata import train_holdout
from fldata.datasets import load_dataset, take
from models import load_arrays_into, state_dict_to_arrays

from ..server_step import normalised_images
from .validation import VALIDATION_MIN_AGENTS, DefenceConfig, implausible_validation

log = logging.getLogger("cloud_server.robust")

__all__ = ["ValidationScreen", "load_validation_set"]

Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, images (B, C, H, W)) -> logits (B, K)
Refusals = dict[str, tuple[str, str]]


def load_validation_set(cfg: DefenceConfig) -> ArrayDataset:
    """The ``validation_samples`` labelled images (stratified, seeded by ``cfg.seed``) of
    ``validation_split``: disjoint from the global test set (never the test split) and, with
    "train-holdout", from every agent's training data."""
    if cfg.validation_split == "train-holdout":
        agent_seed = cfg.seed if cfg.validation_agent_data_seed is None else cfg.validation_agent_data_seed
        pool = train_holdout(cfg.validation_dataset, cfg.validation_agent_train_samples, agent_seed, cfg.validation_root,
                             cfg.validation_download, "server.validation_split = \"train-holdout\": the agents take all {n} "
                             "training samples (validation_agent_train_samples = {k})")
    else:
        pool = load_dataset(cfg.validation_dataset, cfg.validation_split, cfg.validation_root, cfg.validation_download)
    if cfg.validation_samples > len(pool):
        raise ValueError(f"server.validation_samples = {cfg.validation_samples}, but {cfg.validation_split} of "
                         f"{cfg.validation_dataset} holds {len(pool)} samples the agents do not train on")
    return take(pool, cfg.validation_samples, cfg.seed)


class ValidationScreen:
    """The validation set on the server's CPU and the check of weight updates against it."""

    BATCH_SAMPLES = 256

    def __init__(self, cfg: DefenceConfig, data: ArrayDataset | None = None) -> None:
        data = data if data is not None else load_validation_set(cfg)
        self._set(cfg, normalised_images(data), torch.as_tensor(np.asarray(data.labels), dtype=torch.long))

    @classmethod
    def from_tensors(cls, cfg: DefenceConfig, images: torch.Tensor, labels: torch.Tensor) -> "ValidationScreen":
        """A screen over images already normalised as the agents' loaders do (tests, benches)."""
        screen = cls.__new__(cls)
        screen._set(cfg, images, labels.long())
        return screen

    def _set(self, cfg: DefenceConfig, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.cfg = cfg
        self.images = images  # (V, C, H, W), float32 on the host
        self.labels = labels  # (V,)
        self.samples = len(labels)
        self._scratch: nn.Module | None = None  # a copy of the method's model, candidates are loaded into it

    def loss(self, model: nn.Module, forward: Forward) -> float:
        """The mean cross-entropy of ``model`` (eval mode: BatchNorm's running statistics, as
        the model is deployed) on the set; NaN when its logits are not finite."""
        model.eval()
        total = 0.0
        with torch.no_grad():
            for images, labels in zip(self.images.split(self.BATCH_SAMPLES), self.labels.split(self.BATCH_SAMPLES)):
                logits = forward(model, images).float()  # (B, K)
                total += float(F.cross_entropy(logits, labels, reduction="sum"))
        return total / max(self.samples, 1) if math.isfinite(total) else math.nan

    def judge_states(self, round_: int, ledger: Any, model: nn.Module, forward: Forward,
                     global_state: Mapping[str, np.ndarray],
                     candidate: Callable[[str], Mapping[str, np.ndarray]]) -> Callable[[list[str]], Refusals]:
        """The ``judge`` of :func:`cloud_server.robust.screen_uploads`: for the agents it is given,
        the validation loss of the global model and of ``candidate(agent)`` (the global model plus
        that agent's update; names ``model`` does not hold in it keep the global model's), recorded
        as the round's ``robustness.update_validation``; the refusals of :func:`implausible_validation`.
        ``model`` is copied once (the method's own model is never touched)."""
        if self._scratch is None:
            self._scratch = copy.deepcopy(model).cpu()
        scratch = self._scratch
        template = state_dict_to_arrays(scratch)

        def loss_of(state: Mapping[str, np.ndarray]) -> float:
            arrays = {**template, **global_state, **state}
            if not all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f"):
                return math.nan
            load_arrays_into(scratch, arrays)
            return self.loss(scratch, forward)

        def share(state: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
            """The global model plus 1 / n of the update (integer counters: the global model's)."""
            return {k: (g + (np.asarray(state[k], np.float64) - g) / n).astype(g.dtype) if g.dtype.kind == "f" else g
                    for k, g in global_state.items() if k in state}

        def judge(agents: list[str]) -> Refusals:
            if not agents:
                return {}
            base = loss_of(global_state)
            rises = {a: loss_of(candidate(a)) - base for a in agents}
            shares = {a: loss_of(share(candidate(a), len(agents))) - base for a in agents}
            judged = rises if self.cfg.validation_step == "update" else shares
            refusals = implausible_validation(judged, self.cfg.validation_loss_margin, self.cfg.plausible_mad, base)
            if len(judged) >= VALIDATION_MIN_AGENTS:  # fewer have no yardstick (implausible_validation)
                ledger.examined(round_, "implausible_validation", judged)
            ledger.record(round_, "update_validation", {
                "samples": self.samples, "global_loss": _json(base), "step": self.cfg.validation_step,
                "margin": self.cfg.validation_loss_margin, "forward_passes": (2 * len(agents) + 1) * self.samples,
                "agents": {a: _json(r) for a, r in sorted(rises.items())},
                "agents_share": {a: _json(r) for a, r in sorted(shares.items())}})
            return refusals

        return judge


def _json(value: float) -> float | None:
    """Strict JSON: a non-finite figure is written as null."""
    return round(value, 6) if math.isfinite(value) else None
