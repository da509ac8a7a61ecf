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
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from fldata.count_table import read_count_table
from fldata.partition_spec import PARTITION_SCHEMES, PartitionSpec, _require_int

_DIRICHLET_MAX_ATTEMPTS: Final[int] = 100
# Distinct RNG streams per use so that, e.g., the test split does not replay
# the training split's shuffles.
_STREAM_TRAIN, _STREAM_TEST = 0, 1
_SCHEME_CODES: Final[dict[str, int]] = {s: i for i, s in enumerate(PARTITION_SCHEMES)}


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
