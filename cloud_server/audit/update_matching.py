"""How :func:`~cloud_server.audit.updates.invert_update` compares a dummy update with the
received one.

- :func:`cosine_distance`: Inverting Gradients' ``1 - cos``, for SGD schedules and Adam
  schedules of several steps.
- :func:`sign_distance`: for one Adam step. Its first step from zero moments is
  ``-lr * g / (|g| + eps)``, so the update gives the sign of every parameter's gradient
  exactly and almost nothing of its size. The cosine through that step has a derivative in
  the images that vanishes almost everywhere; ``1 - <g, s> / ||g||_1`` with ``s`` the
  received signs is zero exactly where the dummy gradient has the received signs (and
  zeros), and is differentiable in the dummy gradient.
- :func:`batchnorm_distance`: a FedAvg upload carries BatchNorm's running statistics, and
  their change is a known function of the mean and variance of every BatchNorm layer's input
  in every local step (in train mode): per channel, the batch's first two moments. The
  dummy images are asked to produce the same running statistics.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import AttackInputError

__all__ = ["BatchNormRecorder", "batchnorm_distance", "cosine_distance", "moved_tensors", "observed_running_stats",
           "record_batchnorm", "sign_distance"]

# The eps of the normalised distances: far below any real update's size.
_EPS = 1e-12


def moved_tensors(observed: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors that moved.

    Raises:
        AttackInputError: nothing moved.
    """
    moved = [k for k in observed if observed[k].abs().max() > 0]
    if not moved:
        raise AttackInputError("the update is zero everywhere: nothing to invert")
    return moved


def cosine_distance(produced: Mapping[str, torch.Tensor], observed: Mapping[str, torch.Tensor], weighting: str) -> torch.Tensor:
    """``1 - cos`` between the updates, over the whole update at once (``"whole"``) or per
    parameter tensor, averaged over the tensors that moved (``"per_tensor"``)."""
    moved = moved_tensors(observed)
    if weighting == "whole":
        return 1.0 - F.cosine_similarity(torch.cat([produced[k].flatten() for k in moved]),
                                         torch.cat([observed[k].flatten() for k in moved]), dim=0, eps=_EPS)
    return torch.stack([1.0 - F.cosine_similarity(produced[k].flatten(), observed[k].flatten(), dim=0, eps=_EPS)
                        for k in moved]).mean()


def sign_distance(gradient: Mapping[str, torch.Tensor], observed: Mapping[str, torch.Tensor], weighting: str) -> torch.Tensor:
    """``1 - <g, s> / ||g||_1`` between a dummy gradient ``g`` and the gradient signs
    ``s = -sign(update)`` of a one-step Adam update, in ``[0, 2]``: 0 where every coordinate
    has the received sign (a zero where the update is zero). Per tensor or whole, as
    :func:`cosine_distance`."""
    moved = moved_tensors(observed)
    agreement = [-(gradient[k] * observed[k].sign()).sum() for k in moved]
    mass = [gradient[k].abs().sum() for k in moved]
    if weighting == "whole":
        return 1.0 - torch.stack(agreement).sum() / (torch.stack(mass).sum() + _EPS)
    return torch.stack([1.0 - a / (m + _EPS) for a, m in zip(agreement, mass)]).mean()


class BatchNormRecorder:
    """The per-channel batch mean and (unbiased) variance of every BatchNorm layer's input in
    train mode, differentiable, in the order of the forward passes."""

    def __init__(self) -> None:
        self.moments: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def clear(self) -> None:
        self.moments.clear()

    def record(self, name: str, features: torch.Tensor) -> None:  # (N, C, H, W) or (N, C)
        dims = [0, *range(2, features.dim())]
        self.moments.setdefault(name, []).append((features.mean(dims), features.var(dims, unbiased=True)))  # (C,), (C,)


@contextmanager
def record_batchnorm(model: nn.Module, enabled: bool = True) -> Iterator[BatchNormRecorder]:
    """While open, every train-mode forward pass of the model's BatchNorm layers (with running
    statistics) records its input's moments (nothing when not ``enabled``)."""
    recorder = BatchNormRecorder()
    handles = []
    if enabled:
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                handles.append(module.register_forward_hook(
                    lambda m, inputs, _out, name=name: recorder.record(name, inputs[0]) if m.training else None))
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


def observed_running_stats(model: nn.Module, update: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per BatchNorm layer whose running statistics the update carries: the uploaded
    ``(running_mean, running_var)`` (the global model's plus the update)."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or not module.track_running_stats:
            continue
        mean_key, var_key = f"{name}.running_mean", f"{name}.running_var"
        if mean_key in update and var_key in update and module.running_mean is not None and module.running_var is not None:
            found[name] = (module.running_mean.detach() + update[mean_key].detach().float(),
                           module.running_var.detach() + update[var_key].detach().float())
    return found


def batchnorm_distance(model: nn.Module, recorder: BatchNormRecorder,
                       observed: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The relative squared error between the running statistics the recorded forward passes
    produce from the model's own and the observed ones, averaged over layers and moments."""
    modules = dict(model.named_modules())
    errors = []
    for name, (mean_seen, var_seen) in observed.items():
        module = modules[name]
        if name not in recorder.moments or module.momentum is None:
            continue
        mean, var = module.running_mean.detach(), module.running_var.detach()
        for batch_mean, batch_var in recorder.moments[name]:  # one per local step, in order
            mean = (1 - module.momentum) * mean + module.momentum * batch_mean
            var = (1 - module.momentum) * var + module.momentum * batch_var
        # Compare the changes, which carry the batches' moments, not the statistics themselves.
        for produced, seen, start in ((mean, mean_seen, module.running_mean), (var, var_seen, module.running_var)):
            change = seen - start.detach()
            errors.append((produced - seen).square().sum() / (change.square().sum() + _EPS))
    if not errors:
        return torch.tensor(0.0)
    return torch.stack(errors).mean()
