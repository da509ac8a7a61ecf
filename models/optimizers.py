"""The one optimiser factory of the project (:func:`make_optimizer`: the edge's torch
methods and every server loop) and its learning-rate schedules; on a CPU the lean
optimisers (:class:`LeanSGD`, :class:`LeanAdam`) do ``torch.optim``'s arithmetic
without importing ``torch._dynamo``. The torch-free ort backend mirrors the two
update rules in numpy (``edge_agent/backends/optim.py``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

# Logged under the name of the module this came from.
log = logging.getLogger("models.training")

#: The learning-rate schedules :func:`make_lr_schedule` builds, per training call (a round).
LR_SCHEDULES = ("none", "plateau")

#: The optimiser names :func:`make_optimizer` builds. The torch-free configs validate
#: against the same names in ``shared_protocol.configs.OPTIMIZERS`` (a test keeps the two equal).
OPTIMIZERS = ("sgd", "adam")


class LeanSGD:
    """``torch.optim.SGD`` (momentum, dampening 0, L2 weight decay) on a CPU, the same
    single-tensor arithmetic in the same order, without ``torch.optim``.

    Why: the first step of any ``torch.optim`` optimiser imports ``torch._dynamo``
    (``Optimizer.step`` calls ``torch._dynamo.graph_break``), hundreds of modules and
    tens of MB of resident memory that an edge agent never uses (bench/results/step_memory.json,
    ``test_import_cost``: ``torch_optim_adam`` against ``lean_adam``).
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
