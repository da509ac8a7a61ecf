"""The edge's local training: the shared loop (:mod:`models.training`) over a loader.

A method passes a ``loss_fn`` that maps (model output, labels, sample ids) to a
scalar loss, and optionally a ``forward`` that maps (model, images) to that output
when the loss needs more than ``model(images)`` (a teacher's logits on the same
batch, the features before the classifier); the loop runs the epochs, shows
progress, refuses a non-finite loss before it updates the model, and meters the
round: every step's samples and FLOPs go to the round's :class:`RoundMeter` and its
time to the compute phase.

What a step costs is what the method declares it trains (:class:`Trains`): the
models that take forward and backward, the ones that only run forward on the same
batch (teachers), and any work outside a model; each model's per-sample figures
come from the one shared count (:func:`models.cost.cached_flops_per_sample`),
counted once per architecture rather than on every step (far too slow). A method
that declares nothing is metered for the model it trains.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from models.cost import LossKind, cached_flops_per_sample, cached_forward_flops_per_sample
from models.training import Batch, Forward, LossFn, Step, Trainer, TrainResult

from .costs import RoundMeter, SampleFlops

__all__ = ["Forward", "LossFn", "MeterSteps", "Trains", "TrainResult", "train_epochs"]


@dataclass(frozen=True)
class Trains:
    """What one training step does per sample, as a method declares it: ``models`` take
    forward and backward, ``teachers`` only forward on the same batch (no gradient), and
    ``extra_flops_per_sample`` is counted work outside any model (FedDistill's passes of one
    model's features through the other's head)."""

    models: tuple[SampleFlops, ...]
    teachers: tuple[int, ...] = ()  # each teacher's forward FLOPs per sample
    extra_flops_per_sample: int = 0

    @classmethod
    def of(cls, models: Iterable[nn.Module], input_shape: Sequence[int], teachers: Iterable[nn.Module] = (),
           loss: LossKind = "ce", extra_flops_per_sample: int = 0) -> "Trains":
        """The declaration for these modules at one sample's ``input_shape`` (C, H, W), their
        figures from the shared count. ``loss="sum"``: a model whose output has no loss of
        its own (split learning's extractor: its gradient comes from the server)."""
        return cls(
            models=tuple(cached_flops_per_sample(m, input_shape, loss) for m in models),
            teachers=tuple(cached_forward_flops_per_sample(t, input_shape) for t in teachers),
            extra_flops_per_sample=extra_flops_per_sample,
        )

    @property
    def flops_per_sample(self) -> int:
        return sum(m.training for m in self.models) + sum(self.teachers) + self.extra_flops_per_sample


class MeterSteps:
    """The trainer callback (``on_batch_end``) that meters every step taken: its samples and
    their FLOPs (``trains``; None: ``model`` alone, counted at the first batch's shape)."""

    def __init__(self, meter: RoundMeter, model: nn.Module, trains: Trains | None = None) -> None:
        self.meter = meter
        self.model = model
        self.trains = trains

    def __call__(self, trainer: Trainer) -> None:
        batch = trainer.batch
        assert batch is not None  # set by the loop before on_batch_end
        if self.trains is None:
            self.trains = Trains.of((self.model,), tuple(batch.inputs.shape[1:]))
        self.meter.trained(batch.size, self.trains.flops_per_sample)


def _model_output(model: nn.Module, images: torch.Tensor) -> object:
    return model(images)  # the whole output: a method's loss unpacks what it needs


def train_epochs(
    model: nn.Module,
    loader: Iterable,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    epochs: int,
    *,
    meter: RoundMeter,
    trains: Trains | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    desc: str = "train",
    forward: Forward | None = None,
    micro_batch: int | None = None,
    frozen: nn.Module | None = None,
) -> TrainResult:
    """``epochs`` epochs over ``loader``'s (images, labels, sample ids); the sample ids stay
    on the host (they key the teacher's logits) and reach ``loss_fn`` as its third argument.
    ``meter``: the round's; the steps' samples, FLOPs (``trains``, see :class:`Trains`) and
    time (compute; an upload sent from ``loss_fn`` counts as its own phases) go there.
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

    planned = len(loader) * epochs if hasattr(loader, "__len__") else None
    trainer = Trainer(step, desc=desc, progress=tqdm if progress else None, check_finite="step")
    trainer.add_callback("on_batch_end", MeterSteps(meter, model, trains))
    with meter.phase("compute"):
        return trainer.run(epochs, batches, planned_steps=planned)
