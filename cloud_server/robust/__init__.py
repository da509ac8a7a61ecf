"""Robustness to a bad device, by its public names: robust aggregation rules, plausibility
checks, screening, and the ledger of refusals, clips, skipped steps and quarantine that the
round records show.

Finite nonsense (an fp16 overflow, a flipped bit, a stale build, malice) passes the
protocol's checks (shapes, dtypes, finiteness) and would go straight into the shared
model. The methods get three answers, all numpy (no torch), each job in its own module;
this one gathers their public names so that ``from cloud_server.robust import ...`` keeps
working (new code imports from the module that does the job):

- :mod:`.config`: the ``[server]`` keys (:class:`RobustnessConfig`, refused at start
  when a rule can never honour them with ``expected_agents``), the bound each rule needs,
  :class:`ImplausibleUploadError`;
- :mod:`.rules`: the aggregation rules over the agents' updates (``mean``,
  ``trimmed_mean``, ``median``, ``krum``, ``multi_krum``; f from ``aggregation_tolerate``;
  the median when a round has too few agents for the rule) and ``clip_update_norm``;
- :mod:`.checks`: the plausibility of an update's norm (against the global model and
  the other agents') and of its direction (its cosine with the round's coordinate-wise
  median update; off by default, as measured);
- :mod:`.screening`: both checks and the quarantine applied to a round's uploads;
- :mod:`.ledger`: :class:`RobustnessLedger`, per round and agent what was refused and
  why, clipped, skipped, which rule ran, and the quarantine.

The checks that need the server's own judgement live beside them and are not gathered here
(the screen imports torch): :mod:`.validation` (the rules, numpy) and
:mod:`.validation_screen` (the server's validation set at work).

docs/configuration.md describes every key and what the measurements say about the defaults.
"""

from __future__ import annotations

from .checks import direction_cosines, implausible_directions, implausible_norms, robust_median
from .config import (
    AGGREGATION_RULES,
    DIRECTION_MIN_AGENTS,
    MAD_TO_SD,
    PLAUSIBLE_MIN_COSINE,
    QUARANTINE_RELEASES,
    ImplausibleUploadError,
    RobustnessConfig,
    minimum_agents,
    tolerated,
)
from .ledger import RobustnessLedger
from .rules import (
    RuleChoice,
    aggregate_vectors,
    choose_rule,
    clip_rows,
    flatten,
    krum_scores,
    robust_state_aggregate,
    unflatten,
)
from .screening import UpdateBlocks, screen_uploads

__all__ = [
    "AGGREGATION_RULES",
    "DIRECTION_MIN_AGENTS",
    "MAD_TO_SD",
    "PLAUSIBLE_MIN_COSINE",
    "QUARANTINE_RELEASES",
    "ImplausibleUploadError",
    "RobustnessConfig",
    "RobustnessLedger",
    "RuleChoice",
    "UpdateBlocks",
    "aggregate_vectors",
    "choose_rule",
    "clip_rows",
    "direction_cosines",
    "flatten",
    "implausible_directions",
    "implausible_norms",
    "krum_scores",
    "minimum_agents",
    "robust_median",
    "robust_state_aggregate",
    "screen_uploads",
    "tolerated",
    "unflatten",
]
