"""An agent's data as its data config describes it: a seeded subset, then its share.

The one place this is done, for the agent, the many-agents simulation, the
shard exporter and the benchmarks, so that agent ``i`` of a run trains on the
same samples (with the same ids) however it was started.

Order: first the seeded subset of each split (``train_samples`` /
``test_samples``; 0 = the whole split), then the partition of that subset among
``num_agents``: ``iid``, ``dirichlet:A``, ``step:K`` or ``table:FILE`` (see
:class:`fldata.partition_spec.PartitionSpec`), each agent's test share following its
training label mix.

``partition = "none"`` means the data is the agent's own: it is used whole (a
device reading its own folder or an exported ``.npz`` shard). A simulation of
several agents from one dataset with ``"none"`` would give every agent the same
samples, so it is refused there rather than quietly turned into ``iid``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.loaders import load_dataset
from fldata.partition_schemes import partition_indices
from fldata.partition_spec import PartitionSpec
from fldata.sampling import take
from fldata.shards import partition_test_indices

__all__ = ["NO_PARTITION", "AgentDataSpec", "agent_share", "agent_shares", "load_agent_subset", "load_agent_subsets", "seeded_subset",
           "train_holdout"]

#: The partition of an agent whose dataset is its own.
NO_PARTITION = "none"

Shard = tuple[ArrayDataset, ArrayDataset]  # (train, test)


def seeded_subset(
    dataset: str,
    *,
    root: str | None = None,
    download: bool = False,
    train_samples: int = 0,
    test_samples: int = 0,
    seed: int = 0,
) -> Shard:
    """The train and test splits of ``dataset``, each cut to a stratified subset
    seeded by ``seed`` (0 samples: the whole split; more than it has: all of it)."""
    if train_samples < 0 or test_samples < 0:
        raise ValueError(f"train_samples and test_samples must be >= 0, got {train_samples} and {test_samples}")
    train = load_dataset(dataset, "train", root, download)
    test = load_dataset(dataset, "test", root, download)
    if train_samples:
        train = take(train, min(train_samples, len(train)), seed)
    if test_samples:
        test = take(test, min(test_samples, len(test)), seed)
    return train, test


def agent_shares(train: ArrayDataset, test: ArrayDataset, partition: str, num_agents: int, seed: int = 0) -> list[Shard]:
    """Every agent's (train, test) share of ``train`` and ``test``, partitioned once."""
    if partition == NO_PARTITION:
        if num_agents != 1:
            raise ValueError(f'partition "none" would give all {num_agents} agents the same samples; '
                             "partition the dataset among them: iid, dirichlet:ALPHA, step:K or table:FILE")
        return [(train, test)]
    spec = PartitionSpec.parse(partition, num_agents, seed)
    train_parts = partition_indices(train.labels, spec, train.num_classes)
    test_parts = partition_test_indices(test.labels, spec, train.labels, test.num_classes)
    return [(train.subset(tp), test.subset(sp)) for tp, sp in zip(train_parts, test_parts)]


def agent_share(train: ArrayDataset, test: ArrayDataset, partition: str, num_agents: int, agent_index: int, seed: int = 0) -> Shard:
    """Agent ``agent_index``'s (train, test) share; with partition "none", the whole of both."""
    if partition == NO_PARTITION:
        return train, test
    if not 0 <= agent_index < num_agents:
        raise ValueError(f"agent_index must be in [0, {num_agents}), got {agent_index}")
    return agent_shares(train, test, partition, num_agents, seed)[agent_index]


@dataclass(frozen=True)
class AgentDataSpec:
    """Where a run's agents take their data from: the dataset, its seeded subset, the partition."""

    dataset: str
    partition: str = "iid"  # iid | dirichlet:A | step:K | table:FILE | none (the agent's own data)
    num_agents: int = 1
    seed: int = 0  # of the subset and of the partition
    root: str | None = None
    download: bool = False
    train_samples: int = 0  # 0: the whole split
    test_samples: int = 0

    def __post_init__(self) -> None:
        if self.num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {self.num_agents}")

    def subset(self) -> Shard:
        """The seeded subset every agent's share is taken from."""
        return seeded_subset(self.dataset, root=self.root, download=self.download, train_samples=self.train_samples,
                             test_samples=self.test_samples, seed=self.seed)


def load_agent_subset(spec: AgentDataSpec, agent_index: int) -> Shard:
    """Agent ``agent_index``'s (train, test) data: the seeded subset, then its share."""
    return agent_share(*spec.subset(), spec.partition, spec.num_agents, agent_index, spec.seed)


def load_agent_subsets(spec: AgentDataSpec) -> list[Shard]:
    """Every agent's data, loading and partitioning the dataset once (a simulation);
    agent ``i``'s is what :func:`load_agent_subset` gives agent ``i``."""
    return agent_shares(*spec.subset(), spec.partition, spec.num_agents, spec.seed)


def train_holdout(dataset: str, agent_train_samples: int, agent_seed: int, root: str | None, download: bool,
                  too_many: str) -> ArrayDataset:
    """The training split of ``dataset`` less ``take(train, agent_train_samples, agent_seed)``,
    the seeded subset every agent of a local simulation takes before partitioning
    (``edge_agent.agent.load_agent_data``): no agent trains on a sample of it, whatever the
    partition. ``too_many`` (with ``{n}``, ``{k}``) says why nothing is left when the agents take all."""
    train = load_dataset(dataset, "train", root, download)
    if agent_train_samples >= len(train):
        raise ValueError(too_many.format(n=len(train), k=agent_train_samples) + "; nothing is left to hold out")
    agents = take(train, agent_train_samples, agent_seed)
    return train.subset(~np.isin(train.sample_ids, agents.sample_ids))
