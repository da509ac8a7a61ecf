"""The server's training step: the shared loop's step (:mod:`models.training`), made fast.

FedGKT's server model, split learning's server half, FedBE's SWA distillation and
centralized training all run the one training loop of :mod:`models.training` with
this module's :class:`TrainStep` as its step: forward a batch, a loss, backward,
one optimiser step. On a GPU that step is launch-bound at the batch sizes these
methods use (a ResNet-55 step at batch 64 is a few hundred small kernels whose
arithmetic takes well under a millisecond on a data-centre GPU; no GPU timing of it is
recorded yet: ``bench/server_gpu.py`` measures it, and ``bench/results/server_gpu.json``
holds CPU figures only): the card waits on Python, on kernel launches and on every host
synchronisation. This module keeps it busy:

* :class:`RowBank` (:mod:`cloud_server.row_bank`, re-exported here) -- a method's training
  rows (feature maps, images, targets) staged on the training device when they fit, else
  left on the host and moved per batch; batches are gathered by index on the device.
* :class:`TrainStep` -- a :class:`models.training.Step`: forward + loss + backward +
  optimiser step in one of four modes (``server_step`` in ``[server]``):

  - ``"eager"``: plain PyTorch, as every loop ran before;
  - ``"compiled"``: forward and loss through ``torch.compile`` (``mode="reduce-overhead"``,
    i.e. CUDA graphs through cudagraph trees, on a GPU; inductor's default on a CPU),
    the optimiser step eager;
  - ``"graph"``: the whole step -- forward, loss, backward and the optimiser -- captured
    once per batch shape with ``torch.cuda.graphs`` and replayed (CUDA only);
  - ``"auto"``: per device type, :data:`AUTO_STEP` (on a CPU only for training calls of
    at least :data:`AUTO_CPU_COMPILE_MIN_STEPS` steps, see :meth:`TrainStep.session`).

  Whatever cannot be captured runs eagerly instead, with the reason logged and kept
  in :attr:`TrainStep.fallback_reason`: a CPU device for ``"graph"``, a torch without
  a working ``torch.compile``, a capture or compilation error, and every batch of
  another shape than the first full one (the last partial batch of an epoch).

Losses are summed on the device (``models.training.DeviceSum``, re-exported here) by the
loop, and the optimisers come from ``models.training.make_optimizer``, fused on a CUDA
device where this torch has it.

A step returns the loss and the logits as device tensors, detached. In ``"graph"`` and
``"compiled"`` modes they live in the captured graph's static memory and are
overwritten by the next step: use them (accumulate, index-copy) before the next call.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from models.training import DeviceSum, LossFn, Step, StepOutput

from .config import SERVER_STEPS  # ("auto", "eager", "compiled", "graph"); re-exported
# Staging rows on the device, re-exported so that the old import path keeps working.
from .row_bank import (
    DEVICE_STAGING_FRACTION,
    RowBank,
    banks_for_staged_rows,
    device_free_bytes,
    normalised_images,
    staging_budget_bytes,
)

__all__ = ["SERVER_STEPS", "AUTO_STEP", "AUTO_CPU_COMPILE_MIN_STEPS", "DEVICE_STAGING_FRACTION", "TrainStep", "StepOutput", "RowBank",
           "DeviceSum", "banks_for_staged_rows", "check_server_step", "normalised_images", "resolve_server_step",
           "staging_budget_bytes", "device_free_bytes"]

log = logging.getLogger("cloud_server.server_step")


#: What ``server_step = "auto"`` runs, per device type. CUDA: a whole-step CUDA graph removes
#: the launch and host-synchronisation overhead that bounds the step at these batch sizes
#: (bench/server_gpu.py measures every mode on a GPU so this can be revisited from
#: measurements; not yet measured on one). CPU: torch.compile, but only for a training call
#: long enough to pay for its compilation (:data:`AUTO_CPU_COMPILE_MIN_STEPS`), else eager.
AUTO_STEP: dict[str, str] = {"cpu": "compiled", "cuda": "graph"}

#: On a CPU, ``"auto"`` compiles the step only for a training call of at least this many
#: steps. The compiled step is faster than the eager one, but only after a cold compilation
#: that takes hundreds of steps to repay (bench/micro/test_server_loop.py::test_compile on the
#: 2-core development machine: bench/results/server_loop.json, whose verdict and
#: ``break_even_steps`` bench/micro_docs.py's ``compile_verdict`` reads). This threshold sits above that break-even: a full
#: Fashion-MNIST FedGKT round (~940 steps at batch 64) or centralized epoch compiles; a test's
#: or a FedBE distillation's 10-200 steps run eagerly.
AUTO_CPU_COMPILE_MIN_STEPS = 500


def check_server_step(mode: str) -> str:
    if mode not in SERVER_STEPS:
        raise ValueError(f"server_step must be one of {SERVER_STEPS}, got {mode!r}")
    return mode


# --------------------------------------------------------------------------- #
# the step
# --------------------------------------------------------------------------- #


def resolve_server_step(mode: str, device: torch.device | str, planned_steps: int | None = None) -> tuple[str, str]:
    """(mode to run, why it is not the one asked for) for ``mode`` on ``device``, for a training
    call of ``planned_steps`` steps (None: not known; ``"auto"`` on a CPU then runs eagerly)."""
    check_server_step(mode)
    device = torch.device(device)
    wanted = AUTO_STEP.get(device.type, "eager") if mode == "auto" else mode
    if mode == "auto" and device.type == "cpu" and (planned_steps or 0) < AUTO_CPU_COMPILE_MIN_STEPS:
        wanted = "eager"  # too short to repay a compilation: not a fallback
    if wanted == "graph" and device.type != "cuda":
        return "eager", f"server_step 'graph' needs a CUDA device, not {device.type}"
    if wanted == "compiled" and not hasattr(torch, "compile"):
        return "eager", f"torch {torch.__version__} has no torch.compile"
    return wanted, ""


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static input buffers: (inputs, *targets)
    loss: torch.Tensor
    logits: torch.Tensor
    lrs: list[float]  # SGD bakes its (float) learning rates into the graph


class TrainStep(Step):
    """:class:`models.training.Step` on ``loss_fn(logits, *targets)``, in one of the modes of
    the module doc.

    ``mode``: one of :data:`SERVER_STEPS`. :meth:`step_with_input_grad` also returns
    dLoss/dInputs (split learning's reply); such steps run eagerly, as does a step with a
    ``check`` (it reads the loss before backward). ``autocast_dtype`` (e.g.
    ``torch.bfloat16``) runs forward and loss under autocast (measured by
    bench/server_gpu.py; the methods train in float32). Use :meth:`session` around a
    training call (the shared loop does) so the learning rates in the optimiser are plain
    floats again after it (checkpoints, schedulers).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, mode: str = "auto", *,
                 warmup_steps: int = 3, max_recaptures: int = 4, autocast_dtype: torch.dtype | None = None,
                 name: str = "server") -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        super().__init__(model, optimizer, loss_fn, autocast_dtype=autocast_dtype, name=name)
        self.requested = check_server_step(mode)
        self.mode, self.fallback_reason = resolve_server_step(mode, self.device)
        if self.fallback_reason:
            log.info("%s: %s; the step runs eagerly", name, self.fallback_reason)
        self.warmup_steps = warmup_steps
        self.max_recaptures = max_recaptures
        self._full_shape: tuple | None = None  # the one shape compiled / captured
        self._seen: Counter[tuple] = Counter()
        self._compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._captured: _Captured | None = None
        self._recaptures = 0
        self._lr_tensors: list[torch.Tensor] | None = None
        self.steps = {"eager": 0, "compiled": 0, "graph": 0}  # steps run in each mode
        self._fell_back = False  # a compilation or capture failed: eager for good

    # -- public ------------------------------------------------------------- #

    @contextlib.contextmanager
    def session(self, planned_steps: int | None = None) -> Iterator["TrainStep"]:
        """One training call (a round's epochs, a distillation) of about ``planned_steps`` steps:
        ``"auto"`` chooses its mode for it (on a CPU it compiles only long calls)."""
        if self.requested == "auto" and not self._fell_back:
            self.mode, self.fallback_reason = resolve_server_step("auto", self.device, planned_steps)
        try:
            yield self
        finally:
            self._restore_float_lrs()

    def __call__(self, inputs: torch.Tensor, *targets: torch.Tensor, check: Callable[[torch.Tensor], None] | None = None) -> StepOutput:
        """One step on ``inputs`` (B, ...) and ``targets`` (each (B, ...)), all on the device."""
        shape = tuple((tuple(t.shape), t.dtype) for t in (inputs, *targets))
        if self.mode != "eager" and check is None:
            if self._full_shape is None:
                self._full_shape = shape
            if shape == self._full_shape:
                try:
                    return self._graph_step(inputs, targets) if self.mode == "graph" else self._compiled_step(inputs, targets)
                except (RuntimeError, OSError, ImportError, NotImplementedError) as exc:
                    self._fall_back(f"{self.mode} step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return self._eager_step(inputs, targets, check)

    def step_with_input_grad(self, inputs: torch.Tensor, *targets: torch.Tensor,
                             check: Callable[[torch.Tensor], None] | None = None) -> tuple[StepOutput, torch.Tensor]:
        """An eager step that also returns dLoss/dInputs (computed before the optimiser step).

        ``check(loss)`` runs after the forward pass and before backward (e.g. to refuse a
        non-finite loss without touching the model)."""
        self.model.train()
        h = inputs.detach().requires_grad_(True)
        out = self._eager_step(h, targets, check)
        return out, h.grad.detach()  # type: ignore[union-attr]

    # -- modes -------------------------------------------------------------- #

    def _compiled_step(self, inputs: torch.Tensor, targets: tuple[torch.Tensor, ...]) -> StepOutput:
        if self._compiled is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._compiled = torch.compile(self.forward_loss, mode=mode, dynamic=False)
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
        if self.device.type == "cuda" and mark is not None:
            mark()  # a new iteration: the previous step's graph outputs may be overwritten
        loss, logits = self._compiled(inputs, *targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps["compiled"] += 1
        return StepOutput(loss.detach(), logits.detach())

    def _graph_step(self, inputs: torch.Tensor, targets: tuple[torch.Tensor, ...]) -> StepOutput:
        shape = self._full_shape
        self._seen[shape] += 1
        if self._captured is None and self._seen[shape] <= self.warmup_steps:
            # Warm-up steps (real steps on real batches) on a side stream, as capture requires:
            # lazy initialisation (optimiser state, cuDNN plans, the allocator) happens here.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._make_capturable()
                out = self._eager_step(inputs, targets)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        self._make_capturable()
        captured = self._captured
        if captured is not None and captured.lrs != self._float_lrs():
            # SGD reads its learning rate as a Python float, baked into the graph: capture again.
            self._recaptures += 1
            if self._recaptures > self.max_recaptures:
                raise RuntimeError(f"the learning rate changed {self._recaptures} times; a captured step would be re-captured every step")
            captured = self._captured = None
        if captured is None:
            captured = self._captured = self._capture(inputs, targets)
        for static, new in zip(captured.inputs, (inputs, *targets)):
            static.copy_(new, non_blocking=True)
        captured.graph.replay()
        self.steps["graph"] += 1
        return StepOutput(captured.loss, captured.logits)

    def _capture(self, inputs: torch.Tensor, targets: tuple[torch.Tensor, ...]) -> _Captured:
        static = [t.detach().clone() for t in (inputs, *targets)]
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)  # backward in the graph allocates the gradients in its pool
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph):
            loss, logits = self.forward_loss(static[0], *static[1:])
            loss.backward()
            self.optimizer.step()
        log.info("%s: captured the training step as a CUDA graph (batch shape %s)", self.name, tuple(inputs.shape))
        return _Captured(graph, static, loss.detach(), logits.detach(), self._float_lrs())

    # -- optimiser state for capture ------------------------------------------ #

    def _adam_like(self) -> bool:
        return isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))

    def _make_capturable(self) -> None:
        """Adam: step counters on the device and the learning rate a device tensor, so a
        captured update reads them from memory (a scheduler may change the rate between
        replays). SGD keeps float rates (see the re-capture in :meth:`_graph_step`)."""
        if not self._adam_like():
            return
        for group in self.optimizer.param_groups:
            if not group.get("capturable", False):
                group["capturable"] = True
                group["fused"] = False  # the capturable foreach path reads a tensor learning rate
                group["foreach"] = True
                for p in group["params"]:
                    step = self.optimizer.state.get(p, {}).get("step")
                    if isinstance(step, torch.Tensor) and step.device != p.device:
                        self.optimizer.state[p]["step"] = step.to(p.device, torch.float32)
        if self._lr_tensors is None:
            self._lr_tensors = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device)
                                for g in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, self._lr_tensors):
            if group["lr"] is not lr:
                lr.fill_(float(group["lr"]))  # a scheduler put a float there: into the tensor (no sync)
                group["lr"] = lr

    def _float_lrs(self) -> list[float]:
        return [] if self._adam_like() else [float(g["lr"]) for g in self.optimizer.param_groups]

    def _restore_float_lrs(self) -> None:
        if self._lr_tensors is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self._lr_tensors):
            if group["lr"] is lr:
                group["lr"] = float(lr)  # one read per training call

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step with another optimiser from now on (e.g. a fresh one per round); a compiled
        forward is kept, a captured step (which holds the old optimiser's state) is not."""
        self.optimizer = optimizer
        self._captured = None
        self._lr_tensors = None
        self._seen.clear()
        self._recaptures = 0

    def reset(self) -> None:
        """Forget captured and compiled steps (after the optimiser's state was replaced, e.g.
        by loading a checkpoint: a captured graph would update the old state tensors)."""
        self._captured = None
        self._compiled = None
        self._full_shape = None
        self._seen.clear()
        self._recaptures = 0

    def _fall_back(self, reason: str) -> None:
        log.warning("%s: %s; running the step eagerly from now on", self.name, reason)
        self.fallback_reason = reason
        self.mode = "eager"
        self._fell_back = True
        self._captured = None
        self._compiled = None
