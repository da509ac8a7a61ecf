"""One generic local trainer for every method.

The trainer knows nothing about the method: a method passes a ``loss_fn`` that
maps (model output, labels, sample ids) to a scalar loss, and optionally a
``forward`` that maps (model, images) to that output when the loss needs more
than ``model(images)`` (a teacher's logits on the same batch, the features
before the classifier); the trainer runs the epochs, shows progress and counts
samples. FLOPs are measured by the
caller on one representative step (counting every step is far too slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

LossFn = Callable[[object, torch.Tensor, torch.Tensor], torch.Tensor]
Forward = Callable[[nn.Module, torch.Tensor], object]  # (model, images (B, C, H, W)) -> what loss_fn takes


class NonFiniteLossError(RuntimeError):
    """Training diverged: the loss became NaN or infinite."""


@dataclass
class TrainResult:
    samples: int
    steps: int
    mean_loss: float


def _progress(iterable: Iterable, enabled: bool, desc: str, total: int | None) -> Iterable:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def train_epochs(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    epochs: int,
    device: torch.device | str = "cpu",
    progress: bool = False,
    desc: str = "train",
    forward: Forward | None = None,
) -> TrainResult:
    model.train()
    samples = steps = 0
    total_loss = 0.0
    for epoch in range(epochs):
        batches = _progress(loader, progress, f"{desc} epoch {epoch + 1}/{epochs}", len(loader))
        for images, labels, sample_ids in batches:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            output = model(images) if forward is None else forward(model, images)
            loss = loss_fn(output, labels, sample_ids)
            if not math.isfinite(loss.item()):
                raise NonFiniteLossError(f"{desc}: loss is {loss.item()} at step {steps}")
            loss.backward()
            optimizer.step()
            samples += int(labels.shape[0])
            steps += 1
            total_loss += float(loss.item()) * int(labels.shape[0])
    return TrainResult(samples, steps, total_loss / samples if samples else float("nan"))


@torch.no_grad()
def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], loader: torch.utils.data.DataLoader, device: torch.device | str = "cpu") -> tuple[int, int]:
    """(correct, total) of ``predict(images) -> logits`` over ``loader``."""
    correct = total = 0
    for images, labels, _ in loader:
        logits = predict(images.to(device))
        correct += int((logits.argmax(dim=1).cpu() == labels).sum())
        total += int(labels.shape[0])
    return correct, total


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, amsgrad=True)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")
