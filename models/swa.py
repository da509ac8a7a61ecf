"""Stochastic weight averaging (Izmailov et al. 2018) and the BatchNorm passes it needs.

Generic pieces of an SWA run -- the cyclical learning rate, when weights are
collected, their running average, BatchNorm statistics recomputed for the
averaged weights -- for any method that distils or fine-tunes with SWA (FedBE's
server, ``cloud_server/methods/fedbe.py``). States are name -> numpy array, as
:func:`models.weights.state_dict_to_arrays` gives them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .training import logits_of

__all__ = ["SwaAverage", "SwaError", "predict_probabilities", "recompute_bn_statistics", "swa_collects_after", "swa_learning_rate"]


class SwaError(ValueError):
    """Collected states that cannot be averaged (other entries or shapes than the first), or none."""


def swa_learning_rate(step: int, warmup_steps: int, cycle_steps: int, lr_max: float, lr_min: float) -> float:
    """Learning rate of distillation step ``step`` (1-based).

    ``lr_max`` during the warm-up, then Izmailov et al.'s cyclical schedule (their
    Eq. 2): in each cycle of ``cycle_steps`` steps it falls linearly from just
    below ``lr_max`` to ``lr_min``, reached at the cycle's last step, and jumps back.
    """
    if step <= warmup_steps:
        return lr_max
    t = ((step - warmup_steps - 1) % cycle_steps + 1) / cycle_steps  # in (0, 1]
    return (1.0 - t) * lr_max + t * lr_min


def swa_collects_after(step: int, warmup_steps: int, cycle_steps: int) -> bool:
    """SWA takes the weights after ``step`` (1-based): the end of every cycle after the warm-up."""
    return step > warmup_steps and (step - warmup_steps) % cycle_steps == 0


class SwaAverage:
    """The running mean of collected states (SWA: ``w_swa <- (n w_swa + w) / (n + 1)``),
    so only one extra copy is held however many models are collected.
    Floats keep their dtype; integer entries are rounded (as a weighted mean of states does)."""

    def __init__(self) -> None:
        self.count = 0
        self._mean: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}

    def add(self, state: Mapping[str, np.ndarray]) -> None:
        if self.count and set(state) != set(self._mean):
            raise SwaError(f"SWA: collected state has other entries than the first "
                                   f"(missing {sorted(set(self._mean) - set(state))[:5]}, extra {sorted(set(state) - set(self._mean))[:5]})")
        self.count += 1
        for name, array in state.items():
            value = np.asarray(array, dtype=np.float64)
            if self.count == 1:
                self._mean[name] = value.copy()
                self._dtypes[name] = np.asarray(array).dtype
            else:
                if value.shape != self._mean[name].shape:
                    raise SwaError(f"SWA: {name!r} has shape {value.shape}, first collected {self._mean[name].shape}")
                self._mean[name] += (value - self._mean[name]) / self.count

    def average(self) -> dict[str, np.ndarray]:
        if not self.count:
            raise SwaError("SWA collected no model")
        return {n: (np.rint(m) if self._dtypes[n].kind in "iu" else m).astype(self._dtypes[n]) for n, m in self._mean.items()}


@torch.no_grad()
def recompute_bn_statistics(model: nn.Module, images: torch.Tensor, batch_size: int) -> None:
    """BatchNorm running mean/var as the plain average over the batches of ``images``
    (``torch.optim.swa_utils.update_bn``: statistics reset, ``momentum=None``, train mode)."""
    batches = [images[i : i + batch_size] for i in range(0, images.shape[0], batch_size)]  # (B, C, H, W) each
    torch.optim.swa_utils.update_bn(batches, model)


@torch.no_grad()
def predict_probabilities(model: nn.Module, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Softmax outputs in eval mode, ``(N, K)`` on the CPU."""
    model.eval()
    out = [F.softmax(logits_of(model(images[i : i + batch_size])).float(), dim=-1).cpu() for i in range(0, images.shape[0], batch_size)]
    return torch.cat(out)
