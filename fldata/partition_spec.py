"""How a dataset is split across agents: :class:`PartitionSpec`, checked at
construction and parsed from ``"iid"``, ``"dirichlet:ALPHA"``, ``"step:K[:MINOR_SHARE]"``
or ``"table:PATH.csv"`` (the schemes are described in :mod:`fldata.partition_schemes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np

#: Schemes accepted by :class:`PartitionSpec`.
PARTITION_SCHEMES: Final[tuple[str, ...]] = ("iid", "dirichlet", "step", "table")


@dataclass(frozen=True)
class PartitionSpec:
    """How a dataset is split across agents.

    Attributes:
        scheme: one of :data:`PARTITION_SCHEMES`.
        num_agents: number of agents (>= 1).
        seed: seed of every random choice (>= 0).
        alpha: Dirichlet concentration (> 0); required for, and only for,
            ``dirichlet``.
        major_classes: ``K`` major classes per agent (>= 1); required for, and
            only for, ``step``.
        table_path: CSV of class counts; required for, and only for, ``table``.
        minor_share: ``step`` only: fraction of each class spread over the
            agents for which it is minor (``0 <= minor_share < 1``).
        min_samples_per_agent: ``dirichlet`` only: minimum shard size aimed for
            (capped at ``N // num_agents`` on small data).
    """

    scheme: str
    num_agents: int
    seed: int = 0
    alpha: float | None = None
    major_classes: int | None = None
    table_path: str | None = None
    minor_share: float = 0.02
    min_samples_per_agent: int = 10

    def __post_init__(self) -> None:
        if self.scheme not in PARTITION_SCHEMES:
            raise ValueError(
                f"unknown partition scheme {self.scheme!r}; expected one of {', '.join(PARTITION_SCHEMES)}"
            )
        _require_int("num_agents", self.num_agents, minimum=1)
        _require_int("seed", self.seed, minimum=0)
        _require_int("min_samples_per_agent", self.min_samples_per_agent, minimum=0)
        if not (isinstance(self.minor_share, (int, float)) and 0.0 <= self.minor_share < 1.0):
            raise ValueError(f"minor_share must be a number in [0, 1), got {self.minor_share!r}")
        needs = {"dirichlet": "alpha", "step": "major_classes", "table": "table_path"}
        for scheme, param in needs.items():
            given = getattr(self, param) is not None
            if scheme == self.scheme and not given:
                raise ValueError(f"scheme {scheme!r} needs {param}")
            if scheme != self.scheme and given:
                raise ValueError(f"{param} applies to scheme {scheme!r} only, got it with {self.scheme!r}")
        if self.alpha is not None and not (
            isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
            and math.isfinite(self.alpha) and self.alpha > 0
        ):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if self.major_classes is not None:
            _require_int("major_classes", self.major_classes, minimum=1)
        if self.table_path is not None and (not isinstance(self.table_path, str) or not self.table_path):
            raise ValueError(f"table_path must be a non-empty str, got {self.table_path!r}")

    @classmethod
    def parse(cls, text: str, num_agents: int, seed: int = 0) -> PartitionSpec:
        """Build a spec from ``"iid"``, ``"dirichlet:0.5"``, ``"step:2"``,
        ``"step:2:0.05"`` or ``"table:path.csv"``."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"partition spec must be a non-empty string, got {text!r}")
        scheme, _, rest = text.strip().partition(":")
        scheme = scheme.strip().lower()
        syntax = "expected 'iid', 'dirichlet:ALPHA', 'step:K[:MINOR_SHARE]' or 'table:PATH.csv'"
        if scheme == "iid":
            if rest:
                raise ValueError(f"'iid' takes no parameter, got {text!r}; {syntax}")
            return cls("iid", num_agents, seed)
        if scheme == "dirichlet":
            try:
                alpha = float(rest)
            except ValueError:
                raise ValueError(f"bad dirichlet alpha in {text!r}; {syntax}") from None
            return cls("dirichlet", num_agents, seed, alpha=alpha)
        if scheme == "step":
            fields = rest.split(":") if rest else []
            if len(fields) not in (1, 2):
                raise ValueError(f"bad step spec {text!r}; {syntax}")
            try:
                k = int(fields[0])
                share = float(fields[1]) if len(fields) == 2 else cls.minor_share
            except ValueError:
                raise ValueError(f"bad step parameters in {text!r}; {syntax}") from None
            return cls("step", num_agents, seed, major_classes=k, minor_share=share)
        if scheme == "table":
            if not rest.strip():
                raise ValueError(f"'table' needs a CSV path, got {text!r}; {syntax}")
            return cls("table", num_agents, seed, table_path=rest.strip())
        raise ValueError(f"unknown partition scheme {scheme!r} in {text!r}; {syntax}")

    def __str__(self) -> str:
        """The :meth:`parse` form (without agents and seed)."""
        if self.scheme == "dirichlet":
            return f"dirichlet:{self.alpha:g}"
        if self.scheme == "step":
            return f"step:{self.major_classes}:{self.minor_share:g}"
        if self.scheme == "table":
            return f"table:{self.table_path}"
        return "iid"


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
