"""An agent's local training as the server configured it: what the update attacks unroll
and the label inference reads."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import AttackInputError, UnsupportedScheduleError

__all__ = ["SCHEDULE_OPTIMIZERS", "LocalSchedule"]

#: The optimisers the update attacks replay: those the agents train with (models.optimizers).
SCHEDULE_OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class LocalSchedule:
    """What an agent did between receiving the global model and uploading its own, as the
    server configured it.

    Attributes:
        lr: the local learning rate.
        local_steps: optimiser steps taken.
        batch_size: samples per step; step ``s`` uses samples ``s * batch_size ...`` of the
            dummy set, wrapping around.
        optimizer: ``"sgd"`` (momentum, L2 weight decay) or ``"adam"`` (AMSGrad, L2 weight
            decay), as :func:`models.optimizers.make_optimizer` builds them.
        momentum: SGD's momentum.
        weight_decay: L2 weight decay, added to the gradient.
        betas, eps: Adam's.
    """

    lr: float
    local_steps: int = 1
    batch_size: int = 1
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.optimizer not in SCHEDULE_OPTIMIZERS:
            raise UnsupportedScheduleError(f"LocalSchedule.optimizer must be one of {SCHEDULE_OPTIMIZERS}, got {self.optimizer!r}")
        if not self.lr > 0 or self.local_steps < 1 or self.batch_size < 1:
            raise AttackInputError(f"LocalSchedule needs lr > 0, local_steps >= 1 and batch_size >= 1, "
                                   f"got {self.lr}, {self.local_steps} and {self.batch_size}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise AttackInputError(f"LocalSchedule momentum and weight_decay must be >= 0, got {self.momentum} and {self.weight_decay}")

    @property
    def samples_seen(self) -> int:
        return self.local_steps * self.batch_size
