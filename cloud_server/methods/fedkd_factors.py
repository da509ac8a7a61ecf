"""FedKD's SVD factors as the server reads them: their ranks, Eq. 8's K in the round's
history, and the check that refuses factors no SVD produces (cloud_server/robust/)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shared_protocol import svd

from ..robust.config import ImplausibleUploadError

__all__ = ["FACTOR_TOLERANCE", "_check_factors", "_eq8_rank", "_ranks"]


def _ranks(packed: dict[str, svd.SvdTensor]) -> dict[str, int]:
    return {name: p.rank for name, p in packed.items() if p.mode == "factored"}


def _eq8_rank(entry: dict[str, Any], name: str, limit: int, full: int) -> int | None:
    """Eq. 8's K of tensor ``name`` in a history entry (an upload or the aggregate): its
    rank if it went factored, else the K it reported for its dense fallback. An agent
    reports that K itself, so only a value consistent with going dense (above ``limit``,
    at most ``full``) is taken; None if there is none (e.g. no SVD was needed)."""
    if name in entry["ranks"]:
        return int(entry["ranks"][name])
    k = entry["dense_fallback_ranks"].get(name)
    return k if isinstance(k, int) and not isinstance(k, bool) and limit < k <= full else None


# How far an honest float32 factorisation may stray from orthonormal factors and from
# ||U diag(S) V||_F = ||S||_2: numpy's SVD of float64, sent as float32, strays by float32
# rounding only, orders of magnitude below this.
FACTOR_TOLERANCE = 1e-2


def _check_factors(name: str, p: svd.SvdTensor) -> None:
    """Refuse factors that no SVD produces: U's and V's rows/columns orthonormal (their
    squared Frobenius norms equal the rank K), S non-negative, and the rebuilt tensor's
    norm ``||S||_2`` (a huge S is the norm check's, at the round's close)."""
    u, s, v = (np.asarray(a, dtype=np.float64) for a in p.factors())
    k = p.rank
    with np.errstate(over="ignore", invalid="ignore"):
        u2, v2 = float(np.sum(u * u)), float(np.sum(v * v))
    for label, sq in (("U", u2), ("V", v2)):
        if not abs(sq - k) <= FACTOR_TOLERANCE * k:
            raise ImplausibleUploadError(
                "implausible_factors", f"{name!r}: ||{label}||_F^2 = {sq:.4g}, an SVD's orthonormal factors of rank {k} "
                                       f"give {k} (tolerance {FACTOR_TOLERANCE:g} x {k})")
    if np.any(s < 0):
        raise ImplausibleUploadError("implausible_factors", f"{name!r}: negative singular values (min {float(s.min()):.4g})")
