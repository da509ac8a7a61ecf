"""One training loop for both sides of a run, and one optimiser factory.

The loop (:class:`Trainer`) knows nothing about the model or the method, in the
shape of minGPT's trainer. A caller gives it

* a step: :class:`Step` (a forward hook, a loss hook, backward, one optimiser
  step, run eagerly), or any subclass -- the server's
  ``cloud_server.server_step.TrainStep`` is one, adding ``torch.compile`` and CUDA
  graphs -- so the edge's CPU loop and the server's GPU loop are the same loop;
* the batches of each epoch as :class:`Batch` (inputs and targets, plus whatever the
  callbacks need to know about the rows in ``meta``);
* callbacks for what it does besides training: ``on_batch_start`` (e.g. a learning
  rate schedule), ``on_batch_end`` (collecting logits by sample, SWA snapshots,
  logging), ``on_epoch_end``. A callback may call :meth:`Trainer.stop`. A ``guard``
  (loss -> None) may raise :class:`StepSkipped` after the forward pass: the step is not
  taken and ``on_batch_skipped`` fires (a server that must not be blown up by one batch).

Losses are summed on the step's device and read once at the end, so a GPU step
never waits for the host. ``check_finite="step"`` reads each loss before its
update instead and refuses a non-finite one (:class:`NonFiniteLossError`) without
touching the model: on a CPU the read costs nothing, and a diverged agent must not
upload garbage.

:func:`make_optimizer` is the one optimiser factory of the project (the edge's
torch methods and every server loop); the torch-free ort backend mirrors its two
update rules in numpy (``edge_agent/backends/optim.py``).

This module holds the loop; the step is :mod:`models.train_step` and the optimiser
factory :mod:`models.optimizers`, whose names it re-exports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from models.optimizers import LR_SCHEDULES, OPTIMIZERS, LeanAdam, LeanSGD, make_lr_schedule, make_optimizer
from models.train_step import (
    DeviceSum,
    Forward,
    LossFn,
    Step,
    StepOutput,
    ghost_batch_momentum,
    logits_of,
    micro_batch_slices,
)

__all__ = [
    "LR_SCHEDULES", "OPTIMIZERS", "Batch", "DeviceSum", "Forward", "LeanAdam", "LeanSGD", "LossFn", "NonFiniteLossError", "Step", "StepOutput", "StepSkipped",
    "TrainResult", "Trainer", "accuracy", "ghost_batch_momentum", "logits_of", "make_lr_schedule", "make_optimizer",
    "micro_batch_slices",
]


class NonFiniteLossError(RuntimeError):
    """Training diverged: the loss became NaN or infinite."""


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, ...) on the step's device
    targets: tuple[Any, ...]  # what the loss takes after the forward's output, e.g. labels (B,)
    meta: Any = None  # the caller's own record of the batch (which rows, which agent), for callbacks

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])


@dataclass
class TrainResult:
    samples: int
    steps: int
    mean_loss: float  # over every step, weighted by batch size (NaN without steps)
    last_epoch_loss: float  # the same over the last epoch's steps only
    last_epoch_samples: int


Callback = Callable[["Trainer"], None]


class ProgressBar(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


#: Makes a progress bar, called as ``progress(total=..., desc=..., leave=False, dynamic_ncols=True)``:
#: ``tqdm.auto.tqdm`` fits. The caller passes it, so this package depends on torch and numpy only.
ProgressFactory = Callable[..., ProgressBar]
EVENTS = ("on_batch_start", "on_batch_end", "on_batch_skipped", "on_epoch_end")


class StepSkipped(Exception):
    """Raised by a trainer's ``guard`` (after the forward pass, before backward) to skip a
    step whose loss it does not trust: the model's parameters are left as they were, the
    batch's loss is not counted, ``on_batch_skipped`` fires and the loop goes on."""
FINITE_CHECKS = ("none", "step")


class Trainer:
    """Epochs of batches through a step, with callbacks; see the module doc.

    While :meth:`run` runs, callbacks read ``epoch`` (0-based), ``last_epoch``,
    ``steps_done`` (steps finished), ``batch`` and, after the step, ``out``.
    """

    def __init__(self, step: Step, *, desc: str = "train", progress: ProgressFactory | None = None,
                 check_finite: str = "none", guard: Callable[[torch.Tensor], None] | None = None) -> None:
        if check_finite not in FINITE_CHECKS:
            raise ValueError(f"check_finite must be one of {FINITE_CHECKS}, got {check_finite!r}")
        self.step = step
        self.desc = desc
        self.progress = progress
        self.check_finite = check_finite
        self.guard = guard  # guard(loss) may raise StepSkipped (runs every step eagerly)
        self.skipped = 0
        self.skip_reason = ""
        self.callbacks: dict[str, list[Callback]] = {event: [] for event in EVENTS}
        self.epoch = 0
        self.last_epoch = False
        self.steps_done = 0
        self.batch: Batch | None = None
        self.out: StepOutput | None = None
        self._stop = False

    def add_callback(self, event: str, callback: Callback) -> "Trainer":
        if event not in self.callbacks:
            raise ValueError(f"unknown trainer event {event!r}; the events are {EVENTS}")
        self.callbacks[event].append(callback)
        return self

    def stop(self) -> None:
        """End the run after the current batch (a callback's way to stop early)."""
        self._stop = True

    def _fire(self, event: str) -> None:
        for callback in self.callbacks[event]:
            callback(self)

    def _refuse_non_finite(self, loss: torch.Tensor) -> None:
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLossError(f"{self.desc}: loss is {value} at step {self.steps_done}")

    def run(self, epochs: int, batches: Callable[[int], Iterable[Batch]], planned_steps: int | None = None) -> TrainResult:
        """``epochs`` epochs over ``batches(epoch)``; ``planned_steps`` (if known) sizes the
        progress bar and lets the step choose how to run (see ``TrainStep.session``)."""
        device = self.step.device
        total, last = DeviceSum(device), DeviceSum(device)
        samples = last_samples = 0
        self.steps_done, self._stop = 0, False
        check = self._refuse_non_finite if self.check_finite == "step" else None
        if self.guard is not None:
            guard, finite = self.guard, check

            def check(loss: torch.Tensor) -> None:
                if finite is not None:
                    finite(loss)
                guard(loss)
        self.skipped = 0
        bar = None
        if self.progress is not None:
            bar = self.progress(total=planned_steps, desc=self.desc, leave=False, dynamic_ncols=True)
        try:
            with self.step.session(planned_steps=planned_steps):
                for epoch in range(epochs):
                    self.epoch, self.last_epoch = epoch, epoch == epochs - 1
                    for batch in batches(epoch):
                        self.batch = batch
                        self._fire("on_batch_start")
                        try:
                            self.out = self.step(batch.inputs, *batch.targets, check=check)
                        except StepSkipped as exc:
                            self.skipped += 1
                            self.skip_reason = str(exc)
                            self._fire("on_batch_skipped")
                            if bar is not None:
                                bar.update(1)
                            continue
                        n = batch.size
                        total.add(self.out.loss, n)
                        samples += n
                        if self.last_epoch:
                            last.add(self.out.loss, n)
                            last_samples += n
                        self.steps_done += 1
                        self._fire("on_batch_end")
                        if bar is not None:
                            bar.update(1)
                        if self._stop:
                            break
                    self._fire("on_epoch_end")
                    if self._stop:
                        break
                # The call's one wait for the device.
                mean = total.item() / samples if samples else float("nan")
                last_mean = last.item() / last_samples if last_samples else float("nan")
        finally:
            if bar is not None:
                bar.close()
        return TrainResult(samples, self.steps_done, mean, last_mean, last_samples)


#: Images per forward pass when a model only scores (no gradients). On a CPU a ResNet's activations
#: for a batch this small stay in cache; batches of hundreds spill and score slower per image, which
#: the evaluation of every round pays.
INFERENCE_BATCH_SAMPLES = 64


@torch.no_grad()
def accuracy_and_loss(predict: Callable[[torch.Tensor], torch.Tensor],
                      batches: Iterable[tuple[torch.Tensor, torch.Tensor, Any]],
                      device: torch.device | str = "cpu") -> tuple[int, int, float]:
    """(correct, total, summed cross-entropy) of ``predict(images) -> logits`` over ``(images, labels, ids)`` batches."""
    correct = total = 0
    loss_sum = 0.0
    for images, labels, _ in batches:
        logits = predict(images.to(device))  # (B, K)
        correct += int((logits.argmax(dim=1).cpu() == labels).sum())
        total += int(labels.shape[0])
        loss_sum += float(torch.nn.functional.cross_entropy(logits.float().cpu(), labels, reduction="sum"))
    return correct, total, loss_sum


def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor, Any]],
             device: torch.device | str = "cpu") -> tuple[int, int]:
    """(correct, total) of ``predict(images) -> logits`` over ``(images, labels, ids)`` batches."""
    correct = total = 0
    for images, labels, _ in batches:
        logits = predict(images.to(device))  # (B, K)
        correct += int((logits.argmax(dim=1).cpu() == labels).sum())
        total += int(labels.shape[0])
    return correct, total
