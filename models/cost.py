"""Parameter and FLOP counting.

FLOPs are counted with :class:`torch.utils.flop_counter.FlopCounterMode`, which
reports 2 FLOPs per multiply-accumulate and counts matmuls and convolutions
(forward and backward) but not element-wise ops such as BatchNorm, ReLU or the
loss. That is the convention of the FedGKT paper's figures and of every run
report in this project, so numbers are comparable across methods and machines.

The counter dispatches every op through Python and is much slower than plain
execution: measure one representative step and multiply, rather than wrapping
a whole epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Callable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "LossKind",
    "count_parameters",
    "flops_of",
    "forward_flops_per_sample",
    "training_flops_per_sample",
]

#: ``"ce"``: cross-entropy against random labels (classifiers);
#: ``"sum"``: sum of the output (any model; the backward pass is the same).
LossKind = Literal["ce", "sum"]

# Fixed seed for the dummy batch: FLOPs do not depend on values, but a fixed
# seed keeps the measurement free of side effects on the global RNG.
_DUMMY_SEED = 0


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (buffers such as BN running stats excluded)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def flops_of(fn: Callable[[], object]) -> int:
    """Total FLOPs (2 x MACs) of running ``fn()`` once, forward and backward.

    ``fn`` runs for real, so a training step measured this way also updates the
    model; wrap one real step of the local trainer to report what it cost. A
    ``loss.backward()`` inside ``fn`` is counted too.
    """
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


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


def forward_flops_per_sample(model: nn.Module, input_shape: Sequence[int] = (3, 32, 32), batch_size: int = 2) -> int:
    """Inference FLOPs per sample: one forward pass in eval mode without autograd.

    ``input_shape`` is one sample's shape, e.g. ``(3, 32, 32)`` for an image
    model or ``(16, 32, 32)`` for a server model. The model is not modified.
    """
    x = _dummy_batch(input_shape, batch_size, model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total = flops_of(lambda: model(x))
    finally:
        model.train(was_training)
    return total // batch_size


def training_flops_per_sample(
    model: nn.Module,
    input_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    loss: LossKind = "ce",
) -> int:
    """Training FLOPs per sample: forward + loss + backward, in train mode.

    Measured on a deep copy, so the caller's weights, gradients and BatchNorm
    statistics are untouched. The optimiser update is not included (it is
    element-wise, hence not counted by ``FlopCounterMode`` anyway). Conv and
    matmul FLOPs scale linearly with the batch, so a small batch (>= 2, so
    BatchNorm has statistics to compute) gives the same per-sample figure as
    the real one.

    For a model returning a tuple (``ResNet8Edge``), the loss is taken on the
    first element, the logits.
    """
    if loss not in ("ce", "sum"):
        raise ValueError(f"loss must be 'ce' or 'sum', got {loss!r}")
    x = _dummy_batch(input_shape, batch_size, model)
    probe = copy.deepcopy(model).train()
    generator = torch.Generator().manual_seed(_DUMMY_SEED)

    def step() -> None:
        logits = _logits_of(probe(x))  # (B, num_classes)
        if loss == "ce":
            labels = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=generator).to(logits.device)
            objective = F.cross_entropy(logits, labels)
        else:
            objective = logits.sum()
        objective.backward()

    return flops_of(step) // batch_size
