"""Differential privacy on the server: the ``[server]`` ``dp_*`` keys (:class:`PrivacyConfig`),
DP-FedAvg's noised mean of clipped updates (:meth:`PrivacyLedger.noised_mean`), and ε from
Opacus's accountant, per round and for the run (:class:`PrivacyLedger`).

**Client level (DP-FedAvg).** With ``dp_fedavg = "central"`` or ``"client_clipping"`` the new
global state is ``global + (sum_k clip_C(update_k) + N(0, (z C)^2 I)) / n`` over the ``n``
updates aggregated: every agent weighs the same, whatever its sample count (a sample-weighted
mean would let a large agent move the model by more than ``C``; McMahan et al. 2018 and Flower
weigh uniformly too). This replaces ``[server] aggregation`` (only ``mean`` is allowed with it).
ε comes from Opacus's accountant (``dp_accountant``: ``rdp`` or ``prv``) with the noise
multiplier ``z``, the sampling rate ``q = client_fraction`` and one step per round whose
aggregate was noised. Opacus's accountants assume Poisson sampling; the rounds draw a fixed
fraction without replacement (McMahan et al. 2018 account the same way). With
``dp_fedavg = "local"`` every agent noises its own clipped update, so what each agent sends is
private from the server itself: the server knows who took part, so ``q = 1``.

**With secure aggregation** (``[server] secure_aggregation``) the server never sees one update,
so it cannot clip one: ``central`` is refused (cloud_server/config.py). With ``client_clipping``
every agent clips its update to ``C`` and masks it with the weight 1 (a public weight: a sample-
weighted sum would let an agent's share of the sum depend on its data size); the server unmasks
only the sum and adds ``N(0, (z C)^2 I)`` to it (:meth:`PrivacyLedger.noised_secure_mean`). The
denominator is fixed before any update exists: the number of agents the round sampled, an agent
that drops counting as a zero update (McMahan et al.'s fixed-denominator estimator), so one
agent moves the noised sum by at most ``C`` whatever the others do, as the accountant assumes.
With ``local`` the agents clip and noise before masking and the server only unmasks.

**Sample level (DP-SGD).** With ``dpsgd = true`` every agent trains through Opacus
(edge_agent/dpsgd.py) and reports its own accountant's ε (``dpsgd_epsilon`` in its round's
metrics); the run's figure is the largest over the agents.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared_protocol.errors import SecAggError
from shared_protocol.privacy import DP_FEDAVG_MODES, DpAgentSettings, clip_update, float_names, gaussian_noise

__all__ = ["ACCOUNTANTS", "PrivacyConfig", "PrivacyLedger", "check_privacy_section", "client_level_epsilon", "privacy_line"]

log = logging.getLogger("cloud_server.privacy")

ACCOUNTANTS = ("rdp", "prv")


def client_level_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                         accountant: str = "rdp") -> float:
    """ε after ``steps`` sampled Gaussian mechanisms, from Opacus's accountant."""
    from opacus.accountants import create_accountant

    if steps <= 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    for _ in range(steps):
        acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return float(acc.get_epsilon(delta=delta))


@dataclass(frozen=True)
class PrivacyConfig:
    """The ``[server]`` differential-privacy keys (docs/configuration.md, docs/privacy.md)."""

    dp_fedavg: str = "off"
    dp_clip_norm: float = 0.0
    dp_noise_multiplier: float = 0.0
    dp_delta: float = 1e-5
    dp_accountant: str = "rdp"
    dpsgd: bool = False
    dpsgd_noise_multiplier: float = 0.0
    dpsgd_max_grad_norm: float = 1.0
    client_fraction: float = 1.0  # from [server], the sampling rate of central DP-FedAvg
    secure_aggregation: bool = False  # from [server]: the noise goes on the secure sum

    def __post_init__(self) -> None:
        if self.dp_fedavg not in DP_FEDAVG_MODES:
            raise ValueError(f"server.dp_fedavg must be one of {DP_FEDAVG_MODES}, got {self.dp_fedavg!r}")
        if self.dp_accountant not in ACCOUNTANTS:
            raise ValueError(f"server.dp_accountant must be one of {ACCOUNTANTS}, got {self.dp_accountant!r}")
        if not (isinstance(self.dp_delta, float) and 0 < self.dp_delta < 1):
            raise ValueError(f"server.dp_delta must be a number in (0, 1), e.g. 1e-5, got {self.dp_delta!r}")
        if self.dp_fedavg != "off":
            for key in ("dp_clip_norm", "dp_noise_multiplier"):
                value = getattr(self, key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"server.dp_fedavg = {self.dp_fedavg!r} needs server.{key} > 0, got {value!r} "
                                     "(clipping without noise: server.clip_update_norm)")
        if not isinstance(self.dpsgd, bool):
            raise ValueError(f"server.dpsgd must be true or false, got {self.dpsgd!r}")
        if self.dpsgd:
            for key in ("dpsgd_noise_multiplier", "dpsgd_max_grad_norm"):
                value = getattr(self, key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"server.dpsgd = true needs server.{key} > 0, got {value!r}")

    @property
    def on(self) -> bool:
        return self.dp_fedavg != "off" or self.dpsgd

    @property
    def server_noises(self) -> bool:
        """Whether the server clips and noises the aggregate (central and client-side clipping)."""
        return self.dp_fedavg in ("central", "client_clipping")

    @property
    def sample_rate(self) -> float:
        return 1.0 if self.dp_fedavg == "local" else self.client_fraction

    def agent_settings(self) -> DpAgentSettings:
        return DpAgentSettings(mode=self.dp_fedavg, clip_norm=float(self.dp_clip_norm),
                               noise_multiplier=float(self.dp_noise_multiplier), dpsgd=self.dpsgd,
                               dpsgd_noise_multiplier=float(self.dpsgd_noise_multiplier),
                               dpsgd_max_grad_norm=float(self.dpsgd_max_grad_norm), delta=self.dp_delta,
                               accountant=self.dp_accountant)


class PrivacyLedger:
    """The run's DP state: the noised mean the weight-sharing methods call, the accountant's
    steps, and the figures the round records and the report's ``privacy`` section show."""

    def __init__(self, cfg: PrivacyConfig | None = None, rng: np.random.Generator | None = None) -> None:
        self.cfg = cfg or PrivacyConfig()
        # OS entropy: the noise must not be reproducible from the run's seed by whoever reads the config.
        self.rng = rng if rng is not None else np.random.default_rng()
        self.noised_rounds = 0
        self.local_rounds: dict[str, int] = {}  # local mode: the rounds each agent sent a noised update in
        self._round: dict[int, dict[str, Any]] = {}
        self.epsilon_by_round: dict[int, float] = {}
        self.dpsgd_by_agent: dict[str, dict[str, float]] = {}

    def check_method(self, method: Any, robust_default: bool) -> None:
        """Refuse at start a method (a ``ServerMethod``) or setting the DP keys cannot hold for;
        DP-SGD's model is checked here as the agents will check it (Opacus refuses BatchNorm)."""
        cfg, name = self.cfg, method.name
        if cfg.dp_fedavg != "off":
            if not method.aggregates_weights:
                raise ValueError(f"server.dp_fedavg applies to the methods that share weights; {name} does not: leave it 'off'")
            if cfg.dp_fedavg not in method.dp_fedavg_modes:
                raise ValueError(f"server.dp_fedavg = {cfg.dp_fedavg!r} does not hold for {name} (it supports "
                                 f"{tuple(method.dp_fedavg_modes)}): see docs/privacy.md")
            if cfg.server_noises and not robust_default:
                raise ValueError(f"server.dp_fedavg = {cfg.dp_fedavg!r} is its own aggregation (the noised mean of clipped "
                                 "updates): leave server.aggregation = 'mean' and server.clip_update_norm = 0")
        if cfg.dpsgd:
            if not method.aggregates_weights or not hasattr(method, "model") or method.name == "fedkd":
                raise ValueError(f"server.dpsgd trains the FedAvg family's model through Opacus; {name} is not one: leave it false")
            from models.privacy import require_dpsgd_model

            require_dpsgd_model(method.model, method.config.model)

    # -- DP-FedAvg on the server ----------------------------------------------------- #

    def noised_mean(self, round_: int, agents: Sequence[str], updates: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """``(sum_k clip_C(update_k) + N(0, (z C)^2)) / n`` per float entry (float64)."""
        cfg = self.cfg
        if not updates:
            raise ValueError("nothing to aggregate: no updates")
        names = float_names(updates[0])
        total = {n: np.zeros(np.shape(updates[0][n]), dtype=np.float64) for n in names}
        norms: dict[str, float] = {}
        for agent, update in zip(agents, updates):
            clipped, norm = clip_update({n: update[n] for n in names}, cfg.dp_clip_norm)
            norms[agent] = norm
            for n in names:
                total[n] += clipped[n]
        noise = gaussian_noise({n: t.shape for n, t in total.items()}, cfg.dp_noise_multiplier * cfg.dp_clip_norm, self.rng)
        self.noised_rounds += 1
        self._round[round_] = {
            "update_norms": {a: round(v, 6) for a, v in norms.items()},
            "clipped": sorted(a for a, v in norms.items() if v > cfg.dp_clip_norm),
            "aggregated": len(updates),
            "noise_std_on_mean": cfg.dp_noise_multiplier * cfg.dp_clip_norm / len(updates),
        }
        return {n: (total[n] + noise[n]) / len(updates) for n in names}

    def noised_state_mean(self, round_: int, agents: Sequence[str], global_state: Mapping[str, np.ndarray],
                          states: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The new global state from the agents' states by :meth:`noised_mean` over their updates;
        integer counters take the agents' plain mean (rounded)."""
        names = float_names(global_state)
        updates = [{n: np.asarray(s[n], dtype=np.float64) - np.asarray(global_state[n], dtype=np.float64) for n in names}
                   for s in states]
        mean = self.noised_mean(round_, agents, updates)
        out: dict[str, np.ndarray] = {}
        for n, base in global_state.items():
            if n in mean:
                out[n] = (np.asarray(base, dtype=np.float64) + mean[n]).astype(base.dtype)
            else:
                out[n] = np.asarray(np.rint(np.mean([float(s[n]) for s in states])), dtype=base.dtype).reshape(base.shape)
        return out

    def noised_secure_mean(self, round_: int, survivors: Sequence[str], update_sum: Mapping[str, np.ndarray],
                           weight_sum: float, sampled: int) -> dict[str, np.ndarray]:
        """``(sum + N(0, (z C)^2)) / sampled`` per entry of ``update_sum``: the secure sum of the
        survivors' updates, each clipped to ``C`` on its agent and weighted 1 (``weight_sum``, the
        unmasked sum of the weights, says so: anything but one per survivor is refused)."""
        cfg = self.cfg
        if not survivors or sampled < len(survivors):
            raise ValueError(f"a secure sum of {len(survivors)} survivors cannot be divided by the {sampled} agents sampled")
        if abs(weight_sum - len(survivors)) > 1e-3:
            raise SecAggError(f"the unmasked weights of round {round_} sum to {weight_sum:g}, not to its {len(survivors)} "
                              "survivors: under DP-FedAvg every agent must mask its clipped update with the weight 1")
        names = list(update_sum)
        noise = gaussian_noise({n: np.shape(update_sum[n]) for n in names}, cfg.dp_noise_multiplier * cfg.dp_clip_norm, self.rng)
        self.noised_rounds += 1
        self._round[round_] = {
            "secure_sum": True,  # no single update seen: no norms, nothing clipped here
            "aggregated": len(survivors),
            "denominator": sampled,
            "noise_std_on_mean": cfg.dp_noise_multiplier * cfg.dp_clip_norm / sampled,
        }
        return {n: (np.asarray(update_sum[n], dtype=np.float64) + noise[n]) / sampled for n in names}

    # -- ε ---------------------------------------------------------------------------- #

    def close_round(self, round_: int, metrics_by_agent: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """The round's record (empty when DP is off): what was clipped and noised, and ε so far."""
        cfg = self.cfg
        if not cfg.on:
            return {}
        record: dict[str, Any] = {}
        if cfg.dp_fedavg != "off":
            if cfg.dp_fedavg == "local":
                # Every agent that took part noised its own update: a step for each of them, q = 1; the
                # run's figure is the agent that took part most often.
                for agent in metrics_by_agent:
                    self.local_rounds[agent] = self.local_rounds.get(agent, 0) + 1
                self.noised_rounds = max(self.local_rounds.values(), default=0)
            eps = client_level_epsilon(cfg.dp_noise_multiplier, cfg.sample_rate, self.noised_rounds, cfg.dp_delta, cfg.dp_accountant)
            self.epsilon_by_round[round_] = eps
            record["dp_fedavg"] = {"mode": cfg.dp_fedavg, "epsilon": eps, "noised_rounds": self.noised_rounds,
                                   **self._round.pop(round_, {})}
            if cfg.dp_fedavg == "local":
                record["dp_fedavg"]["local_agents"] = sorted(metrics_by_agent)
            log.info("round %d: DP-FedAvg (%s) epsilon %.3f at delta %g after %d noised rounds", round_, cfg.dp_fedavg, eps,
                     cfg.dp_delta, self.noised_rounds)
        if cfg.dpsgd:
            per_agent = {}
            for agent, m in sorted(metrics_by_agent.items()):
                if isinstance(m.get("dpsgd_epsilon"), (int, float)):
                    figures = {k: float(m[k]) for k in ("dpsgd_epsilon", "dpsgd_steps", "dpsgd_sample_rate") if k in m}
                    per_agent[agent] = figures
                    self.dpsgd_by_agent[agent] = figures
            worst = max((f["dpsgd_epsilon"] for f in self.dpsgd_by_agent.values()), default=None)
            record["dpsgd"] = {"epsilon": worst, "agents": per_agent}
            if worst is not None:
                log.info("round %d: DP-SGD epsilon %.3f at delta %g (the largest of %d agents)", round_, worst, cfg.dp_delta,
                         len(self.dpsgd_by_agent))
        return record

    def resume(self, records: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Carry on counting after a resume, from the recorded rounds' (round, privacy record)."""
        for round_, privacy in records:
            dp = (privacy or {}).get("dp_fedavg")
            if dp:
                self.noised_rounds = int(dp["noised_rounds"])
                self.epsilon_by_round[int(round_)] = float(dp["epsilon"])
                for agent in dp.get("local_agents", []):
                    self.local_rounds[agent] = self.local_rounds.get(agent, 0) + 1
            for agent, figures in (((privacy or {}).get("dpsgd") or {}).get("agents") or {}).items():
                self.dpsgd_by_agent[agent] = dict(figures)

    def section(self) -> dict[str, Any] | None:
        """The report's ``privacy`` section (None: DP off)."""
        cfg = self.cfg
        if not cfg.on:
            return None
        out: dict[str, Any] = {"delta": cfg.dp_delta, "accountant": cfg.dp_accountant}
        if cfg.dp_fedavg != "off":
            last = max(self.epsilon_by_round) if self.epsilon_by_round else None
            out["dp_fedavg"] = {
                "mode": cfg.dp_fedavg, "clip_norm": cfg.dp_clip_norm, "noise_multiplier": cfg.dp_noise_multiplier,
                "sample_rate": cfg.sample_rate, "noised_rounds": self.noised_rounds,
                "secure_aggregation": cfg.secure_aggregation,
                "epsilon": self.epsilon_by_round[last] if last is not None else 0.0,
                "epsilon_by_round": [[r, e] for r, e in sorted(self.epsilon_by_round.items())],
            }
        if cfg.dpsgd:
            out["dpsgd"] = {
                "noise_multiplier": cfg.dpsgd_noise_multiplier, "max_grad_norm": cfg.dpsgd_max_grad_norm,
                "epsilon": max((f["dpsgd_epsilon"] for f in self.dpsgd_by_agent.values()), default=0.0),
                "agents": {a: dict(f) for a, f in sorted(self.dpsgd_by_agent.items())},
            }
        return out

    def summary_line(self) -> str:
        """One line for summary.md and the console ("" when DP is off)."""
        return privacy_line(self.section())


def privacy_line(section: Mapping[str, Any] | None) -> str:
    """The report's ``privacy`` section in one line ("" when there is none)."""
    if not section:
        return ""
    parts = []
    if "dp_fedavg" in section:
        d = section["dp_fedavg"]
        secure = ", on the secure sum" if d.get("secure_aggregation") else ""
        parts.append(f"DP-FedAvg ({d['mode']}{secure}, C = {d['clip_norm']:g}, z = {d['noise_multiplier']:g}, "
                     f"q = {d['sample_rate']:g}, {d['noised_rounds']} noised rounds): epsilon = {d['epsilon']:.3f}")
    if "dpsgd" in section:
        d = section["dpsgd"]
        parts.append(f"DP-SGD (z = {d['noise_multiplier']:g}, C = {d['max_grad_norm']:g}): epsilon = {d['epsilon']:.3f} "
                     "(the largest over the agents)")
    return f"Differential privacy at delta = {section['delta']:g} ({section['accountant']} accountant): " + "; ".join(parts)


def check_privacy_section(ck: Any, privacy: Any) -> None:
    """Differential privacy's section (optional): δ, the accountant, and for each mechanism
    that ran its parameters and ε for the run (cloud_server/report/schema.py calls this with its checker)."""
    if privacy is None:
        return
    good = ck.fields(privacy, "privacy", ({"delta": ("number", False, 0.0, 1.0), "accountant": ("str", False, None, None)},
                                          {"dp_fedavg": ("dict", False, None, None), "dpsgd": ("dict", False, None, None)}))
    if "dp_fedavg" not in good and "dpsgd" not in good:
        ck.add("privacy: names neither dp_fedavg nor dpsgd")
    if "dp_fedavg" in good:
        ck.fields(good["dp_fedavg"], "privacy.dp_fedavg", ({
            "mode": ("str", False, None, None), "clip_norm": ("number", False, 0.0, None),
            "noise_multiplier": ("number", False, 0.0, None), "sample_rate": ("number", False, 0.0, 1.0),
            "noised_rounds": ("int", False, 0, None), "epsilon": ("number", False, 0.0, None),
            "epsilon_by_round": ("list", False, None, None)}, {"secure_aggregation": ("bool", False, None, None)}))
    if "dpsgd" in good:
        ck.fields(good["dpsgd"], "privacy.dpsgd", ({
            "noise_multiplier": ("number", False, 0.0, None), "max_grad_norm": ("number", False, 0.0, None),
            "epsilon": ("number", False, 0.0, None), "agents": ("dict", False, None, None)}, {}))
