"""Activation checkpointing for the bottleneck ResNets: less memory per training step, same math.

Most of what a ResNet-8 training step keeps from the forward pass for the
backward pass under torch lies inside its two bottlenecks, which run 64 channels
at full resolution (every ``(B, 64, 32, 32)`` map of them is kept).
:func:`checkpoint_bottlenecks` makes every :class:`~models.resnet_blocks.Bottleneck`
keep only its input; its inside is computed again, one block at a time, when the
backward pass reaches it. The measured breakdown and the cost are in
bench/results/step_memory.json (``test_saved_by_block``, ``test_torch_step``) and
docs/deploy.md ("Memory on the device").

The math is that of the plain model: the recomputation sees the same input and
the same parameters, so outputs, losses and gradients are the same. The one
thing a naive recomputation would change is BatchNorm's running statistics:
in training mode every BN forward updates them (and ``num_batches_tracked``),
so a recomputed block would update them twice per step. The recomputation
therefore runs with a momentum of zero for that block's BN layers (the
running statistics stay exactly as the first forward left them) and puts
their ``num_batches_tracked`` back; in training mode BN normalises with the
batch's own statistics either way, so the recomputed activations do not change.

It costs forward work: each checkpointed block runs its forward twice per
step. For ResNet-8 that is most of a forward pass again (the bottlenecks hold
nearly all of the model's convolutions): a training step's FLOPs are 1.32x the
plain step's (:func:`recompute_flops_ratio`).

Parameter and buffer names do not change (the blocks' ``forward`` is replaced
on the instance; no wrapper module is inserted), so state dicts, weight arrays
and checkpoints move freely between a checkpointed and a plain model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from models.resnet import Bottleneck

__all__ = [
    "checkpoint_bottlenecks",
    "has_bottlenecks",
    "is_checkpointed",
    "recompute_flops_ratio",
]

_PLAIN_FORWARD = "_edgesplit_plain_forward"


@contextlib.contextmanager
def _running_stats_frozen(bns: list[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Keep the running statistics of ``bns`` as they are during the recomputation.

    The recomputation must save the same tensors as the first forward did
    (non-reentrant checkpointing matches them one by one), so BN keeps passing
    its running buffers to ``F.batch_norm``; with ``momentum = 0`` the update it
    makes is ``(1 - 0) * running + 0 * batch``, which is the running value
    exactly (for finite batch statistics). ``num_batches_tracked`` is put back
    afterwards: BN counts it up on every training-mode forward. Normalisation
    uses the batch's own statistics in training mode whatever the momentum, so
    the recomputed activations are those of the first forward.
    """
    momenta = [bn.momentum for bn in bns]
    counts = [None if bn.num_batches_tracked is None else bn.num_batches_tracked.clone() for bn in bns]
    for bn in bns:
        bn.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for bn, momentum, count in zip(bns, momenta, counts):
                bn.momentum = momentum
                if count is not None:
                    bn.num_batches_tracked.copy_(count)


def _checkpointed_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
    plain = getattr(block, _PLAIN_FORWARD)
    if not (block.training and torch.is_grad_enabled()):
        return plain(x)  # eval / no_grad: nothing is saved for a backward pass anyway
    bns = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _running_stats_frozen(bns)

    # use_reentrant=False: gradients reach the parameters even when the block's input
    # does not require grad, and context_fn (the frozen running stats) is supported.
    return checkpoint(plain, x, use_reentrant=False, context_fn=contexts)


def checkpoint_bottlenecks(model: nn.Module) -> nn.Module:
    """Make every bottleneck block of ``model`` recompute its activations in the backward pass.

    Modifies ``model`` in place and returns it. Idempotent. A model with no
    :class:`~models.resnet_blocks.Bottleneck` is an error (a silent no-op would hide a
    model that was never made lighter).
    """
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no Bottleneck blocks to checkpoint")
    for block in blocks:
        if hasattr(block, _PLAIN_FORWARD):
            continue
        setattr(block, _PLAIN_FORWARD, block.forward)
        # An instance attribute: nn.Module.__call__ calls self.forward, and the state dict keeps its names.
        block.forward = functools.partial(_checkpointed_forward, block)  # type: ignore[method-assign]
    return model


def has_bottlenecks(model: nn.Module) -> bool:
    """True if ``model`` has a bottleneck block for :func:`checkpoint_bottlenecks` to work on."""
    return any(isinstance(m, Bottleneck) for m in model.modules())


def is_checkpointed(model: nn.Module) -> bool:
    """True if any bottleneck block of ``model`` recomputes its activations."""
    return any(hasattr(m, _PLAIN_FORWARD) for m in model.modules() if isinstance(m, Bottleneck))


def recompute_flops_ratio(model: nn.Module, input_shape: tuple[int, ...]) -> float:
    """Training-step FLOPs with checkpointed bottlenecks over those of the plain step.

    Counted with :func:`models.cost.training_flops_per_sample` on copies of
    ``model`` (the counter sees the recomputation: it runs inside the backward
    pass).
    """
    import copy

    from models.cost import training_flops_per_sample

    plain = copy.deepcopy(model)
    for block in plain.modules():
        if hasattr(block, _PLAIN_FORWARD):
            del block.forward
            delattr(block, _PLAIN_FORWARD)
    checkpointed = checkpoint_bottlenecks(copy.deepcopy(plain))
    return training_flops_per_sample(checkpointed, input_shape) / training_flops_per_sample(plain, input_shape)
