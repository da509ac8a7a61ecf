"""What the image attacks share: the total-variation prior, the image being optimised and its
projected optimiser."""

from __future__ import annotations

import math

import torch

from .errors import AttackInputError

__all__ = ["ImageVariable", "total_variation"]


def total_variation(pixels: torch.Tensor) -> torch.Tensor:  # (N, C, H, W)
    """Mean absolute difference between neighbouring pixels (anisotropic TV), a scalar."""
    dx = (pixels[..., :, 1:] - pixels[..., :, :-1]).abs().mean()
    dy = (pixels[..., 1:, :] - pixels[..., :-1, :]).abs().mean()
    return dx + dy


class ImageVariable:
    """A batch of images in pixel space, optimised with Adam and kept in ``[0, 1]`` after every
    step (projected gradient descent), with a cosine learning-rate decay to ``lr / 100``.

    Args:
        init: the starting images ``(N, C, H, W)`` in ``[0, 1]`` (copied).
        lr: Adam's initial learning rate.
        steps: the number of steps the decay spans.
        signed: step on the sign of the gradient (as Inverting Gradients does), which keeps
            layers with tiny gradients moving.
    """

    def __init__(self, init: torch.Tensor, lr: float, steps: int, signed: bool = False) -> None:
        if init.dim() != 4:
            raise AttackInputError(f"expected initial images (N, C, H, W), got {tuple(init.shape)}")
        self.pixels = init.detach().clone().clamp(0.0, 1.0).requires_grad_(True)  # (N, C, H, W)
        self.optimizer = torch.optim.Adam([self.pixels], lr=lr)
        self.steps = steps
        self.lr = lr
        self.signed = signed
        self._step = 0

    def step(self, loss: torch.Tensor) -> None:
        """One descent step on ``loss`` (a scalar that depends on :attr:`pixels`)."""
        progress = min(self._step / max(self.steps - 1, 1), 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * (0.01 + 0.99 * 0.5 * (1.0 + math.cos(math.pi * progress)))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.signed and self.pixels.grad is not None:
            self.pixels.grad.sign_()
        self.optimizer.step()
        with torch.no_grad():
            self.pixels.clamp_(0.0, 1.0)
        self._step += 1

    def result(self) -> torch.Tensor:
        """The images, detached, ``(N, C, H, W)`` in ``[0, 1]``."""
        return self.pixels.detach().clone()
