"""Plausibility of the agents' weight updates: their norms and their directions.

* **Norm** (:func:`implausible_norms`): against the current global model
  (``plausible_global_ratio`` x its norm) and, with three or more agents, against the other
  agents' updates this round (above ``plausible_peer_ratio`` x their median *and* above
  median + ``plausible_mad`` x 1.4826 MAD). Only too large is implausible: a small update
  cannot swamp a mean.

* **Direction** (:func:`direction_cosines`, :func:`implausible_directions`): with three or
  more agents, each update's cosine with the coordinate-wise median of the round's updates
  (its own included) must not be below ``plausible_min_cosine``. A norm check cannot see an
  update of honest size pointing the wrong way (a sign flip x4 is 4x an honest norm); the
  median is what the majority agrees on, coordinate by coordinate, and one update cannot move
  it past its neighbours. The agent's own update is in its reference because the
  leave-one-out median of three agents is the mean of the other two, which a flipped update
  dominates: an honest agent would be judged against the attacker. With two agents the median
  is their mean, which the larger update dominates whatever its sign: no check (nor with
  one). A zero update, or a zero median, has no direction and is not judged. Off by default
  (``-1``): under label skew honest agents point away from the median as far as a
  sign-flipped one does (bench/experiments/direction_cosines.toml).

Each check returns agent -> (reason, detail); :mod:`cloud_server.robust.screening` applies
them to a round's uploads and writes the ledger.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .config import DIRECTION_MIN_AGENTS, MAD_TO_SD, RobustnessConfig

__all__ = ["direction_cosines", "implausible_directions", "implausible_norms", "robust_median"]

def robust_median(values: Sequence[float]) -> tuple[float, float]:
    """(median, MAD) of ``values``."""
    a = np.asarray(values, dtype=np.float64)
    med = float(np.median(a))
    return med, float(np.median(np.abs(a - med)))


def implausible_norms(norms: Mapping[str, float], reference_norm: float, cfg: RobustnessConfig,
                      what: str = "update") -> dict[str, tuple[str, str]]:
    """Agent -> (reason, detail) for each update norm in ``norms`` that is implausible:
    above ``plausible_global_ratio`` x ``reference_norm`` (the global model's norm; 0:
    unknown, not checked), or, with three or more agents, far above the others' (the
    module doc). The detail names the figure and the threshold."""
    out: dict[str, tuple[str, str]] = {}
    if reference_norm > 0:
        limit = cfg.plausible_global_ratio * reference_norm
        for agent, norm in norms.items():
            if not norm <= limit:
                out[agent] = ("implausible_norm", f"{what} norm {norm:.4g} > {cfg.plausible_global_ratio:g} x the global "
                                                  f"model's norm {reference_norm:.4g} (= {limit:.4g})")
    if len(norms) >= 3:
        for agent, norm in norms.items():
            if agent in out:
                continue
            # The median and MAD of the *other* agents: one wild value must not set its own yardstick.
            med, mad = robust_median([v for a, v in norms.items() if a != agent])
            limit = max(cfg.plausible_peer_ratio * med, med + cfg.plausible_mad * MAD_TO_SD * mad)
            if not norm <= limit:
                out[agent] = ("implausible_norm", f"{what} norm {norm:.4g} > {limit:.4g} (the other agents' median "
                                                  f"{med:.4g}, MAD {mad:.4g})")
    return out


def direction_cosines(blocks: Iterable[np.ndarray]) -> np.ndarray:
    """Each of K updates' cosine with the coordinate-wise median of the K (its own included),
    over ``blocks``: (K, d_i) arrays, one per tensor, together every entry of the updates
    (block by block, so that no (K, D) copy of a large model is made). (K,): NaN for a zero
    update, every entry NaN when the median is zero (no direction to compare with)."""
    dots: np.ndarray | None = None  # (K,) sum of update . median
    squares: np.ndarray | None = None  # (K,) sum of update^2
    median_square = 0.0
    for block in blocks:
        block = np.asarray(block, dtype=np.float64)
        if block.ndim != 2:
            raise ValueError(f"a block is (agents, entries), got shape {block.shape}")
        median = np.median(block, axis=0)  # (d_i,)
        dots = block @ median if dots is None else dots + block @ median
        sq = np.einsum("ij,ij->i", block, block)
        squares = sq if squares is None else squares + sq
        median_square += float(median @ median)
    if dots is None or squares is None:
        raise ValueError("no blocks: nothing to compare")
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dots / np.sqrt(squares * median_square)
    cos[(squares == 0) | (median_square == 0)] = np.nan
    return np.clip(cos, -1.0, 1.0)


def implausible_directions(cosines: Mapping[str, float], cfg: RobustnessConfig,
                           what: str = "update") -> dict[str, tuple[str, str]]:
    """Agent -> (reason, detail) for each cosine (:func:`direction_cosines`) below
    ``plausible_min_cosine``; none with fewer than three agents, nor for a NaN (no direction).
    Exactly the threshold is plausible. The detail names the figure and the threshold."""
    if len(cosines) < DIRECTION_MIN_AGENTS:
        return {}
    limit = cfg.plausible_min_cosine
    return {agent: ("implausible_direction",
                    f"{what}'s cosine with the coordinate-wise median of the round's {len(cosines)} updates is "
                    f"{cos:.3f} < plausible_min_cosine {limit:g}")
            for agent, cos in cosines.items() if math.isfinite(cos) and cos < limit}
