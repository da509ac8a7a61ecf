"""Screening a round's uploads: the plausibility checks (:mod:`cloud_server.robust.checks`)
and the quarantine (:class:`cloud_server.robust.ledger.RobustnessLedger`) applied to a
weight-sharing method's usable uploads, before its aggregation rule runs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import direction_cosines, implausible_directions, implausible_norms
from .config import DIRECTION_MIN_AGENTS, PLAUSIBLE_MIN_COSINE, RobustnessConfig

if TYPE_CHECKING:
    from .ledger import RobustnessLedger

__all__ = ["UpdateBlocks", "screen_uploads"]


# Agents -> per tensor, the (agents, entries) block of their updates (float64): see direction_cosines.
UpdateBlocks = Callable[[Sequence[str]], Iterable[np.ndarray]]


def screen_uploads(round_: int, used: dict[str, Any], excluded: dict[str, str], cfg: RobustnessConfig,
                   ledger: "RobustnessLedger", measure: Callable[[], tuple[dict[str, float], float]],
                   blocks: UpdateBlocks | None = None,
                   judge: Callable[[list[str]], dict[str, tuple[str, str]]] | None = None) -> dict[str, Any]:
    """Plausibility and quarantine for a weight-sharing method's usable uploads (agent ->
    upload): ``measure()`` gives each agent's update norm and the reference norm (0: none),
    ``blocks(agents)`` the updates of those agents for the direction check (None: no check),
    ``judge(agents)`` more checks of the agents still plausible (cloud_server/robust/validation.py);
    an implausible update is refused (to the ledger, and ``excluded`` with its reason), a
    quarantined agent's is judged but not used. Each check notes the agents it could judge
    (``ledger.examined``: what quarantine is decided on). Returns ``used`` without them.

    The direction is judged among the updates whose norm was plausible (a x1e3 update has
    been refused already and takes no part in the median)."""
    if cfg.plausibility_checks and used:
        norms, reference = measure()
        ledger.norms(round_, norms, reference)
        refusals = implausible_norms(norms, reference, cfg)
        if reference > 0 or len(norms) >= 3:  # against the global model, or the other agents' norms
            ledger.examined(round_, "implausible_norm", norms)
        left = [a for a in used if a not in refusals]
        if blocks is not None and len(left) >= DIRECTION_MIN_AGENTS:
            cos = direction_cosines(blocks(left))
            cosines = {a: float(c) for a, c in zip(left, cos)}
            ledger.directions(round_, cosines)
            refusals.update(implausible_directions(cosines, cfg))
            if cfg.plausible_min_cosine > PLAUSIBLE_MIN_COSINE:  # on; a zero update has no direction to judge
                ledger.examined(round_, "implausible_direction", [a for a, c in cosines.items() if math.isfinite(c)])
        if judge is not None:  # more checks of the rest (cloud_server/robust/validation.py)
            refusals.update(judge([a for a in used if a not in refusals]))
        for agent, (reason, detail) in refusals.items():
            ledger.refuse(round_, agent, reason, detail)
            excluded[agent] = f"{reason}: {detail}"
            used.pop(agent)
    for agent in [a for a in used if ledger.is_quarantined(a)]:
        excluded[agent] = ledger.exclude_quarantined(round_, agent)
        used.pop(agent)
    return used
