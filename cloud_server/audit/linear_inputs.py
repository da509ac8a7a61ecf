"""The input of a linear layer, read off a one-image update (Phong et al.; R-GAP, Zhu and
Blaschko): for one image and one SGD step, a linear layer ``y = W a + b`` moves by
``dW = -lr * delta a^T`` and ``db = -lr * delta``, so every row of ``dW`` is ``a`` scaled by
that row's ``db``. The least-squares ratio over the rows gives ``a`` exactly, up to float
rounding; :func:`invert_update` then asks the dummy image to produce it.

Only the first step's update has this form: with several steps, or Adam's per-coordinate
rescaling, the ratio is not ``a`` and this reading is not used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from .schedule import LocalSchedule

__all__ = ["LinearInput", "capture_input", "recover_linear_input"]


@dataclass(frozen=True)
class LinearInput:
    """A linear layer's input recovered from an update.

    Attributes:
        module_name: the layer's name in the model.
        values: ``(in_features,)`` its input.
    """

    module_name: str
    values: torch.Tensor


def recover_linear_input(model: nn.Module, update: Mapping[str, torch.Tensor], schedule: LocalSchedule) -> LinearInput | None:
    """The input of the first linear layer with a bias whose bias moved, or ``None`` when the
    schedule is not one SGD step (the reading would be wrong) or no such layer moved."""
    if schedule.optimizer != "sgd" or schedule.local_steps != 1:
        return None
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.bias is None:
            continue
        weight_key, bias_key = f"{name}.weight", f"{name}.bias"
        if weight_key not in update or bias_key not in update:
            continue
        d_bias = update[bias_key].detach().double()  # (out,)
        if not bool((d_bias.abs() > 0).any()):
            continue
        # Undo the L2 weight decay's share of the step (-lr * wd * W), known from the schedule.
        d_weight = update[weight_key].detach().double() + schedule.lr * schedule.weight_decay * module.weight.detach().double()
        d_bias = d_bias + schedule.lr * schedule.weight_decay * module.bias.detach().double()
        values = (d_bias @ d_weight) / d_bias.square().sum()  # (in,)
        return LinearInput(name, values.float())
    return None


@contextmanager
def capture_input(model: nn.Module, module_name: str) -> Iterator[list[torch.Tensor]]:
    """While open, the inputs the named module receives, appended to the yielded list in order
    (``""``: nothing is captured)."""
    captured: list[torch.Tensor] = []
    if not module_name:
        yield captured
        return
    module = dict(model.named_modules())[module_name]
    handle = module.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0]))
    try:
        yield captured
    finally:
        handle.remove()
