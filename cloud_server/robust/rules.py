"""Robust aggregation of weight updates (``[server] aggregation``) and clipping, over the
flattened float entries of the agents' updates (K agents, D values):

- ``mean``: the sample-weighted mean (FedAvg, the papers'; the default);
- ``trimmed_mean``: coordinate-wise, the f largest and f smallest values dropped, the
  rest averaged unweighted (Yin et al. 2018); needs n >= 2f + 1;
- ``median``: the coordinate-wise median, unweighted (Yin et al. 2018; an even n
  takes the mean of the two middle values); tolerates f < n / 2;
- ``krum``: the one update with the smallest score, the sum of squared distances to
  its n - f - 2 nearest neighbours (Blanchard et al. 2017); needs n >= 2f + 3; ties go
  to the first agent in agent-id order;
- ``multi_krum``: the sample-weighted mean of the m = n - f updates with the smallest
  Krum scores; same bound.

f is ``aggregation_tolerate``: a count (an integer >= 1) or a fraction of the round's
agents (0 < x < 0.5, f = floor(x n)). A round that has fewer agents than the rule needs
(agents dropped out) falls back to the median, which the round record says
(``robustness.aggregation``). ``clip_update_norm`` (> 0) scales every update whose L2 norm
exceeds it down to it before the rule (Sun et al. 2019). Integer buffers (BatchNorm's
``num_batches_tracked``) take the rounded weighted mean of the agents the rule used (all
but Krum's discarded ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..aggregation import AggregationError, weighted_mean
from .config import AGGREGATION_RULES, RobustnessConfig, minimum_agents, tolerated

__all__ = [
    "RuleChoice",
    "aggregate_vectors",
    "choose_rule",
    "clip_rows",
    "flatten",
    "krum_scores",
    "robust_state_aggregate",
    "unflatten",
]

@dataclass(frozen=True)
class RuleChoice:
    rule: str  # the rule that runs
    f: int
    fallback: str = ""  # why another rule than the configured one runs ("" if none)


def choose_rule(rule: str, n: int, tolerate: float) -> RuleChoice:
    """The rule a round of ``n`` agents runs: ``rule``, or the median when ``n`` is below
    ``rule``'s bound (agents dropped out); a median below its own bound still runs and says so."""
    f = tolerated(n, tolerate)
    need = minimum_agents(rule, f)
    if n >= need:
        return RuleChoice(rule, f)
    if rule == "median":
        return RuleChoice("median", f, f"{n} agents: the median tolerates fewer than f = {f} bad agents (needs {need})")
    why = f"{n} agents, {rule} with f = {f} needs {need}: the median instead"
    return RuleChoice("median", f, why)


def krum_scores(vectors: np.ndarray, f: int) -> np.ndarray:
    """Krum's score per row of ``vectors`` (K, D): the sum of squared distances to its
    ``K - f - 2`` nearest other rows (at least 1 neighbour counted while K >= 2)."""
    k = len(vectors)
    if k == 1:
        return np.zeros(1)
    sq = np.sum(vectors**2, axis=1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * vectors @ vectors.T, 0.0)  # (K, K)
    np.fill_diagonal(d2, np.inf)
    neighbours = max(1, k - f - 2)
    return np.sort(d2, axis=1)[:, :neighbours].sum(axis=1)


def aggregate_vectors(vectors: np.ndarray, weights: Sequence[float], rule: str, f: int) -> tuple[np.ndarray, list[int]]:
    """``rule`` over ``vectors`` (K, D) float64: (the aggregate (D,), the rows it used).

    ``weights`` (sample counts) weigh ``mean`` and ``multi_krum``'s mean; the
    coordinate-wise rules are unweighted, as in Yin et al."""
    k = len(vectors)
    if k == 0:
        raise AggregationError("nothing to aggregate: no updates")
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != k or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(f"weights must be {k} finite values >= 0, not all 0, got {list(weights)}")
    everyone = list(range(k))
    if rule == "mean":
        return (w[:, None] * vectors).sum(axis=0) / w.sum(), everyone
    if rule == "median":
        return np.median(vectors, axis=0), everyone
    if rule == "trimmed_mean":
        if k <= 2 * f:
            raise AggregationError(f"trimmed mean of {k} updates cannot drop {f} at each end")
        ordered = np.sort(vectors, axis=0)
        return ordered[f : k - f].mean(axis=0), everyone
    if rule in ("krum", "multi_krum"):
        scores = krum_scores(vectors, f)
        order = np.argsort(scores, kind="stable")  # ties: the first in agent-id order
        if rule == "krum":
            best = int(order[0])
            return vectors[best].copy(), [best]
        chosen = sorted(int(i) for i in order[: max(1, k - f)])
        wc = w[chosen]
        if wc.sum() <= 0:
            wc = np.ones(len(chosen))
        return (wc[:, None] * vectors[chosen]).sum(axis=0) / wc.sum(), chosen
    raise AggregationError(f"unknown aggregation rule {rule!r}; the rules are {AGGREGATION_RULES}")


def clip_rows(vectors: np.ndarray, max_norm: float) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """Rows of ``vectors`` (K, D) with an L2 norm above ``max_norm`` scaled down to it
    (``max_norm`` 0: unchanged): (the rows, [(row, its norm before)] for the clipped ones)."""
    if not max_norm:
        return vectors, []
    norms = np.linalg.norm(vectors, axis=1)
    clipped = [(int(i), float(norms[i])) for i in np.nonzero(norms > max_norm)[0]]
    if not clipped:
        return vectors, []
    out = vectors.copy()
    for i, norm in clipped:
        out[i] *= max_norm / norm
    return out, clipped


def flatten(state: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(state[n], dtype=np.float64).ravel() for n in names]) if names else np.zeros(0)


def unflatten(vector: np.ndarray, template: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for n in names:
        size = template[n].size
        out[n] = vector[start : start + size].reshape(template[n].shape)
        start += size
    return out


def robust_state_aggregate(
    global_state: Mapping[str, np.ndarray], states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
    cfg: RobustnessConfig,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The new global state from the agents' states by ``cfg``'s rule over their updates
    (state - global): (state, figures: rule, f, fallback, used rows, clipped rows)."""
    floats = [n for n, a in global_state.items() if a.dtype.kind == "f"]
    ints = [n for n in global_state if n not in floats]
    base = flatten(global_state, floats)  # (D,)
    updates = np.stack([flatten(s, floats) - base for s in states])  # (K, D)
    updates, clipped = clip_rows(updates, cfg.clip_update_norm)
    choice = choose_rule(cfg.aggregation, len(states), cfg.aggregation_tolerate)
    agg, used = aggregate_vectors(updates, weights, choice.rule, choice.f)
    new = unflatten(base + agg, global_state, floats)
    out = {n: new[n].astype(global_state[n].dtype) for n in floats}
    if ints:
        used_w = [weights[i] for i in used]
        if sum(used_w) <= 0:
            used_w = [1.0] * len(used)
        out.update(weighted_mean([{n: states[i][n] for n in ints} for i in used], used_w))
    figures = {"rule": choice.rule, "f": choice.f, "fallback": choice.fallback, "used": used, "clipped": clipped}
    return {n: out[n] for n in global_state}, figures

