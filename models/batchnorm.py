"""BatchNorm running statistics as data: measure them on some inputs, swap them in, put them back.

A server model trained on several agents' feature maps (FedGKT) sees each agent's
maps in its own "feature language"; evaluating one agent's maps with statistics
measured on that agent's maps is then fairer than with the running averages over
all of them. These helpers do the bookkeeping and always leave the model as they
found it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn as nn

__all__ = ["BnStatistics", "batchnorm_layers", "load_bn_statistics", "measure_bn_statistics", "restoring_bn_statistics"]

BnStatistics = list[tuple[torch.Tensor, torch.Tensor]]  # one (running_mean, running_var) per BatchNorm layer


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def load_bn_statistics(model: nn.Module, statistics: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for m, (mean, var) in zip(batchnorm_layers(model), statistics):
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)


@contextlib.contextmanager
def restoring_bn_statistics(model: nn.Module) -> Iterator[BnStatistics]:
    """Yields a copy of the model's statistics and puts them back on exit, whatever was loaded meanwhile."""
    saved = [(m.running_mean.clone(), m.running_var.clone()) for m in batchnorm_layers(model)]
    try:
        yield saved
    finally:
        load_bn_statistics(model, saved)


@torch.no_grad()
def measure_bn_statistics(model: nn.Module, batches: Iterable[torch.Tensor]) -> BnStatistics:
    """The statistics every BatchNorm layer sees over ``batches`` (a cumulative average, as
    ``torch.optim.swa_utils.update_bn`` computes), leaving the model as it was."""
    norms = batchnorm_layers(model)
    saved = [(m.num_batches_tracked.clone(), m.momentum) for m in norms]
    was_training = model.training
    with restoring_bn_statistics(model):
        try:
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over all batches
            model.train()
            for batch in batches:
                model(batch)
            return [(m.running_mean.clone(), m.running_var.clone()) for m in norms]
        finally:
            for m, (count, momentum) in zip(norms, saved):
                m.num_batches_tracked.copy_(count)
                m.momentum = momentum
            model.train(was_training)
