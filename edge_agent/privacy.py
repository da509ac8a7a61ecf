"""Differential privacy on the agent (the server's ``[server]`` ``dp_*`` keys, sent in its
Welcome as ``settings["privacy"]``; docs/privacy.md):

- :func:`privatise_state`: DP-FedAvg's client side. ``client_clipping``: the update (trained
  state minus the global state the round started from) clipped to L2 norm ``C`` before it is
  sent; ``local``: clipped and noised with ``N(0, (z C)^2)`` here, so the server only ever
  sees the noised update (Flower's ``LocalDpMod``). :func:`privatise_update` is the same step on
  the update itself, which secure aggregation masks (``FedAvgEdge.shared_update``).
- :class:`DpSgd`: DP-SGD through Opacus (per-sample clipping and noise at every step, batches
  drawn by Poisson sampling), one ``PrivacyEngine`` per agent whose accountant counts every
  step of the run; the agent reports its ε with each round's metrics. Its per-sample
  gradients are training work the model's own count leaves out: :meth:`DpSgd.extra_flops_per_sample`
  counts them, and the agent's meter adds them to every DP-SGD step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.privacy import require_dpsgd_model
from shared_protocol.privacy import DpAgentSettings, clip_update, float_names, gaussian_noise

__all__ = ["DpSgd", "agent_privacy", "privatise_state", "privatise_update"]

log = logging.getLogger("edge_agent.privacy")


def agent_privacy(settings: Mapping[str, Any]) -> DpAgentSettings:
    """The run's privacy settings from the Welcome's settings (the defaults, off, when absent)."""
    raw = settings.get("privacy")
    return DpAgentSettings() if raw is None else DpAgentSettings.from_dict(raw)


def privatise_update(update: Mapping[str, np.ndarray], settings: DpAgentSettings,
                     rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``clip_C(update)`` (``local``: plus ``N(0, (z C)^2)`` per entry), float64, and the update's
    norm before clipping."""
    clipped, norm = clip_update(update, settings.clip_norm)
    if settings.mode == "local":
        noise = gaussian_noise({n: u.shape for n, u in clipped.items()}, settings.noise_multiplier * settings.clip_norm, rng)
        clipped = {n: u + noise[n] for n, u in clipped.items()}
    return clipped, norm


def privatise_state(state: Mapping[str, np.ndarray], global_state: Mapping[str, np.ndarray], settings: DpAgentSettings,
                    rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``global + clip_C(state - global)`` (``local``: plus ``N(0, (z C)^2)`` per float entry), in
    ``state``'s dtypes, and the update's norm before clipping; integer counters as trained."""
    names = float_names(global_state)
    update = {n: np.asarray(state[n], dtype=np.float64) - np.asarray(global_state[n], dtype=np.float64) for n in names}
    clipped, norm = privatise_update(update, settings, rng)
    out = dict(state)
    for n in names:
        out[n] = (np.asarray(global_state[n], dtype=np.float64) + clipped[n]).astype(np.asarray(state[n]).dtype)
    return out, norm


class DpSgd:
    """One agent's DP-SGD for the whole run: Opacus's ``PrivacyEngine``, whose accountant keeps
    every step of every round (each round makes a fresh optimiser private)."""

    def __init__(self, settings: DpAgentSettings, model: nn.Module, model_name: str) -> None:
        from opacus import PrivacyEngine

        require_dpsgd_model(model, model_name)
        # Opacus's backward hooks forbid modifying a hooked layer's output in place.
        for module in model.modules():
            if isinstance(module, (nn.ReLU, nn.ReLU6, nn.LeakyReLU)) and module.inplace:
                module.inplace = False
        self.settings = settings
        self.engine = PrivacyEngine(accountant=settings.accountant)
        self.sample_rate = 0.0
        self.empty_batches = 0
        self._extra_flops: dict[tuple[int, ...], int] = {}

    def extra_flops_per_sample(self, model: nn.Module, input_shape: Sequence[int]) -> int:
        """FLOPs per sample a DP-SGD step adds to the model's forward and backward: Opacus's
        per-sample gradients, each counted layer's weight gradient once more per sample
        (:func:`models.layer_flops.weight_gradient_flops_per_sample`; the per-sample clipping
        and the noise are element-wise, which the formulas do not count). Once per input shape."""
        from models.layer_flops import weight_gradient_flops_per_sample

        shape = tuple(int(d) for d in input_shape)
        if shape not in self._extra_flops:
            self._extra_flops[shape] = weight_gradient_flops_per_sample(model, shape)
        return self._extra_flops[shape]

    @contextlib.contextmanager
    def private(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                loader: torch.utils.data.DataLoader) -> Iterator[tuple[nn.Module, torch.optim.Optimizer, Any]]:
        """(model, optimiser, batches) made private for one round's training; the model's hooks
        are removed afterwards, so ``model`` itself holds the trained weights."""
        s = self.settings
        model.train()  # Opacus refuses a model in eval mode (the agent evaluated it after the last round)
        private_model, private_optimizer, private_loader = self.engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=s.dpsgd_noise_multiplier,
            max_grad_norm=s.dpsgd_max_grad_norm, poisson_sampling=True,
        )
        self.sample_rate = float(private_loader.sample_rate)
        try:
            yield private_model, private_optimizer, self._non_empty(private_loader)
        finally:
            private_model._close()  # the hooks and per-sample gradients off the agent's model

    def _non_empty(self, loader: Any) -> "_NonEmpty":
        return _NonEmpty(loader, self)

    def figures(self) -> dict[str, float]:
        """ε so far (Opacus's accountant), the steps it counted, the sampling rate."""
        steps = sum(n for _, _, n in getattr(self.engine.accountant, "history", []))
        return {"dpsgd_epsilon": float(self.engine.get_epsilon(self.settings.delta)), "dpsgd_steps": float(steps),
                "dpsgd_sample_rate": self.sample_rate}


class _NonEmpty:
    """A Poisson loader without its empty batches (drawn with probability ``(1 - q)^N``: a step
    on no samples has no loss to take); iterable once per epoch, with the loader's length."""

    def __init__(self, loader: Any, owner: DpSgd) -> None:
        self.loader = loader
        self.owner = owner

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if len(batch[0]) == 0:
                self.owner.empty_batches += 1
                log.warning("DP-SGD: an empty Poisson batch skipped (%d so far)", self.owner.empty_batches)
                continue
            yield batch
