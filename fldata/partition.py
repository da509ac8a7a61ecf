"""Seeded, deterministic partitions of a dataset across agents (numpy only).

A partition is a list with one sorted ``int64`` index array per agent, indexing
into the dataset's arrays. Partitions are disjoint. ``iid``, ``dirichlet`` and
``step`` cover the whole dataset; ``table`` takes exactly what its CSV asks for.
The same labels, spec and seed give the same partition on every machine, so in
a local simulation each agent can compute its own shard from the spec alone.

Schemes (``PartitionSpec.parse`` syntax in brackets):

* ``iid`` [``iid``]: shuffle, then split into ``num_agents`` nearly equal parts
  (sizes differ by at most one).
* ``dirichlet`` [``dirichlet:ALPHA``]: the FedML / FedGKT "hetero" scheme. For
  each class, draw proportions ``p ~ Dir(alpha)`` over agents and cut the
  shuffled class into pieces of those sizes; an agent that already holds at
  least ``N / num_agents`` samples gets no share of later classes (FedML's
  balancing). The whole draw is repeated (up to 100 times, continuing the same
  random stream) until every agent holds at least
  ``min(min_samples_per_agent, N // num_agents)`` samples; if no draw
  succeeds, the best one is repaired by moving random samples, one at a time,
  from the largest agent to the smallest. It always terminates. Smaller alpha
  means more skew.
* ``step`` [``step:K`` or ``step:K:MINOR_SHARE``]: agent ``a`` has the ``K``
  *major* classes ``(a*K + j) mod C`` for ``j < K`` (round-robin). For each class
  ``c``, every agent for which ``c`` is minor gets
  ``floor(minor_share * n_c / #minor agents)`` samples of it and the agents for
  which ``c`` is major split the rest evenly (remainders to the lowest agent
  indices). A class that is nobody's major (``num_agents * K < C``) is split
  evenly among all agents; a class that is everybody's major likewise. With 10
  agents, 10 classes, ``K = 2``, ``minor_share = 0.02`` and 4000 images per
  class this is FedBE's "Step" setting: 1960 images of each major class and 10
  of each minor class per agent.
* ``table`` [``table:PATH.csv``]: a CSV with one row per agent and one column
  per class giving exact class counts (see :func:`read_count_table`). Samples
  are drawn at random without replacement; asking for more than a class has is
  an error.

Local test shards (:func:`partition_test_indices`): without training labels
the test set is split iid (seeded). Given the training labels, each class's
test samples are split across agents in proportion to how that class was split
in the training partition (largest-remainder rounding), so every agent's test
shard follows its own training label distribution.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from fldata.datasets import ArrayDataset

__all__ = [
    "PARTITION_SCHEMES",
    "PartitionSpec",
    "agent_shard",
    "class_count_table",
    "class_counts_per_agent",
    "partition_indices",
    "partition_test_indices",
    "read_count_table",
    "test_shard_for_agent",
]

#: Schemes accepted by :class:`PartitionSpec`.
PARTITION_SCHEMES: Final[tuple[str, ...]] = ("iid", "dirichlet", "step", "table")

_DIRICHLET_MAX_ATTEMPTS: Final[int] = 100
# Distinct RNG streams per use so that, e.g., the test split does not replay
# the training split's shuffles.
_STREAM_TRAIN, _STREAM_TEST = 0, 1
_SCHEME_CODES: Final[dict[str, int]] = {s: i for i, s in enumerate(PARTITION_SCHEMES)}
# Header cells that mark a leading agent-label column in a count table.
_AGENT_COLUMN_NAMES: Final[frozenset[str]] = frozenset({"", "agent", "client", "agent_index", "client_id", "id", "k"})


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


# --------------------------------------------------------------------------- #
# Partitioning
# --------------------------------------------------------------------------- #


def partition_indices(
    labels: np.ndarray, spec: PartitionSpec, num_classes: int | None = None
) -> list[np.ndarray]:
    """Split sample positions ``0..N-1`` across ``spec.num_agents`` agents.

    Args:
        labels: integer class labels ``(N,)``.
        spec: the scheme; see the module docstring for each rule.
        num_classes: number of classes; defaults to the table's column count
            for ``table`` and to ``labels.max() + 1`` otherwise. Pass it when
            some class may be absent from ``labels``.

    Returns:
        One sorted ``int64`` array of positions per agent; disjoint.
    """
    labels = _check_labels(labels)
    counts_table = read_count_table(spec.table_path) if spec.scheme == "table" and spec.table_path else None
    if num_classes is None:
        if counts_table is not None:
            num_classes = counts_table.shape[1]
        else:
            num_classes = int(labels.max()) + 1 if labels.size else 1
    _require_int("num_classes", num_classes, minimum=1)
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"labels go up to {int(labels.max())} but num_classes is {num_classes}")
    n, k = labels.shape[0], spec.num_agents
    if spec.scheme != "table" and n < k:
        raise ValueError(f"{n} samples cannot give each of {k} agents at least one")
    rng = np.random.default_rng([spec.seed, _SCHEME_CODES[spec.scheme], _STREAM_TRAIN])
    # The "is not None" tests only narrow types: PartitionSpec guarantees them.
    if spec.scheme == "iid":
        parts = np.array_split(rng.permutation(n), k)
    elif spec.scheme == "dirichlet" and spec.alpha is not None:
        parts = _dirichlet(labels, num_classes, k, spec.alpha, spec.min_samples_per_agent, rng)
    elif spec.scheme == "step" and spec.major_classes is not None:
        parts = _step(labels, num_classes, k, spec.major_classes, spec.minor_share, rng)
    elif spec.scheme == "table" and counts_table is not None:
        parts = _table(labels, num_classes, k, counts_table, rng, spec.table_path or "")
    else:
        raise ValueError(f"inconsistent partition spec {spec!r}")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    labels = labels.astype(np.int64, copy=False)
    if labels.size and labels.min() < 0:
        raise ValueError(f"labels must be >= 0, got {int(labels.min())}")
    return labels


def _class_members(labels: np.ndarray, c: int, rng: np.random.Generator) -> np.ndarray:
    members = np.flatnonzero(labels == c)
    rng.shuffle(members)
    return members


def _dirichlet(
    labels: np.ndarray,
    num_classes: int,
    num_agents: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    n = labels.shape[0]
    target = min(min_samples, n // num_agents)
    cap = n / num_agents
    best: list[list[np.ndarray]] = []
    best_min = -1  # any attempt beats it, so best is set after the first
    for _ in range(_DIRICHLET_MAX_ATTEMPTS):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_agents)]
        sizes = np.zeros(num_agents, dtype=np.int64)
        for c in range(num_classes):
            members = _class_members(labels, c, rng)
            p = rng.dirichlet(np.full(num_agents, alpha))
            # FedML's balancing: a full agent takes no more classes.
            open_agents = sizes < cap
            p = np.where(open_agents, p, 0.0)
            total = p.sum()
            if not np.isfinite(total) or total <= 0.0:
                # Tiny alpha can put all mass on full agents (or underflow):
                # share this class evenly among the open ones instead.
                p = open_agents.astype(np.float64)
                total = p.sum()
            p = p / total
            cuts = (np.cumsum(p) * members.shape[0]).astype(np.int64)[:-1]
            for a, piece in enumerate(np.split(members, cuts)):
                pieces[a].append(piece)
                sizes[a] += piece.shape[0]
        smallest = int(sizes.min())
        if smallest > best_min:
            best, best_min = pieces, smallest
        if smallest >= target:
            break
    parts = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in best]
    if best_min < target:
        parts = _repair_min_size(parts, target, rng)
    return parts


def _repair_min_size(parts: list[np.ndarray], target: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Move random samples from the largest agent to the smallest until all have ``target``.

    Terminates because ``target <= N // num_agents``: while some agent is below
    the target, another must be above it.
    """
    parts = [p.copy() for p in parts]
    while True:
        sizes = np.array([p.shape[0] for p in parts])
        small = int(np.argmin(sizes))
        if sizes[small] >= target:
            return parts
        big = int(np.argmax(sizes))
        pick = int(rng.integers(parts[big].shape[0]))
        parts[small] = np.append(parts[small], parts[big][pick])
        parts[big] = np.delete(parts[big], pick)


def _step(
    labels: np.ndarray,
    num_classes: int,
    num_agents: int,
    k: int,
    minor_share: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if k > num_classes:
        raise ValueError(f"step:{k} asks for {k} major classes per agent but there are only {num_classes}")
    majors = [{(a * k + j) % num_classes for j in range(k)} for a in range(num_agents)]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_agents)]
    for c in range(num_classes):
        members = _class_members(labels, c, rng)
        owners = [a for a in range(num_agents) if c in majors[a]]
        minors = [a for a in range(num_agents) if c not in majors[a]]
        if not owners or not minors:
            # Nobody's (or everybody's) major: plain even split over all agents.
            for a, piece in enumerate(np.array_split(members, num_agents)):
                pieces[a].append(piece)
            continue
        per_minor = math.floor(minor_share * members.shape[0] / len(minors))
        for i, a in enumerate(minors):
            pieces[a].append(members[i * per_minor : (i + 1) * per_minor])
        rest = members[len(minors) * per_minor :]
        for a, piece in zip(owners, np.array_split(rest, len(owners))):
            pieces[a].append(piece)
    return [np.concatenate(p) for p in pieces]


def _table(
    labels: np.ndarray,
    num_classes: int,
    num_agents: int,
    counts: np.ndarray,
    rng: np.random.Generator,
    path: str,
) -> list[np.ndarray]:
    if counts.shape != (num_agents, num_classes):
        raise ValueError(
            f"count table {path} is {counts.shape[0]} agents x {counts.shape[1]} classes; "
            f"expected {num_agents} x {num_classes}"
        )
    available = np.bincount(labels, minlength=num_classes)
    asked = counts.sum(axis=0)
    over = np.flatnonzero(asked > available)
    if over.size:
        detail = ", ".join(f"class {c}: {int(asked[c])} asked, {int(available[c])} available" for c in over)
        raise ValueError(f"count table {path} asks for more samples than the dataset has ({detail})")
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_agents)]
    for c in range(num_classes):
        members = _class_members(labels, c, rng)
        ends = np.cumsum(counts[:, c])
        starts = ends - counts[:, c]
        for a in range(num_agents):
            pieces[a].append(members[starts[a] : ends[a]])
    return [np.concatenate(p) for p in pieces]


def read_count_table(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a class-count CSV into an ``int64`` array ``(num_agents, num_classes)``.

    One row per agent, one column per class, non-negative integers. Blank lines
    and lines starting with ``#`` are skipped. A first row that is not all
    integers is a header (e.g. class names); if its first cell is empty or one
    of ``agent``, ``client``, ``agent_index``, ``client_id``, ``id``, ``k``, the
    first column holds agent labels and is ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"count table {path} not found")
    with path.open(newline="") as f:
        rows = [
            (line_no, [cell.strip() for cell in row])
            for line_no, row in enumerate(csv.reader(f), start=1)
            if row and any(cell.strip() for cell in row) and not row[0].lstrip().startswith("#")
        ]
    if not rows:
        raise ValueError(f"count table {path} is empty")
    skip_first_column = False
    if not all(_is_int(cell) for cell in rows[0][1]):
        skip_first_column = rows[0][1][0].lower() in _AGENT_COLUMN_NAMES
        rows = rows[1:]
        if not rows:
            raise ValueError(f"count table {path} has a header but no rows")
    table: list[list[int]] = []
    for line_no, cells in rows:
        if skip_first_column:
            cells = cells[1:]
        if not all(_is_int(cell) for cell in cells):
            raise ValueError(f"{path}:{line_no}: expected integer class counts, got {cells}")
        values = [int(cell) for cell in cells]
        if any(v < 0 for v in values):
            raise ValueError(f"{path}:{line_no}: class counts must be >= 0, got {values}")
        if table and len(values) != len(table[0]):
            raise ValueError(f"{path}:{line_no}: expected {len(table[0])} columns, got {len(values)}")
        table.append(values)
    if not table[0]:
        raise ValueError(f"count table {path} has no class columns")
    return np.asarray(table, dtype=np.int64)


def _is_int(cell: str) -> bool:
    try:
        int(cell)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- #
# Shards and reports
# --------------------------------------------------------------------------- #


def _check_agent_index(spec: PartitionSpec, agent_index: int) -> None:
    if not isinstance(agent_index, (int, np.integer)) or isinstance(agent_index, bool) or not (
        0 <= agent_index < spec.num_agents
    ):
        raise ValueError(f"agent_index must be an int in [0, {spec.num_agents}), got {agent_index!r}")


def agent_shard(ds: ArrayDataset, spec: PartitionSpec, agent_index: int) -> ArrayDataset:
    """Agent ``agent_index``'s share of ``ds`` under ``spec`` (sample ids kept)."""
    _check_agent_index(spec, agent_index)
    return ds.subset(partition_indices(ds.labels, spec, ds.num_classes)[agent_index])


def partition_test_indices(
    test_labels: np.ndarray,
    spec: PartitionSpec,
    train_labels: np.ndarray | None = None,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Split a test set into per-agent local test shards.

    Without ``train_labels``: an iid split of the test set (seeded by
    ``spec.seed``, on its own random stream), whatever ``spec.scheme`` is.
    With ``train_labels``: the training set is partitioned by ``spec`` and each
    class's test samples are divided among agents in proportion to that
    class's training counts (largest-remainder rounding, ties to lower agent
    indices), so each agent's test shard mirrors its training label mix. Test
    samples of a class no agent trains on are left out.
    """
    test_labels = _check_labels(test_labels)
    rng = np.random.default_rng([spec.seed, _SCHEME_CODES[spec.scheme], _STREAM_TEST])
    k = spec.num_agents
    if train_labels is None:
        return [np.sort(p.astype(np.int64)) for p in np.array_split(rng.permutation(test_labels.shape[0]), k)]
    train_labels = _check_labels(train_labels)
    if num_classes is None:
        num_classes = int(max(train_labels.max(initial=0), test_labels.max(initial=0))) + 1
    train_counts = class_counts_per_agent(
        train_labels, partition_indices(train_labels, spec, num_classes), num_classes
    )  # (agents, classes)
    pieces: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c in range(num_classes):
        members = _class_members(test_labels, c, rng)
        weights = train_counts[:, c]
        if weights.sum() == 0 or members.size == 0:
            continue
        shares = members.shape[0] * weights / weights.sum()
        quotas = _apportion(shares, members.shape[0])
        ends = np.cumsum(quotas)
        for a in range(k):
            pieces[a].append(members[ends[a] - quotas[a] : ends[a]])
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in pieces]


def _apportion(shares: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total``: floors plus one each for the largest remainders."""
    floors = np.floor(shares).astype(np.int64)
    remainder = total - int(floors.sum())
    order = np.argsort(-(shares - floors), kind="stable")
    floors[order[:remainder]] += 1
    return floors


def test_shard_for_agent(
    test_ds: ArrayDataset,
    spec: PartitionSpec,
    agent_index: int,
    train_labels: np.ndarray | None = None,
) -> ArrayDataset:
    """Agent ``agent_index``'s local test shard; see :func:`partition_test_indices`."""
    _check_agent_index(spec, agent_index)
    parts = partition_test_indices(test_ds.labels, spec, train_labels, test_ds.num_classes)
    return test_ds.subset(parts[agent_index])


# Tell pytest this helper is not a test even when a test module imports it.
test_shard_for_agent.__test__ = False  # type: ignore[attr-defined]


def class_counts_per_agent(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """``int64`` ``(num_agents, num_classes)``: samples of each class per agent."""
    labels = _check_labels(labels)
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"labels go up to {int(labels.max())} but num_classes is {num_classes}")
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for a, part in enumerate(parts):
        counts[a] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return counts


def class_count_table(
    labels: np.ndarray,
    parts: Sequence[np.ndarray],
    num_classes: int,
    class_names: Sequence[str] | None = None,
) -> str:
    """A right-aligned text table: one row per agent, one column per class,
    plus a ``total`` column and a ``total`` row."""
    counts = class_counts_per_agent(labels, parts, num_classes)
    names = list(class_names) if class_names is not None else [str(c) for c in range(num_classes)]
    if len(names) != num_classes:
        raise ValueError(f"class_names must have {num_classes} entries, got {len(names)}")
    header = ["agent", *names, "total"]
    body = [[str(a), *(str(int(v)) for v in row), str(int(row.sum()))] for a, row in enumerate(counts)]
    col_totals = counts.sum(axis=0)
    footer = ["total", *(str(int(v)) for v in col_totals), str(int(col_totals.sum()))]
    rows = [header, *body, footer]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))])

    rule = "-" * len(fmt(header))
    return "\n".join([fmt(header), rule, *(fmt(r) for r in body), rule, fmt(footer)])
