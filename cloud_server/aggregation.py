"""Aggregation of model states, shared by FedAvg and the methods built on it
(FedGKD, FedDistill, FedBE average weights the same way).

A state is a ``name -> numpy array`` mapping as :func:`models.state_dict_to_arrays`
gives: parameters *and* buffers. BatchNorm's buffers are handled explicitly:

* ``running_mean`` and ``running_var`` (floats) are averaged with the same
  sample weights as the parameters. The averaged variance is the mean of the
  agents' variances, not the variance of the union of their data (that would
  add the spread of the agents' means); this is what FedAvg does in FedML and
  Flower, and the statistics are re-estimated by every agent's next round of
  training anyway.
* ``num_batches_tracked`` (an integer counter) is averaged with the same
  weights and rounded to the nearest integer. It only matters for BatchNorm
  with ``momentum=None`` (a cumulative average, where it sets the horizon);
  the weighted mean keeps the global model's horizon that of a typical agent,
  whereas a sum would grow with the number of agents.

Accumulation is in float64 whatever the input dtype, so the result does not
depend on the order of the agents beyond float64 rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["AggregationError", "build_sampled_state", "fit_diagonal_gaussian", "sample_dirichlet", "sample_gaussian", "weighted_mean"]


class AggregationError(ValueError):
    """States that cannot be averaged: no states, bad weights, or mismatched names, shapes or dtypes."""


def weighted_mean(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """``sum_k w_k * state_k / sum_k w_k`` per entry (FedAvg: ``w_k`` = agent k's sample count).

    Floats keep their dtype; integers are rounded to the nearest integer
    (``np.rint``: halves to even) and keep theirs.
    Every state must have the same names, shapes and dtype kinds as the first.
    """
    if not states:
        raise AggregationError("nothing to average: no states")
    if len(states) != len(weights):
        raise AggregationError(f"{len(states)} states but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)  # (K,)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    w = w / w.sum()
    reference = states[0]
    for k, state in enumerate(states[1:], start=1):
        if set(state) != set(reference):
            missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
            raise AggregationError(f"state {k} differs from state 0: missing {missing}, extra {extra}")
    out: dict[str, np.ndarray] = {}
    for name, first in reference.items():
        kind = "i" if first.dtype.kind in "iu" else first.dtype.kind
        if kind not in "fi":
            raise AggregationError(f"{name!r}: cannot average dtype {first.dtype}")
        total = np.zeros(first.shape, dtype=np.float64)
        for k, state in enumerate(states):
            array = np.asarray(state[name])
            if array.shape != first.shape:
                raise AggregationError(f"{name!r}: state {k} has shape {array.shape}, state 0 has {first.shape}")
            if ("i" if array.dtype.kind in "iu" else array.dtype.kind) != kind:
                raise AggregationError(f"{name!r}: state {k} is {array.dtype}, state 0 is {first.dtype}")
            total += w[k] * array.astype(np.float64)
        out[name] = (np.rint(total) if kind == "i" else total).astype(first.dtype)
    return out


# --------------------------------------------------------------------------- #
# Distributions over client states (FedBE's global model distribution, Eq. 5 and Eq. 7)
# --------------------------------------------------------------------------- #


def fit_diagonal_gaussian(
    states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], names: Iterable[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Eq. 5: ``mu = sum_i (|D_i|/|D|) w_i`` and ``Sigma_diag = sum_i (|D_i|/|D|) (w_i - mu)^2``
    (element-wise), for the float entries ``names``. Returned as float64 (mean, variance).
    """
    selected = [{n: np.asarray(s[n], dtype=np.float64) for n in names} for s in states]
    mean = weighted_mean(selected, weights)  # validates names, shapes and weights
    squared = [{n: (s[n] - mean[n]) ** 2 for n in mean} for s in selected]
    return mean, weighted_mean(squared, weights)


def sample_gaussian(
    mean: Mapping[str, np.ndarray], variance: Mapping[str, np.ndarray], rng: np.random.Generator, scale: float = 1.0
) -> dict[str, np.ndarray]:
    """One draw ``w ~ N(mean, scale * diag(variance))``, float64 per entry."""
    return {n: m + np.sqrt(scale * variance[n]) * rng.standard_normal(m.shape) for n, m in mean.items()}


def sample_dirichlet(
    states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], alpha: float, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Eq. 7: ``gamma ~ Dir(alpha * 1)`` and ``w = sum_i gamma_i |D_i| w_i / sum_i' gamma_i' |D_i'|``.

    Returns (w, gamma). Every entry (BN buffers included) is the same convex combination.
    """
    gamma = rng.dirichlet(np.full(len(states), alpha))  # (K,) on the simplex
    return weighted_mean(states, gamma * np.asarray(weights, dtype=np.float64)), gamma


def build_sampled_state(
    template: Mapping[str, np.ndarray], sampled: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A full state: ``sampled`` entries cast to the template's dtypes, the rest from ``template``."""
    return {n: (np.asarray(sampled[n]).astype(a.dtype) if n in sampled else a) for n, a in template.items()}
