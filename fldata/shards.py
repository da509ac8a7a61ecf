"""Each agent's shard of a partition, its local test shard, and per-agent class counts.

Local test shards (:func:`partition_test_indices`): without training labels
the test set is split iid (seeded). Given the training labels, each class's
test samples are split across agents in proportion to how that class was split
in the training partition (largest-remainder rounding), so every agent's test
shard follows its own training label distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.partition_schemes import (
    _SCHEME_CODES,
    _STREAM_TEST,
    _check_labels,
    _class_members,
    partition_indices,
)
from fldata.partition_spec import PartitionSpec


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
