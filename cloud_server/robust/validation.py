"""Robustness to a bad device, the checks that need the server's own judgement of the data:
a server-held labelled validation set for weight updates, and the server model's agreement
with the labels FedGKT's agents send (numpy only; the torch side is in
cloud_server/robust/validation_screen.py and the label check of cloud_server/methods/fedgkt.py).

A sign-flipped update is of honest size, and under label skew honest updates point away
from the round's median as far as it does (bench/experiments/direction_cosines.toml): the
checks of cloud_server/robust/ cannot tell it from an honest one there. A server that
holds a few labelled images can: Zeno (Xie et al. 2019) scores each update by what it does
to a validation loss. Here each update's score is the rise of the server's validation loss
from the global model to the global model plus that update alone (Zeno's score at step 1,
without its norm penalty: the norm check is beside it), and an update whose rise is far above
the other agents' (:func:`implausible_validation`) is refused as ``implausible_validation``.

FedGKT's server trains on the labels the agents send with their maps: an agent whose labels
are shuffled sends maps and logits in range, and nothing of cloud_server/robust/ refuses
it. Once the server model has trained (round 2 on), it can say how many of an agent's labels
it agrees with on that agent's maps; an agent far below the others and below an absolute floor
(:func:`implausible_labels`) is refused as ``implausible_labels`` and its maps are not trained on.

Both are off by default (the papers' server); their keys and measured defaults are in
:class:`DefenceConfig` and docs/configuration.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .checks import robust_median
from .config import MAD_TO_SD

__all__ = ["LABEL_CHECK_FROM_ROUND", "LABEL_MIN_OTHERS", "VALIDATION_MIN_AGENTS", "VALIDATION_SPLITS", "VALIDATION_STEPS", "DefenceConfig", "implausible_labels", "implausible_validation"]

# Where the validation set comes from (fldata.train_holdout, as FedBE's unlabeled set is carved): the
# training samples the agents of a simulation do not take, or a whole split of a dataset the
# agents do not train on (a deployment whose agents hold their own data). Never the test split:
# the run's global test set is drawn from it.
VALIDATION_SPLITS = ("train-holdout", "train", "valid")
# The server model is scored against the labels from this round on: in round 1 it has not trained.
LABEL_CHECK_FROM_ROUND = 2
# The default of ``validation_loss_margin`` (nats of cross-entropy); why, in DefenceConfig.
VALIDATION_LOSS_MARGIN = 0.5
VALIDATION_MIN_AGENTS = 3  # as the direction check's: two agents are no majority
LABEL_MIN_OTHERS = 2  # the label check: one other agent is no majority
# What an update is scored by: the global model plus the whole update ("update", the agent's own
# model: Zeno's step 1) or plus its share of a plain mean of the n judged updates ("share", 1 / n).
# Both are recorded; the refusal reads ``validation_step``.
VALIDATION_STEPS = ("update", "share")


@dataclass(frozen=True)
class DefenceConfig:
    """The ``[server]`` keys of these checks (docs/configuration.md)."""

    # A labelled validation set of this many images at the server (0: none, the check is off),
    # drawn (stratified, seeded by ``seed``) from ``validation_split`` of ``validation_dataset``;
    # "train-holdout": the training split less the agents' seeded subset of
    # ``validation_agent_train_samples`` images (their data.train_samples), drawn with
    # ``validation_agent_data_seed`` (None: the server's seed), as FedBE's unlabeled set is.
    validation_samples: int = 0
    validation_dataset: str = "fashion-mnist"
    validation_split: str = "train-holdout"
    validation_agent_train_samples: int = 0
    validation_agent_data_seed: int | None = None
    validation_root: str | None = None
    validation_download: bool = False
    # An update whose validation-loss rise is above the other agents' median rise plus the larger of
    # this margin and plausible_mad x 1.4826 x their MAD is refused (implausible_validation). The
    # default margin is a floor under the MAD term: under label skew the honest agents' rises and
    # their MAD are small but not zero, and the floor keeps a round whose honest agents happen to
    # agree closely from refusing one of them. A sign-flipped update's loss is not finite; a flip of
    # the weights alone (BatchNorm statistics honest) is finite and is what the margin must still
    # catch. bench/experiments/validation_scores.toml records the honest agents' rises.
    validation_loss_margin: float = VALIDATION_LOSS_MARGIN
    validation_step: str = "update"  # update | share (VALIDATION_STEPS)
    # FedGKT: an agent the server model agrees with on fewer than this fraction of its labels,
    # and far below the other agents (plausible_mad), is refused (implausible_labels). 0: off, by
    # default: a floor that refused no honest upload caught shuffled labels at mild skew but not
    # at the strongest skew measured, so it is a setting for a fleet that knows its data
    # (bench/experiments/validation_scores.toml and label_scores.toml; docs/configuration.md
    # reads them).
    plausible_min_label_agreement: float = 0.0
    plausible_mad: float = 6.0  # [server] plausible_mad, shared with the norm check
    seed: int = 0  # [server] seed

    def __post_init__(self) -> None:
        n = self.validation_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"server.validation_samples must be an integer >= 0 (0: no validation set), got {n!r}")
        if self.validation_split not in VALIDATION_SPLITS:
            raise ValueError(f"server.validation_split must be one of {VALIDATION_SPLITS} (never the test split: the "
                             f"global test set is drawn from it), got {self.validation_split!r}")
        if n and self.validation_split == "train-holdout" and self.validation_agent_train_samples < 1:
            raise ValueError("server.validation_samples > 0 with validation_split = \"train-holdout\" needs "
                             "validation_agent_train_samples >= 1 (the agents' data.train_samples): the validation set "
                             "is the training samples they do not take")
        if self.validation_agent_train_samples < 0:
            raise ValueError(f"server.validation_agent_train_samples must be >= 0, got {self.validation_agent_train_samples}")
        m = self.validation_loss_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (m > 0 and math.isfinite(m)):
            raise ValueError(f"server.validation_loss_margin must be a finite number > 0 (nats), got {m!r}")
        if self.validation_step not in VALIDATION_STEPS:
            raise ValueError(f"server.validation_step must be one of {VALIDATION_STEPS}, got {self.validation_step!r}")
        a = self.plausible_min_label_agreement
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"server.plausible_min_label_agreement must be in [0, 1] (0: off), got {a!r}")

    @property
    def validates(self) -> bool:
        return self.validation_samples > 0

    @property
    def checks_labels(self) -> bool:
        return self.plausible_min_label_agreement > 0


def implausible_validation(rises: Mapping[str, float], margin: float, mad_factor: float,
                           global_loss: float) -> dict[str, tuple[str, str]]:
    """Agent -> (reason, detail) for each update whose validation-loss rise (loss of the
    global model plus the update, minus the global model's ``global_loss``) is above the
    *other* agents' median rise plus max(``margin``, ``mad_factor`` x 1.4826 x their MAD), or
    not finite. Fewer than three agents are not judged (as the direction check): one has no
    yardstick, and of two under label skew the honest one with the larger rise would be judged
    by the other alone. The detail names the figure and the limit."""
    out: dict[str, tuple[str, str]] = {}
    if len(rises) < VALIDATION_MIN_AGENTS:
        return out
    for agent, rise in rises.items():
        med, mad = robust_median([v if math.isfinite(v) else 1e30 for a, v in rises.items() if a != agent])
        limit = med + max(margin, mad_factor * MAD_TO_SD * mad)
        if not rise <= limit:
            out[agent] = ("implausible_validation",
                          f"the global model plus this update has a validation loss {global_loss + rise:.4g}, "
                          f"{rise:+.4g} from the global model's {global_loss:.4g}; the other agents' median change "
                          f"is {med:+.4g} (MAD {mad:.4g}): limit {limit:+.4g} (validation_loss_margin {margin:g})")
    return out


def implausible_labels(agreement: Mapping[str, float], floor: float, mad_factor: float,
                       peers: Mapping[str, float] | None = None) -> dict[str, tuple[str, str]]:
    """Agent -> (reason, detail) for each agent of ``agreement`` (the fraction of its labels
    the server model predicts) below ``floor`` *and* below the other agents' median minus
    ``mad_factor`` x 1.4826 x their MAD; the others are ``agreement`` and ``peers`` (agents
    not judged now, e.g. async mode's latest figures), and there must be two or more of them
    (one other is no majority). Both bounds: an agent with few classes the server has not
    learnt yet may be low, but not far below a fleet that is also low."""
    out: dict[str, tuple[str, str]] = {}
    everyone = {**(peers or {}), **agreement}
    for agent, value in agreement.items():
        others = [v for a, v in everyone.items() if a != agent]
        if len(others) < LABEL_MIN_OTHERS or value >= floor:
            continue
        med, mad = robust_median(others)
        limit = med - mad_factor * MAD_TO_SD * mad
        if value < limit:
            out[agent] = ("implausible_labels",
                          f"the server model agrees with {value:.1%} of its labels, below plausible_min_label_agreement "
                          f"{floor:g} and the other {len(others)} agents' median {med:.1%} - {mad_factor:g} x 1.4826 x MAD "
                          f"{mad:.3f} (= {limit:.1%})")
    return out
