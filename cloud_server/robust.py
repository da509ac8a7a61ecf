"""Robustness to a bad device: robust aggregation rules, plausibility checks and the
ledger of refusals, clips, skipped steps and quarantine that the round records show.

Finite nonsense (an fp16 overflow, a flipped bit, a stale build, malice) passes the
protocol's checks (shapes, dtypes, finiteness) and would go straight into the shared
model. This module gives the methods three answers, all numpy (no torch):

* **Robust aggregation** of weight updates (``[server] aggregation``), over the
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
  agents (0 < x < 0.5, f = floor(x n)). A configuration the rule can never honour
  with ``expected_agents`` is refused when the server starts; a round that has fewer
  agents than the rule needs (agents dropped out) falls back to the median, which the
  round record says (``robustness.aggregation``). ``clip_update_norm`` (> 0) scales
  every update whose L2 norm exceeds it down to it before the rule (Sun et al. 2019).
  Integer buffers (BatchNorm's ``num_batches_tracked``) take the rounded weighted mean
  of the agents the rule used (all but Krum's discarded ones).

* **Plausibility** of an update's norm (:func:`implausible_norms`): against the
  current global model (``plausible_global_ratio`` x its norm) and, with three or more
  agents, against the other agents' updates this round (above ``plausible_peer_ratio``
  x their median *and* above median + ``plausible_mad`` x 1.4826 MAD). Only too large is
  implausible: a small update cannot swamp a mean.

* **Plausibility** of an update's direction (:func:`direction_cosines`,
  :func:`implausible_directions`): with three or more agents, each update's cosine with the
  coordinate-wise median of the round's updates (its own included) must not be below
  ``plausible_min_cosine``. A norm check cannot see an update of honest size pointing the
  wrong way (a sign flip x4 is 4x an honest norm); the median is what the majority agrees on,
  coordinate by coordinate, and one update cannot move it past its neighbours. The agent's own
  update is in its reference because the leave-one-out median of three agents is the mean of
  the other two, which a flipped update dominates: an honest agent would be judged against
  the attacker. With two agents the median is their mean, which the larger update dominates
  whatever its sign: no check (nor with one). A zero update, or a zero median, has no
  direction and is not judged. Off by default (``-1``): under label skew honest agents point
  away from the median as far as a sign-flipped one does (bench/update_directions.py).

* The :class:`RobustnessLedger`: per round and agent, what was refused and why (the
  first figure and threshold, logged once per agent, round and reason), what was
  clipped, which server steps were skipped, which rule ran; and quarantine: an agent
  refused as implausible in ``quarantine_after`` consecutive rounds is excluded until a
  round in which all its uploads were plausible (``quarantine_release = "plausible"``,
  used again from the round after) or for the run (``"never"``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared_protocol.errors import ProtocolError

from .aggregation import AggregationError, weighted_mean

log = logging.getLogger("cloud_server.robust")

__all__ = [
    "AGGREGATION_RULES",
    "QUARANTINE_RELEASES",
    "ImplausibleUploadError",
    "RobustnessConfig",
    "RuleChoice",
    "RobustnessLedger",
    "aggregate_vectors",
    "choose_rule",
    "clip_rows",
    "direction_cosines",
    "implausible_directions",
    "implausible_norms",
    "krum_scores",
    "robust_median",
    "robust_state_aggregate",
    "tolerated",
]

AGGREGATION_RULES = ("mean", "trimmed_mean", "median", "krum", "multi_krum")
QUARANTINE_RELEASES = ("plausible", "never")
MAD_TO_SD = 1.4826  # MAD x this estimates the standard deviation of a normal sample
# The default of ``plausible_min_cosine``: -1, off; why, in RobustnessConfig.
PLAUSIBLE_MIN_COSINE = -1.0
DIRECTION_MIN_AGENTS = 3  # with two, the median is their mean: the larger update sets it, whatever its sign


class ImplausibleUploadError(ProtocolError):
    """An upload that decodes and validates but whose numbers cannot be honest (refused
    at the door). ``reason`` is the specific code: ``out_of_range``, ``implausible_norm``,
    ``implausible_factors``, ``implausible_statistics``..."""

    code = "implausible"

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- #
# configuration
# --------------------------------------------------------------------------- #


def _minimum_agents(rule: str, f: int) -> int:
    """The fewest agents ``rule`` needs to tolerate ``f`` bad ones."""
    if rule in ("krum", "multi_krum"):
        return 2 * f + 3
    if rule in ("trimmed_mean", "median"):
        return 2 * f + 1
    return 1


def tolerated(n: int, tolerate: float) -> int:
    """f for a round of ``n`` agents: ``tolerate`` itself when it is a count (>= 1), else
    ``floor(tolerate * n)``."""
    return int(tolerate) if tolerate >= 1 else int(math.floor(tolerate * n + 1e-9))


@dataclass(frozen=True)
class RobustnessConfig:
    """The ``[server]`` keys of this module (see the module doc and docs/configuration.md)."""

    aggregation: str = "mean"
    aggregation_tolerate: float = 0
    clip_update_norm: float = 0.0  # 0: no clipping
    plausibility_checks: bool = True
    plausible_global_ratio: float = 10.0
    plausible_peer_ratio: float = 50.0
    plausible_mad: float = 6.0
    # An update whose cosine with the coordinate-wise median of the round's updates (three
    # or more agents) is below this is refused (implausible_direction); -1: off (no cosine is
    # below -1), the figures are still recorded (robustness.update_directions). Off by
    # default, measured (bench/results/update_directions.json; docs/configuration.md): honest
    # agents under label skew point away from the median (5 agents, FedAvg and FedGKD, seeds
    # 0 and 1: lowest honest cosine -0.165 at Dirichlet(0.1), -0.626 at Dirichlet(0.5); 0.636
    # at IID), as far as a sign-flipped agent does after round 1 (up to -0.21 at
    # Dirichlet(0.1), +0.32 at Dirichlet(0.5)), so no threshold stops the flip without refusing
    # honest agents. At IID the flipped agent stays at -0.83 and below: a fleet whose data is
    # close to IID may set 0.
    plausible_min_cosine: float = PLAUSIBLE_MIN_COSINE
    feature_abs_limit: float = 1.0e4  # FedGKT feature maps: |H| above this is out of range
    logit_abs_limit: float = 1.0e4  # FedGKT edge logits: |z_c| above this is out of range
    quarantine_after: int = 3  # 0: no quarantine
    quarantine_release: str = "plausible"
    server_grad_clip_norm: float = 0.0  # 0: the server's training steps are not clipped
    server_loss_skip_factor: float = 0.0  # 0: no step is skipped for its loss (non-finite ones always are)
    expected_agents: int = 1  # from [server], for the bound check

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATION_RULES:
            raise ValueError(f"server.aggregation must be one of {AGGREGATION_RULES}, got {self.aggregation!r}")
        t = self.aggregation_tolerate
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 or (t >= 1 and float(t) != int(t)) or (0 < t < 1 and t >= 0.5):
            raise ValueError("server.aggregation_tolerate must be a count of bad agents (an integer >= 1), a fraction "
                             f"in (0, 0.5), or 0 (none), got {t!r}")
        if self.aggregation == "trimmed_mean" and t == 0:
            raise ValueError("server.aggregation = 'trimmed_mean' trims f agents at each end: set "
                             "server.aggregation_tolerate to a count >= 1 or a fraction in (0, 0.5)")
        if self.aggregation != "mean" or t:
            f = tolerated(self.expected_agents, t)
            need = _minimum_agents(self.aggregation, f)
            if self.expected_agents < need:
                raise ValueError(
                    f"server.aggregation = {self.aggregation!r} with server.aggregation_tolerate = {t!r} (f = {f}) needs "
                    f"at least {need} agents per round, server.expected_agents is {self.expected_agents}: raise "
                    f"expected_agents, lower aggregation_tolerate, or choose another rule"
                )
        positive = {"plausible_global_ratio": self.plausible_global_ratio, "plausible_peer_ratio": self.plausible_peer_ratio,
                    "plausible_mad": self.plausible_mad, "feature_abs_limit": self.feature_abs_limit,
                    "logit_abs_limit": self.logit_abs_limit}
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"server.{name} must be a finite number > 0, got {value!r}")
        c = self.plausible_min_cosine
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not -1 <= c < 1:
            raise ValueError(f"server.plausible_min_cosine must be a number in [-1, 1) (-1: off), got {c!r}")
        for name in ("clip_update_norm", "server_grad_clip_norm", "server_loss_skip_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"server.{name} must be a finite number >= 0 (0: off), got {value!r}")
        if 0 < self.server_loss_skip_factor <= 1:
            raise ValueError(f"server.server_loss_skip_factor must be 0 (off) or > 1, got {self.server_loss_skip_factor}")
        if not isinstance(self.quarantine_after, int) or self.quarantine_after < 0:
            raise ValueError(f"server.quarantine_after must be an integer >= 0 (0: no quarantine), got {self.quarantine_after!r}")
        if self.quarantine_release not in QUARANTINE_RELEASES:
            raise ValueError(f"server.quarantine_release must be one of {QUARANTINE_RELEASES}, got {self.quarantine_release!r}")

    @property
    def plain_mean(self) -> bool:
        """The papers' aggregation: the weighted mean, nothing clipped."""
        return self.aggregation == "mean" and not self.clip_update_norm


# --------------------------------------------------------------------------- #
# rules
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class RuleChoice:
    rule: str  # the rule that runs
    f: int
    fallback: str = ""  # why another rule than the configured one runs ("" if none)


def choose_rule(rule: str, n: int, tolerate: float) -> RuleChoice:
    """The rule a round of ``n`` agents runs: ``rule``, or the median when ``n`` is below
    ``rule``'s bound (agents dropped out); a median below its own bound still runs and says so."""
    f = tolerated(n, tolerate)
    need = _minimum_agents(rule, f)
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


# Agents -> per tensor, the (agents, entries) block of their updates (float64): see direction_cosines.
UpdateBlocks = Callable[[Sequence[str]], Iterable[np.ndarray]]


def screen_uploads(round_: int, used: dict[str, Any], excluded: dict[str, str], cfg: RobustnessConfig,
                   ledger: "RobustnessLedger", measure: Callable[[], tuple[dict[str, float], float]],
                   blocks: UpdateBlocks | None = None,
                   judge: Callable[[list[str]], dict[str, tuple[str, str]]] | None = None) -> dict[str, Any]:
    """Plausibility and quarantine for a weight-sharing method's usable uploads (agent ->
    upload): ``measure()`` gives each agent's update norm and the reference norm (0: none),
    ``blocks(agents)`` the updates of those agents for the direction check (None: no check);
    an implausible update is refused (to the ledger, and ``excluded`` with its reason), a
    quarantined agent's is judged but not used. Returns ``used`` without them.

    The direction is judged among the updates whose norm was plausible (a x1e3 update has
    been refused already and takes no part in the median)."""
    if cfg.plausibility_checks and used:
        norms, reference = measure()
        ledger.norms(round_, norms, reference)
        refusals = implausible_norms(norms, reference, cfg)
        left = [a for a in used if a not in refusals]
        if blocks is not None and len(left) >= DIRECTION_MIN_AGENTS:
            cos = direction_cosines(blocks(left))
            cosines = {a: float(c) for a, c in zip(left, cos)}
            ledger.directions(round_, cosines)
            refusals.update(implausible_directions(cosines, cfg))
        if judge is not None:  # more checks of the rest (cloud_server/robust_validation.py)
            refusals.update(judge([a for a in used if a not in refusals]))
        for agent, (reason, detail) in refusals.items():
            ledger.refuse(round_, agent, reason, detail)
            excluded[agent] = f"{reason}: {detail}"
            used.pop(agent)
    for agent in [a for a in used if ledger.is_quarantined(a)]:
        excluded[agent] = ledger.exclude_quarantined(round_, agent)
        used.pop(agent)
    return used


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


# --------------------------------------------------------------------------- #
# the ledger
# --------------------------------------------------------------------------- #


@dataclass
class _RoundEntry:
    refused: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # agent -> reason -> {count, detail}
    clipped: dict[str, dict[str, int]] = field(default_factory=dict)  # agent -> what -> count
    skipped_steps: dict[str, int] = field(default_factory=dict)  # agent -> server steps skipped on its data
    aggregation: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    quarantine_excluded: list[str] = field(default_factory=list)
    update_norms: dict[str, float] = field(default_factory=dict)  # agent -> its update's L2 norm, as screened
    reference_norm: float = 0.0  # the global model's norm the updates were screened against (0: none)
    update_cosines: dict[str, float] = field(default_factory=dict)  # agent -> cosine with the round's median update
    sections: dict[str, Any] = field(default_factory=dict)  # more checks' figures (record), key -> section, verbatim


class RobustnessLedger:
    """Per round: refusals, clips, skipped steps and the aggregation rule that ran; and
    the quarantine. Methods and the coordinator write it; the coordinator takes a round's
    entry (:meth:`take`) when the round closes."""

    def __init__(self, cfg: RobustnessConfig | None = None) -> None:
        self.cfg = cfg or RobustnessConfig()
        self._rounds: dict[int, _RoundEntry] = {}
        self.streaks: dict[str, int] = {}  # agent -> consecutive closed rounds with a refusal
        self.quarantined: dict[str, dict[str, Any]] = {}  # agent -> {"since": round, "why": str}
        self.history: list[dict[str, Any]] = []  # quarantine events: {"round", "agent", "event", "why"}

    def _entry(self, round_: int) -> _RoundEntry:
        return self._rounds.setdefault(round_, _RoundEntry())

    def refuse(self, round_: int, agent: str, reason: str, detail: str) -> None:
        by_reason = self._entry(round_).refused.setdefault(agent, {})
        if reason not in by_reason:
            by_reason[reason] = {"count": 0, "detail": detail}
            log.warning("round %d: refused %s's upload as implausible (%s): %s", round_, agent, reason, detail)
        by_reason[reason]["count"] += 1

    def norms(self, round_: int, norms: Mapping[str, float], reference_norm: float) -> None:
        """The update norms the plausibility check judged (recorded whether refused or not:
        what a user needs to set the thresholds for their fleet, and what bench/robustness.py
        reads for the honest agents' spread)."""
        entry = self._entry(round_)
        entry.update_norms.update({a: float(v) for a, v in norms.items()})
        entry.reference_norm = float(reference_norm)

    def directions(self, round_: int, cosines: Mapping[str, float]) -> None:
        """The cosines the direction check judged (recorded whether refused or not, and when
        the check is off: what a user needs to set ``plausible_min_cosine`` for their fleet;
        bench/update_directions.py reads them)."""
        self._entry(round_).update_cosines.update({a: float(v) for a, v in cosines.items()})

    def record(self, round_: int, key: str, section: Mapping[str, Any]) -> None:
        """Another check's figures, as the round's ``robustness[key]`` (strict JSON)."""
        self._entry(round_).sections[key] = dict(section)

    def refused_in(self, round_: int, agent: str) -> bool:
        entry = self._rounds.get(round_)
        return entry is not None and agent in entry.refused

    def clip(self, round_: int, agent: str, what: str, detail: str = "") -> None:
        counts = self._entry(round_).clipped.setdefault(agent, {})
        if what not in counts and detail:
            log.info("round %d: clipped %s's %s: %s", round_, agent, what, detail)
        counts[what] = counts.get(what, 0) + 1

    def skip_step(self, round_: int, agent: str, detail: str) -> None:
        steps = self._entry(round_).skipped_steps
        if agent not in steps:
            log.warning("round %d: skipped a server step on %s's data: %s", round_, agent, detail)
        steps[agent] = steps.get(agent, 0) + 1

    def aggregation(self, round_: int, figures: Mapping[str, Any]) -> None:
        self._entry(round_).aggregation = dict(figures)
        if figures.get("fallback"):
            self.warn(round_, f"aggregation: {figures['fallback']}")

    def warn(self, round_: int, text: str) -> None:
        log.warning("round %d: %s", round_, text)
        self._entry(round_).warnings.append(text)

    # -- quarantine --------------------------------------------------------- #

    def is_quarantined(self, agent: str) -> bool:
        return agent in self.quarantined

    def exclude_quarantined(self, round_: int, agent: str) -> str:
        """The reason a quarantined agent's upload is not used in ``round_`` (and note it)."""
        entry = self._entry(round_)
        if agent not in entry.quarantine_excluded:
            entry.quarantine_excluded.append(agent)
        q = self.quarantined[agent]
        return f"quarantined since round {q['since']} ({q['why']})"

    def close_round(self, round_: int, judged: Sequence[str]) -> None:
        """Update the quarantine after ``round_``: ``judged`` are the agents whose uploads
        the round examined (they finished it); an agent that was not judged keeps its state."""
        cfg = self.cfg
        entry = self._rounds.get(round_) or _RoundEntry()
        for agent in judged:
            refused = agent in entry.refused
            self.streaks[agent] = self.streaks.get(agent, 0) + 1 if refused else 0
            if agent in self.quarantined:
                if not refused and cfg.quarantine_release == "plausible":
                    del self.quarantined[agent]
                    self.history.append({"round": round_, "agent": agent, "event": "released",
                                         "why": "its uploads were plausible again"})
                    log.warning("round %d: %s sent plausible data again; it leaves quarantine", round_, agent)
                continue
            if cfg.quarantine_after and self.streaks[agent] >= cfg.quarantine_after:
                reasons = ", ".join(sorted(entry.refused[agent]))
                why = f"refused as implausible in {self.streaks[agent]} consecutive rounds (last: {reasons})"
                self.quarantined[agent] = {"since": round_ + 1, "why": why}
                self.history.append({"round": round_, "agent": agent, "event": "quarantined", "why": why})
                until = "for the rest of the run" if cfg.quarantine_release == "never" else "until it sends plausible data"
                log.error("round %d: quarantining %s %s: %s", round_, agent, until, why)

    def take(self, round_: int) -> tuple[dict[str, Any], list[str]]:
        """(the round record's ``robustness`` section, its warnings); empty when nothing happened
        and no update was screened (``update_norms``: the norms judged, every screened round;
        ``update_directions``: the cosines judged, every screened round with three or more agents)."""
        entry = self._rounds.pop(round_, None) or _RoundEntry()
        section: dict[str, Any] = {}
        if entry.refused:
            section["refused"] = {a: {r: dict(v) for r, v in reasons.items()} for a, reasons in sorted(entry.refused.items())}
        if entry.clipped:
            section["clipped"] = {a: dict(c) for a, c in sorted(entry.clipped.items())}
        if entry.skipped_steps:
            section["skipped_steps"] = dict(sorted(entry.skipped_steps.items()))
        if entry.quarantine_excluded:
            section["quarantine_excluded"] = sorted(entry.quarantine_excluded)
        if entry.update_norms:
            section["update_norms"] = {"reference": entry.reference_norm,
                                       "agents": {a: round(v, 6) for a, v in sorted(entry.update_norms.items())}}
        if entry.update_cosines:
            # NaN (no direction) is written as null: report.json is strict JSON.
            section["update_directions"] = {
                "reference": "coordinate-wise median of the round's updates",
                "threshold": self.cfg.plausible_min_cosine,
                "agents": {a: (round(v, 6) if math.isfinite(v) else None) for a, v in sorted(entry.update_cosines.items())}}
        section.update(entry.sections)
        events = [e for e in self.history if e["round"] == round_]
        if events:
            section["quarantine_events"] = events
        if self.quarantined:
            section["quarantined"] = {a: dict(q) for a, q in sorted(self.quarantined.items())}
        if entry.aggregation and (entry.aggregation.get("rule") != "mean" or entry.aggregation.get("fallback")
                                  or self.cfg.aggregation != "mean"):
            section["aggregation"] = entry.aggregation
        warnings = list(entry.warnings)
        for agent, reasons in section.get("refused", {}).items():
            counts = ", ".join(f"{r} x{v['count']}" for r, v in reasons.items())
            warnings.append(f"refused {agent}'s upload as implausible ({counts})")
        for agent, counts in section.get("clipped", {}).items():
            clips = ", ".join(f"{w} x{n}" for w, n in counts.items())
            warnings.append(f"clipped {agent}'s {clips}")
        for agent, n in section.get("skipped_steps", {}).items():
            warnings.append(f"skipped {n} server step(s) on {agent}'s data")
        for agent in section.get("quarantine_excluded", []):
            warnings.append(f"{agent} is quarantined: its upload was not used")
        return section, warnings

    # -- checkpoints -------------------------------------------------------- #

    def state(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks), "quarantined": {a: dict(q) for a, q in self.quarantined.items()},
                "history": list(self.history)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.streaks = {str(a): int(n) for a, n in state.get("streaks", {}).items()}
        self.quarantined = {str(a): {"since": int(q["since"]), "why": str(q["why"])} for a, q in state.get("quarantined", {}).items()}
        self.history = [dict(e) for e in state.get("history", [])]
