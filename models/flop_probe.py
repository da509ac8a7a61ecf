"""What both FLOP counters measure: a seeded dummy batch on the model's device, the
objective a training count differentiates, the logits of a model's output, and
the :class:`FlopsPerSample` they report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

#: ``"ce"``: cross-entropy against random labels (classifiers);
#: ``"sum"``: sum of the output (any model; the backward pass is the same).
LossKind = Literal["ce", "sum"]

# Fixed seed for the dummy batch: FLOPs do not depend on values, but a fixed
# seed keeps the measurement free of side effects on the global RNG.
_DUMMY_SEED = 0


def _logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or the first element of a tuple.

    ``ResNet8Edge`` returns ``(logits, features)``; the convention here is that
    a tuple-returning model puts its logits first.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"model output must be a tensor or a tuple starting with the logits, got {type(output).__name__}")


def _dummy_batch(input_shape: Sequence[int], batch_size: int, model: nn.Module) -> torch.Tensor:
    """A random batch on the model's device and dtype (CPU float32 for a parameterless model)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(input_shape) == 0 or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"input_shape must be a non-empty per-sample shape such as (C, H, W), got {tuple(input_shape)}")
    reference = next(model.parameters(), torch.empty(0))
    generator = torch.Generator().manual_seed(_DUMMY_SEED)
    x = torch.randn((batch_size, *(int(d) for d in input_shape)), generator=generator)  # (B, C, H, W)
    return x.to(device=reference.device, dtype=reference.dtype)


@dataclass(frozen=True)
class FlopsPerSample:
    """Per-sample FLOPs of one model at one input shape.

    Attributes:
        training: Forward + loss + backward in train mode (what
            :func:`training_flops_per_sample` returns).
        forward: One forward pass in eval mode without autograd (what
            :func:`forward_flops_per_sample` returns).
    """

    training: int
    forward: int


class NotLayerCountableError(ValueError):
    """:func:`layer_flops_per_sample` cannot vouch for its count on this model.

    Raised for a layer it has no formula for that may do matmul / convolution
    work, or a forward that calls such an op outside a counted layer. The
    message names the module or function; count with ``FlopCounterMode``
    instead (:func:`flops_per_sample` does so by itself).
    """


def _objective(logits: torch.Tensor, loss: LossKind) -> torch.Tensor:
    """The scalar the training count differentiates (the loss itself costs no counted FLOPs)."""
    if loss == "ce":
        generator = torch.Generator().manual_seed(_DUMMY_SEED)
        labels = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=generator).to(logits.device)
        return F.cross_entropy(logits, labels)
    return logits.sum()


def _check_loss(loss: object) -> None:
    if loss not in ("ce", "sum"):
        raise ValueError(f"loss must be 'ce' or 'sum', got {loss!r}")
