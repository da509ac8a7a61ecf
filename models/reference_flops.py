"""The reference FLOP counter: :class:`torch.utils.flop_counter.FlopCounterMode`, which
dispatches every op through Python (slow: measure one representative step) and
imports about 800 more modules the first time it is entered."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn
# Importing the module is cheap (torch loads it anyway); only entering the mode is heavy.
from torch.utils.flop_counter import FlopCounterMode

from models.flop_probe import LossKind, _logits_of, _objective


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


def _counter_forward_total(model: nn.Module, x: torch.Tensor) -> int:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return flops_of(lambda: model(x))
    finally:
        model.train(was_training)


def _counter_training_total(model: nn.Module, x: torch.Tensor, loss: LossKind) -> int:
    probe = copy.deepcopy(model).train()
    return flops_of(lambda: _objective(_logits_of(probe(x)), loss).backward())
