"""Parameter and FLOP counting.

FLOPs are counted with :class:`torch.utils.flop_counter.FlopCounterMode`, which
reports 2 FLOPs per multiply-accumulate and counts matmuls and convolutions
(forward and backward) but not element-wise ops such as BatchNorm, ReLU or the
loss. That is the convention of the FedGKT paper's figures and of every run
report in this project, so numbers are comparable across methods and machines.

The counter dispatches every op through Python and is much slower than plain
execution: measure one representative step and multiply, rather than wrapping
a whole epoch.

Entering ``FlopCounterMode`` (any ``TorchDispatchMode``) also imports hundreds
more modules (sympy, ``torch._dynamo``, ``torch._subclasses``, ...) and keeps
tens of MiB more resident for the rest of the process (bench/results/step_memory.json,
``test_import_cost``): too much for an agent on a 512 MB board. (Not the only way in: torch 2.14's ``torch.optim`` optimisers
import ``torch._dynamo`` when built, via ``@torch._disable_dynamo`` on
``add_param_group``.) :func:`layer_flops_per_sample` therefore gives the same
numbers for models built from standard layers from forward hooks on their
Conv / Linear modules and FlopCounterMode's own formulas, without entering the
mode; :func:`flops_per_sample`, :func:`training_flops_per_sample` and
:func:`forward_flops_per_sample` use it whenever it applies and fall back to
``FlopCounterMode`` otherwise.

:func:`cached_flops_per_sample` is what the rest of the project reads: the same figures,
counted once per architecture, input shape and loss in one cache shared by every method
and both sides of a run (counting a ResNet-56 takes seconds, and simulated agents share
one process).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Callable

import torch.nn as nn

from models.flop_probe import FlopsPerSample, LossKind, NotLayerCountableError, _check_loss, _dummy_batch
from models.layer_flops import _check_countable, _layer_forward_total, _layer_training_total, layer_flops_per_sample
from models.reference_flops import _counter_forward_total, _counter_training_total, flops_of

__all__ = [
    "FlopsPerSample",
    "LossKind",
    "NotLayerCountableError",
    "architecture_key",
    "cached_flops_per_sample",
    "cached_forward_flops_per_sample",
    "clear_flops_cache",
    "count_parameters",
    "flops_of",
    "flops_per_sample",
    "forward_flops_per_sample",
    "layer_flops_per_sample",
    "training_flops_per_sample",
]

log = logging.getLogger(__name__)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (buffers such as BN running stats excluded)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _light_or_none(count: Callable[[], int], model: nn.Module) -> int | None:
    """``count()`` by the light counter, or None (logged) where it refuses the model."""
    try:
        _check_countable(model)
        return count()
    except NotLayerCountableError as exc:
        log.info("counting FLOPs of %s with FlopCounterMode: %s", type(model).__name__, exc)
        return None


# --- what callers use ------------------------------------------------------------


def flops_per_sample(
    model: nn.Module,
    input_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    loss: LossKind = "ce",
) -> FlopsPerSample:
    """Training and forward FLOPs per sample in one call: what an agent reports.

    :func:`layer_flops_per_sample` when it can count ``model`` (every model in
    the registry), ``FlopCounterMode`` otherwise; the numbers are the same as
    :func:`training_flops_per_sample` and :func:`forward_flops_per_sample`.
    """
    try:
        return layer_flops_per_sample(model, input_shape, batch_size, loss)
    except NotLayerCountableError as exc:
        log.info("counting FLOPs of %s with FlopCounterMode: %s", type(model).__name__, exc)
    return FlopsPerSample(
        training=training_flops_per_sample(model, input_shape, batch_size, loss, light=False),
        forward=forward_flops_per_sample(model, input_shape, batch_size, light=False),
    )


def forward_flops_per_sample(
    model: nn.Module,
    input_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    *,
    light: bool = True,
) -> int:
    """Inference FLOPs per sample: one forward pass in eval mode without autograd.

    ``input_shape`` is one sample's shape, e.g. ``(3, 32, 32)`` for an image
    model or ``(16, 32, 32)`` for a server model. The model is not modified.
    Counted by the light layer counter where it applies (same number), by
    ``FlopCounterMode`` otherwise or with ``light=False``.
    """
    x = _dummy_batch(input_shape, batch_size, model)
    total = _light_or_none(lambda: _layer_forward_total(model, x), model) if light else None
    if total is None:
        total = _counter_forward_total(model, x)
    return total // batch_size


def training_flops_per_sample(
    model: nn.Module,
    input_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    loss: LossKind = "ce",
    *,
    light: bool = True,
) -> int:
    """Training FLOPs per sample: forward + loss + backward, in train mode.

    Measured on a deep copy, so the caller's weights, gradients and BatchNorm
    statistics are untouched. The optimiser update is not included (it is
    element-wise, hence not counted by ``FlopCounterMode`` anyway). Conv and
    matmul FLOPs scale linearly with the batch, so a small batch (>= 2, so
    BatchNorm has statistics to compute) gives the same per-sample figure as
    the real one.

    For a model returning a tuple (``ResNet8Edge``), the loss is taken on the
    first element, the logits. Counted by the light layer counter where it
    applies (same number), by ``FlopCounterMode`` otherwise or with ``light=False``.
    """
    _check_loss(loss)
    x = _dummy_batch(input_shape, batch_size, model)
    total = _light_or_none(lambda: _layer_training_total(model, x, loss), model) if light else None
    if total is None:
        total = _counter_training_total(model, x, loss)
    return total // batch_size


# --- the one cache -----------------------------------------------------------------

_COUNTED: dict[tuple, FlopsPerSample] = {}  # (architecture_key, input shape, loss) -> figures
_FORWARD: dict[tuple, int] = {}  # (the modules and parameter shapes, input shape) -> forward FLOPs


def _structure(model: nn.Module) -> tuple:
    modules = tuple(f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules())
    return modules, tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def architecture_key(model: nn.Module) -> tuple:
    """What a model's training FLOPs per sample depend on besides the input: every module's
    class, in order, every parameter's name and shape, and which parameters take a gradient
    (a frozen layer's weight gradient is not computed, so not counted)."""
    return _structure(model), tuple(p.requires_grad for p in model.parameters())


def cached_flops_per_sample(model: nn.Module, input_shape: Sequence[int], loss: LossKind = "ce") -> FlopsPerSample:
    """:func:`flops_per_sample` of ``model`` at one sample's ``input_shape``, counted once per
    :func:`architecture_key`, shape and loss: the figures every training loop, evaluation and
    feature extraction meters with (``edge_agent/trainer.py``, ``RoundMeter.forward``)."""
    shape = tuple(int(d) for d in input_shape)
    key = (architecture_key(model), shape, loss)
    if key not in _COUNTED:
        _COUNTED[key] = flops_per_sample(model, shape, loss=loss)
        _FORWARD.setdefault((_structure(model), shape), _COUNTED[key].forward)
    return _COUNTED[key]


def cached_forward_flops_per_sample(model: nn.Module, input_shape: Sequence[int]) -> int:
    """:func:`forward_flops_per_sample` from the same cache: the figure for a model that only
    runs forward (a frozen teacher, which has no training figure to count)."""
    shape = tuple(int(d) for d in input_shape)
    key = (_structure(model), shape)
    if key not in _FORWARD:
        _FORWARD[key] = forward_flops_per_sample(model, shape)
    return _FORWARD[key]


def clear_flops_cache() -> None:
    """Forget every cached count (a test that must count afresh)."""
    _COUNTED.clear()
    _FORWARD.clear()
