"""One optimiser step (:class:`Step`): a forward hook, a loss hook, backward and one
optimiser step, run eagerly, whole or as micro-batches (ghost batches for
BatchNorm). The server's ``cloud_server.server_step.TrainStep`` subclasses it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

LossFn = Callable[..., torch.Tensor]  # (output of forward, *targets) -> scalar loss
Forward = Callable[[nn.Module, torch.Tensor], object]  # (model, inputs (B, ...)) -> what the loss takes


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output (ResNet-8 returns (logits, features))."""
    return output[0] if isinstance(output, tuple) else output  # type: ignore[return-value]


def _logits_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return logits_of(model(inputs))  # (B, K)


@dataclass
class StepOutput:
    loss: torch.Tensor  # () on the device, detached
    logits: torch.Tensor | None  # (B, K) on the device, detached; None with a step's own ``forward`` (its output is the method's)


class DeviceSum:
    """A running sum kept on the device; :meth:`item` reads it once (one host synchronisation)."""

    def __init__(self, device: torch.device | str) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, value: torch.Tensor, weight: float = 1.0) -> None:
        self.total += value.detach().to(torch.float64) * weight

    def item(self) -> float:
        return float(self.total)


class Step:
    """One optimiser step of ``model`` on ``loss_fn(forward(model, inputs), *targets)``, eagerly.

    ``forward`` (default: the logits of ``model(inputs)``) is the hook for a method
    whose loss needs more than the logits (the features too, a teacher's logits on
    the same batch); the step's output then carries no logits, as what the forward
    returns is the method's own. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs
    forward and loss under autocast. Subclasses run the same step faster (see the
    module doc).

    ``micro_batch`` (>= 2) bounds the samples one forward pass holds activations
    for: a larger batch runs as near-equal micro-batches whose losses, weighted
    by their share of the batch, are back-propagated one after the other into one
    optimiser step -- the whole batch's gradient for a loss that is a mean over
    samples, with a memory peak set by the micro-batch. BatchNorm is what
    differs: each micro-batch is normalised with its own statistics (ghost
    batches), and the running statistics, updated once per micro-batch, use the
    momentum ``1 - (1 - m) ** (1 / k)`` for ``k`` micro-batches so that they
    average over as many samples as one update with ``m`` per batch would.
    Targets that are tensors or arrays with the batch's length are split with the
    inputs; anything else reaches every micro-batch's loss as it is.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
                 forward: Forward | None = None, autocast_dtype: torch.dtype | None = None, name: str = "train",
                 micro_batch: int | None = None) -> None:
        if micro_batch is not None and micro_batch < 2:
            raise ValueError(f"micro_batch must be >= 2 (BatchNorm needs two samples) or None, got {micro_batch}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.forward = forward or _logits_forward
        self._output_is_logits = forward is None
        self.autocast_dtype = autocast_dtype
        self.name = name
        self.device = next(model.parameters()).device
        self.steps: dict[str, int] = {"eager": 0}  # steps run in each mode
        self.micro_batch = micro_batch
        # > 0: eager steps clip the gradient's global L2 norm to this before the optimiser
        # step (a server's guard against one batch of wild inputs); clipped counts them.
        self.max_grad_norm = 0.0
        self.clipped = 0
        self.last_grad_norm: float | None = None

    def _clip_gradients(self) -> None:
        if self.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
            self.last_grad_norm = norm
            if norm > self.max_grad_norm:
                self.clipped += 1

    @contextlib.contextmanager
    def session(self, planned_steps: int | None = None) -> Iterator["Step"]:
        """One training call of about ``planned_steps`` steps (a subclass may choose how to
        run it, and must leave the optimiser as it found it afterwards)."""
        yield self

    def __call__(self, inputs: torch.Tensor, *targets: Any, check: Callable[[torch.Tensor], None] | None = None) -> StepOutput:
        """One step on ``inputs`` (B, ...) and ``targets``; ``check(loss)`` runs after the
        forward pass and before backward (it may refuse the loss by raising)."""
        return self._eager_step(inputs, targets, check)

    def forward_loss(self, inputs: torch.Tensor, *targets: Any) -> tuple[torch.Tensor, Any]:
        """(loss, forward's output) of one batch."""
        if self.autocast_dtype is None:
            output = self.forward(self.model, inputs)
            return self.loss_fn(output, *targets), output
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            output = self.forward(self.model, inputs)
            return self.loss_fn(output.float() if self._output_is_logits else output, *targets), output

    def _eager_step(self, inputs: torch.Tensor, targets: tuple[Any, ...],
                    check: Callable[[torch.Tensor], None] | None = None) -> StepOutput:
        if self.micro_batch is not None and inputs.shape[0] > self.micro_batch:
            return self._accumulated_step(inputs, targets, check)
        loss, output = self.forward_loss(inputs, *targets)
        if check is not None:
            check(loss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._clip_gradients()
        self.optimizer.step()
        self.steps["eager"] += 1
        return StepOutput(loss.detach(), output.detach() if self._output_is_logits else None)

    def _accumulated_step(self, inputs: torch.Tensor, targets: tuple[Any, ...],
                          check: Callable[[torch.Tensor], None] | None = None) -> StepOutput:
        """One optimiser step on ``inputs`` (B, ...) as micro-batches of at most ``micro_batch``."""
        assert self.micro_batch is not None
        n = inputs.shape[0]
        parts = micro_batch_slices(n, self.micro_batch)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=inputs.device)
        outputs: list[torch.Tensor] = []
        with ghost_batch_momentum(self.model, len(parts)):
            for part in parts:
                loss, output = self.forward_loss(inputs[part], *(_rows(t, part, n) for t in targets))
                if check is not None:
                    check(loss)  # before this micro-batch's backward; nothing is applied until all passed
                share = (part.stop - part.start) / n
                (loss * share).backward()
                total += loss.detach() * share
                if self._output_is_logits:
                    outputs.append(output.detach())
        self._clip_gradients()
        self.optimizer.step()
        self.steps["eager"] += 1
        return StepOutput(total, torch.cat(outputs) if outputs else None)


def micro_batch_slices(n: int, micro_batch: int) -> list[slice]:
    """``n`` rows as ``ceil(n / micro_batch)`` near-equal consecutive slices (sizes differ
    by at most one: no tiny last micro-batch for BatchNorm to normalise)."""
    k = -(-n // micro_batch)
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def _rows(target: Any, part: slice, n: int) -> Any:
    """``target``'s rows ``part`` if it is a per-sample tensor or array of ``n`` rows; else ``target``."""
    shape = getattr(target, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] == n:
        return target[part]
    return target


@contextlib.contextmanager
def ghost_batch_momentum(model: nn.Module, micro_batches: int) -> Iterator[None]:
    """BatchNorm momenta for ``micro_batches`` running-statistics updates per optimiser
    step: ``1 - (1 - m) ** (1 / k)`` keeps the statistics' memory, in samples, what it is
    with one update of momentum ``m`` per step. Restored on exit."""
    saved: list[tuple[nn.modules.batchnorm._BatchNorm, float]] = []
    if micro_batches > 1:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is not None:
                saved.append((module, module.momentum))
                module.momentum = 1.0 - (1.0 - module.momentum) ** (1.0 / micro_batches)
    try:
        yield
    finally:
        for module, momentum in saved:
            module.momentum = momentum
