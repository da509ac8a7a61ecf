"""The torch backend's optimizers, in numpy, for backends that compute gradients elsewhere.

Same update rules, in the same float32 operation order, as ``torch.optim.SGD``
(momentum, dampening 0, L2 weight decay) and ``torch.optim.Adam(amsgrad=True)``
with L2 weight decay -- what :func:`models.optimizers.make_optimizer` builds on a CPU --
so an ort agent and a torch agent given the same gradients take the same steps.
onnxruntime-training's own optimizer graphs are AdamW (decoupled decay, no
AMSGrad) and plain SGD, which would not.
"""

from __future__ import annotations

import math

import numpy as np

from shared_protocol.configs import check_optimizer

__all__ = ["NumpyAdam", "NumpySGD", "make_numpy_optimizer"]

F32 = np.float32


class NumpySGD:
    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, p in params.items():
            g = grads[name].astype(F32, copy=True)
            if self.weight_decay:
                g = g + p * F32(self.weight_decay)
            if self.momentum:
                buf = self.buffers.get(name)
                buf = g.copy() if buf is None else buf * F32(self.momentum) + g
                self.buffers[name] = buf
                g = buf
            out[name] = (p + g * F32(-self.lr)).astype(F32)
        return out


class NumpyAdam:
    """``torch.optim.Adam(amsgrad=True)``, single-tensor (non-foreach) arithmetic."""

    def __init__(self, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.t = 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.vmax: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        b1, b2 = self.betas
        bias1 = 1 - b1**self.t
        bias2_sqrt = math.sqrt(1 - b2**self.t)
        step_size = self.lr / bias1
        out = {}
        for name, p in params.items():
            g = grads[name].astype(F32, copy=True)
            if self.weight_decay:
                g = g + p * F32(self.weight_decay)
            m = self.m.get(name, np.zeros_like(p))
            v = self.v.get(name, np.zeros_like(p))
            m = m + (g - m) * F32(1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
            v = v * F32(b2) + g * g * F32(1 - b2)
            vmax = np.maximum(self.vmax.get(name, np.zeros_like(p)), v)
            self.m[name], self.v[name], self.vmax[name] = m, v, vmax
            denom = np.sqrt(vmax) / F32(bias2_sqrt) + F32(self.eps)
            out[name] = (p + (m / denom) * F32(-step_size)).astype(F32)
        return out


def make_numpy_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> NumpySGD | NumpyAdam:
    """The numpy twin of :func:`models.optimizers.make_optimizer` for the same config names."""
    if check_optimizer(name) == "sgd":
        return NumpySGD(lr, momentum, weight_decay)
    return NumpyAdam(lr, weight_decay)
