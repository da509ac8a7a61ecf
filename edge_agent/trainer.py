"""The edge's local training: the shared loop (:mod:`models.training`) over a loader.

A method passes a ``loss_fn`` that maps (model output, labels, sample ids) to a
scalar loss, and optionally a ``forward`` that maps (model, images) to that output
when the loss needs more than ``model(images)`` (a teacher's logits on the same
batch, the features before the classifier); the loop runs the epochs, shows
progress, counts samples and refuses a non-finite loss before it updates the model.
FLOPs are measured by the caller on one representative step (counting every step
is far too slow).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from models.training import Batch, Forward, LossFn, Step, Trainer, TrainResult

__all__ = ["Forward", "LossFn", "TrainResult", "train_epochs"]


def _model_output(model: nn.Module, images: torch.Tensor) -> object:
    return model(images)  # the whole output: a method's loss unpacks what it needs


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
    micro_batch: int | None = None,
    frozen: nn.Module | None = None,
) -> TrainResult:
    """``epochs`` epochs over ``loader``'s (images, labels, sample ids); the sample ids stay
    on the host (they key the teacher's logits) and reach ``loss_fn`` as its third argument.
    ``micro_batch``: at most this many samples per forward pass, gradients accumulated
    into one step per batch (``[memory] micro_batch_samples``; see :class:`models.train_step.Step`).
    ``frozen``: a part of ``model`` kept in eval mode (BatchNorm uses and keeps its running statistics)."""
    model.train()
    if frozen is not None:
        frozen.eval()
    step = Step(model, optimizer, loss_fn, forward=forward or _model_output, name=desc, micro_batch=micro_batch)

    def batches(epoch: int):  # -> Iterator[Batch]
        for images, labels, sample_ids in loader:
            yield Batch(images.to(device), (labels.to(device), sample_ids))

    planned = len(loader) * epochs
    return Trainer(step, desc=desc, progress=tqdm if progress else None, check_finite="step").run(epochs, batches, planned_steps=planned)
