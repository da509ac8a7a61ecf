"""The edge's activation defences, for every method that uploads activations (FedGKT's
feature maps, split learning's activations); the settings are
:class:`shared_protocol.activation_guard.ActivationGuard`.

* **Clipped, noised maps.** Each map is scaled to an L2 norm of at most C and gets Gaussian
  noise of standard deviation ``z * C``. The noise of a map is a function of the agent's
  private key, the release it belongs to and the sample id (:func:`protect_maps`): sending
  the same release again (a resend, a round that uploads unchanged maps in full) sends the
  same noisy map, byte for byte, so the server never holds two noisy copies of one map to
  average. A map of another release (an extractor that trained) is a new release with its
  own noise; the run report composes those.
* **NoPeek**: ``alpha * dCor(images, maps)`` added to the agent's training loss
  (:class:`NoPeek`, :func:`distance_correlation`).
* **The agent's key** (:func:`agent_key`): drawn from ``os.urandom`` unless the agent's own
  config fixes it (``[agent] private_seed``), never derived from what the server knows; it
  also seeds a private initialisation (``edge_init = "per_agent"``).

numpy at import; torch only inside the NoPeek and split-learning helpers, so a torch-free
agent can import the noise.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from shared_protocol.activation_guard import ActivationGuard

__all__ = ["NoPeek", "agent_key", "clip_rows_torch", "distance_correlation", "key_seed", "protect_maps"]

KEY_BYTES = 32


def agent_key(private_seed: int = 0) -> bytes:
    """The agent's private key: ``os.urandom`` when ``private_seed`` is 0, else a digest of it
    (for reproducible experiments: the seed lives in the agent's config, which the server never sees)."""
    if private_seed == 0:
        return os.urandom(KEY_BYTES)
    return hashlib.sha256(f"edgesplit-agent-key/{private_seed}".encode()).digest()


def key_seed(key: bytes, purpose: str) -> int:
    """A 63-bit seed for ``purpose`` (``"init"``, ...) from the agent's key."""
    return int.from_bytes(hashlib.sha256(key + b"/" + purpose.encode()).digest()[:8], "little") >> 1


def _clip_scale(norms: np.ndarray, clip_norm: float) -> np.ndarray:
    return np.minimum(1.0, clip_norm / np.maximum(norms, 1e-12))


def protect_maps(maps: np.ndarray, guard: ActivationGuard, key: bytes, release: str,
                 sample_ids: np.ndarray) -> np.ndarray:
    """``maps`` (B, ...) float32 clipped per sample to ``guard.map_clip_norm`` (L2 over the
    whole map) plus ``N(0, (z * C)^2)`` noise; ``maps`` itself when the guard clips nothing.

    The noise of row i is drawn from a generator seeded by (``key``, ``release``,
    ``sample_ids[i]``): the same release of the same sample always gets the same noise, a
    new release (another ``release`` string) fresh noise. ``release`` must therefore name
    everything the map depends on (the extractor's digest, the split)."""
    if not guard.clips:
        return maps
    if len(sample_ids) != maps.shape[0]:
        raise ValueError(f"protect_maps: {maps.shape[0]} maps but {len(sample_ids)} sample ids")
    flat = maps.reshape(maps.shape[0], -1).astype(np.float32)  # (B, D)
    out = flat * _clip_scale(np.linalg.norm(flat, axis=1), guard.map_clip_norm)[:, None].astype(np.float32)
    if guard.noisy:
        base = hashlib.sha256(key + b"/maps/" + release.encode()).digest()
        std = guard.noise_std
        for i, sample_id in enumerate(np.asarray(sample_ids, dtype=np.int64)):
            seed = int.from_bytes(hashlib.sha256(base + int(sample_id).to_bytes(8, "little", signed=True)).digest()[:16], "little")
            out[i] += (np.random.default_rng(seed).standard_normal(flat.shape[1]) * std).astype(np.float32)
    return out.reshape(maps.shape)


def clip_rows_torch(maps: Any, clip_norm: float) -> Any:
    """``maps`` (B, ...) scaled per row to an L2 norm of at most ``clip_norm``, differentiably
    (split learning's backward pass goes through the clipping); ``maps`` when ``clip_norm`` is 0."""
    if clip_norm <= 0:
        return maps
    norms = maps.flatten(1).norm(dim=1).clamp_min(1e-12)  # (B,)
    scale = (clip_norm / norms).clamp(max=1.0)
    return maps * scale.view(-1, *([1] * (maps.dim() - 1)))


def distance_correlation(x: Any, y: Any) -> Any:
    """The sample distance correlation of the rows of ``x`` (B, ...) and ``y`` (B, ...)
    (Szekely et al.; the V-statistic ``dcor.distance_correlation`` computes), differentiable in
    torch: pairwise Euclidean distances, double-centred, ``dCov^2(x, y) / sqrt(dVar^2(x) dVar^2(y))``,
    square-rooted."""
    import torch

    def centred(z: torch.Tensor) -> torch.Tensor:
        z = z.flatten(1).double()
        sq = (z * z).sum(1)
        # Distances from the Gram matrix; the clamp keeps sqrt's gradient finite on the diagonal.
        d = (sq[:, None] + sq[None, :] - 2.0 * (z @ z.T)).clamp_min(1e-18).sqrt()  # (B, B)
        d = d - torch.diag(torch.diag(d))
        return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()

    a, b = centred(x), centred(y)
    dcov_xy, dvar_x, dvar_y = (a * b).mean(), (a * a).mean(), (b * b).mean()
    denominator = (dvar_x * dvar_y).sqrt()
    if float(denominator.detach()) == 0.0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return (dcov_xy / denominator).clamp_min(1e-18).sqrt().to(x.dtype)


class NoPeek:
    """``alpha * dCor(images, maps)`` for the batch a watched model last saw: a forward
    pre-hook on the model keeps its input (the image batch, or the micro-batch being trained),
    and :meth:`penalty` pairs it with the maps the loss receives."""

    def __init__(self, alpha: float) -> None:
        self.alpha = float(alpha)
        self.images: Any = None
        self._handle: Any = None

    def watch(self, module: Any) -> "NoPeek":
        def keep(_module: Any, inputs: tuple) -> None:
            self.images = inputs[0]

        self._handle = module.register_forward_pre_hook(keep)
        return self

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def penalty(self, maps: Any) -> Any:
        if self.images is None or self.images.shape[0] != maps.shape[0]:
            raise ValueError(f"NoPeek: the watched model's last input ({None if self.images is None else tuple(self.images.shape)}) "
                             f"is not the batch of these maps {tuple(maps.shape)}")
        return self.alpha * distance_correlation(self.images.to(maps.device), maps)
