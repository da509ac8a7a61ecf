"""One training loop for both sides of a run, and one optimiser factory.

The loop (:class:`Trainer`) knows nothing about the model or the method, in the
shape of minGPT's trainer. A caller gives it

* a step: :class:`Step` (a forward hook, a loss hook, backward, one optimiser
  step, run eagerly), or any subclass -- the server's
  ``cloud_server.server_step.TrainStep`` is one, adding ``torch.compile`` and CUDA
  graphs -- so the edge's CPU loop and the server's GPU loop are the same loop;
* the batches of each epoch as :class:`Batch` (inputs and targets, plus whatever the
  callbacks need to know about the rows in ``meta``);
* callbacks for what it does besides training: ``on_batch_start`` (e.g. a learning
  rate schedule), ``on_batch_end`` (collecting logits by sample, SWA snapshots,
  logging), ``on_epoch_end``. A callback may call :meth:`Trainer.stop`. A ``guard``
  (loss -> None) may raise :class:`StepSkipped` after the forward pass: the step is not
  taken and ``on_batch_skipped`` fires (a server that must not be blown up by one batch).

Losses are summed on the step's device and read once at the end, so a GPU step
never waits for the host. ``check_finite="step"`` reads each loss before its
update instead and refuses a non-finite one (:class:`NonFiniteLossError`) without
touching the model: on a CPU the read costs nothing, and a diverged agent must not
upload garbage.

:func:`make_optimizer` is the one optimiser factory of the project (the edge's
torch methods and every server loop); the torch-free ort backend mirrors its two
update rules in numpy (``edge_agent/backends/optim.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

__all__ = [
    "LR_SCHEDULES", "OPTIMIZERS", "Batch", "DeviceSum", "Forward", "LeanAdam", "LeanSGD", "LossFn", "NonFiniteLossError", "Step", "StepOutput", "StepSkipped",
    "TrainResult", "Trainer", "accuracy", "ghost_batch_momentum", "logits_of", "make_lr_schedule", "make_optimizer",
    "micro_batch_slices",
]

log = logging.getLogger("models.training")

LossFn = Callable[..., torch.Tensor]  # (output of forward, *targets) -> scalar loss
Forward = Callable[[nn.Module, torch.Tensor], object]  # (model, inputs (B, ...)) -> what the loss takes

#: The learning-rate schedules :func:`make_lr_schedule` builds, per training call (a round).
LR_SCHEDULES = ("none", "plateau")

#: The optimiser names :func:`make_optimizer` builds. The torch-free configs validate
#: against the same names in ``shared_protocol.configs.OPTIMIZERS`` (a test keeps the two equal).
OPTIMIZERS = ("sgd", "adam")


class NonFiniteLossError(RuntimeError):
    """Training diverged: the loss became NaN or infinite."""


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output (ResNet-8 returns (logits, features))."""
    return output[0] if isinstance(output, tuple) else output  # type: ignore[return-value]


def _logits_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return logits_of(model(inputs))  # (B, K)


# --------------------------------------------------------------------------- #
# the optimiser
# --------------------------------------------------------------------------- #


class LeanSGD:
    """``torch.optim.SGD`` (momentum, dampening 0, L2 weight decay) on a CPU, the same
    single-tensor arithmetic in the same order, without ``torch.optim``.

    Why: the first step of any ``torch.optim`` optimiser imports ``torch._dynamo``
    (``Optimizer.step`` calls ``torch._dynamo.graph_break``), about 800 modules and
    80 MB of resident memory (torch 2.13 CPU build) that an edge agent never uses.
    The lean optimisers have the interface the training loop uses (``param_groups``,
    ``zero_grad``, ``step``); tests hold them to ``torch.optim``'s results.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.param_groups = [{"params": list(params), "lr": lr, "momentum": momentum, "weight_decay": weight_decay}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
            if momentum != 0:
                state = self.state.setdefault(p, {})
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-lr)


class LeanAdam(LeanSGD):
    """``torch.optim.Adam(amsgrad=True)`` with L2 weight decay on a CPU (single-tensor
    arithmetic, as torch runs it there), without ``torch.optim``: see :class:`LeanSGD`."""

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, lr, weight_decay=weight_decay)
        self.param_groups[0].update(betas=betas, eps=eps)

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, weight_decay, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
            state = self.state.setdefault(p, {})
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), max_exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            exp_avg, exp_avg_sq, max_exp_avg_sq = state["exp_avg"], state["exp_avg_sq"], state["max_exp_avg_sq"]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1 ** state["step"])
            bias_correction2_sqrt = (1 - beta2 ** state["step"]) ** 0.5
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)


def make_optimizer(name: str, params: Any, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                   device: torch.device | str = "cpu", lean: bool = False) -> torch.optim.Optimizer:
    """Adam with AMSGrad or SGD with momentum (L2 weight decay in both), by ``name``.

    On a CUDA ``device`` Adam is built ``fused=True`` (one kernel for the whole update)
    and SGD ``foreach=True``; on a CPU both are PyTorch's defaults, the rules the
    numpy optimisers of the ort backend reproduce bit for bit. ``lean`` (a CPU only):
    :class:`LeanSGD` / :class:`LeanAdam`, the same updates without importing
    ``torch._dynamo`` (the edge agents' choice; no learning-rate schedules on them).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    params = list(params)
    if lean:
        if torch.device(device).type != "cpu":
            raise ValueError(f"lean optimisers run on a CPU, got device {device}")
        return LeanSGD(params, lr, momentum, weight_decay) if name == "sgd" else LeanAdam(params, lr, weight_decay)  # type: ignore[return-value]
    cuda = torch.device(device).type == "cuda"
    if name == "sgd":
        extra: dict[str, Any] = {"foreach": True} if cuda else {}
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **extra)
    if cuda:
        try:
            return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, amsgrad=True, fused=True)
        except (RuntimeError, TypeError, ValueError) as exc:  # an older torch without fused AMSGrad
            log.info("fused Adam not available (%s); using foreach", exc)
            return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, amsgrad=True, foreach=True)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, amsgrad=True)


def make_lr_schedule(name: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau | None:
    """``"plateau"``: halve the rate after 2 rounds without a lower training loss (step it with
    each round's loss); ``"none"``: None."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {name!r}")
    if name == "none":
        return None
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=2)


# --------------------------------------------------------------------------- #
# the step
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# the loop
# --------------------------------------------------------------------------- #


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, ...) on the step's device
    targets: tuple[Any, ...]  # what the loss takes after the forward's output, e.g. labels (B,)
    meta: Any = None  # the caller's own record of the batch (which rows, which agent), for callbacks

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])


@dataclass
class TrainResult:
    samples: int
    steps: int
    mean_loss: float  # over every step, weighted by batch size (NaN without steps)
    last_epoch_loss: float  # the same over the last epoch's steps only
    last_epoch_samples: int


Callback = Callable[["Trainer"], None]


class ProgressBar(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


#: Makes a progress bar, called as ``progress(total=..., desc=..., leave=False, dynamic_ncols=True)``:
#: ``tqdm.auto.tqdm`` fits. The caller passes it, so this package depends on torch and numpy only.
ProgressFactory = Callable[..., ProgressBar]
EVENTS = ("on_batch_start", "on_batch_end", "on_batch_skipped", "on_epoch_end")


class StepSkipped(Exception):
    """Raised by a trainer's ``guard`` (after the forward pass, before backward) to skip a
    step whose loss it does not trust: the model's parameters are left as they were, the
    batch's loss is not counted, ``on_batch_skipped`` fires and the loop goes on."""
FINITE_CHECKS = ("none", "step")


class Trainer:
    """Epochs of batches through a step, with callbacks; see the module doc.

    While :meth:`run` runs, callbacks read ``epoch`` (0-based), ``last_epoch``,
    ``steps_done`` (steps finished), ``batch`` and, after the step, ``out``.
    """

    def __init__(self, step: Step, *, desc: str = "train", progress: ProgressFactory | None = None,
                 check_finite: str = "none", guard: Callable[[torch.Tensor], None] | None = None) -> None:
        if check_finite not in FINITE_CHECKS:
            raise ValueError(f"check_finite must be one of {FINITE_CHECKS}, got {check_finite!r}")
        self.step = step
        self.desc = desc
        self.progress = progress
        self.check_finite = check_finite
        self.guard = guard  # guard(loss) may raise StepSkipped (runs every step eagerly)
        self.skipped = 0
        self.skip_reason = ""
        self.callbacks: dict[str, list[Callback]] = {event: [] for event in EVENTS}
        self.epoch = 0
        self.last_epoch = False
        self.steps_done = 0
        self.batch: Batch | None = None
        self.out: StepOutput | None = None
        self._stop = False

    def add_callback(self, event: str, callback: Callback) -> "Trainer":
        if event not in self.callbacks:
            raise ValueError(f"unknown trainer event {event!r}; the events are {EVENTS}")
        self.callbacks[event].append(callback)
        return self

    def stop(self) -> None:
        """End the run after the current batch (a callback's way to stop early)."""
        self._stop = True

    def _fire(self, event: str) -> None:
        for callback in self.callbacks[event]:
            callback(self)

    def _refuse_non_finite(self, loss: torch.Tensor) -> None:
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLossError(f"{self.desc}: loss is {value} at step {self.steps_done}")

    def run(self, epochs: int, batches: Callable[[int], Iterable[Batch]], planned_steps: int | None = None) -> TrainResult:
        """``epochs`` epochs over ``batches(epoch)``; ``planned_steps`` (if known) sizes the
        progress bar and lets the step choose how to run (see ``TrainStep.session``)."""
        device = self.step.device
        total, last = DeviceSum(device), DeviceSum(device)
        samples = last_samples = 0
        self.steps_done, self._stop = 0, False
        check = self._refuse_non_finite if self.check_finite == "step" else None
        if self.guard is not None:
            guard, finite = self.guard, check

            def check(loss: torch.Tensor) -> None:
                if finite is not None:
                    finite(loss)
                guard(loss)
        self.skipped = 0
        bar = None
        if self.progress is not None:
            bar = self.progress(total=planned_steps, desc=self.desc, leave=False, dynamic_ncols=True)
        try:
            with self.step.session(planned_steps=planned_steps):
                for epoch in range(epochs):
                    self.epoch, self.last_epoch = epoch, epoch == epochs - 1
                    for batch in batches(epoch):
                        self.batch = batch
                        self._fire("on_batch_start")
                        try:
                            self.out = self.step(batch.inputs, *batch.targets, check=check)
                        except StepSkipped as exc:
                            self.skipped += 1
                            self.skip_reason = str(exc)
                            self._fire("on_batch_skipped")
                            if bar is not None:
                                bar.update(1)
                            continue
                        n = batch.size
                        total.add(self.out.loss, n)
                        samples += n
                        if self.last_epoch:
                            last.add(self.out.loss, n)
                            last_samples += n
                        self.steps_done += 1
                        self._fire("on_batch_end")
                        if bar is not None:
                            bar.update(1)
                        if self._stop:
                            break
                    self._fire("on_epoch_end")
                    if self._stop:
                        break
                # The call's one wait for the device.
                mean = total.item() / samples if samples else float("nan")
                last_mean = last.item() / last_samples if last_samples else float("nan")
        finally:
            if bar is not None:
                bar.close()
        return TrainResult(samples, self.steps_done, mean, last_mean, last_samples)


@torch.no_grad()
def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor, Any]],
             device: torch.device | str = "cpu") -> tuple[int, int]:
    """(correct, total) of ``predict(images) -> logits`` over ``(images, labels, ids)`` batches."""
    correct = total = 0
    for images, labels, _ in batches:
        logits = predict(images.to(device))  # (B, K)
        correct += int((logits.argmax(dim=1).cpu() == labels).sum())
        total += int(labels.shape[0])
    return correct, total
