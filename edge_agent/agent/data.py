"""This agent's data as its config describes it: the shards it trains and tests on
(``fldata.subsets``), held in memory or, with ``[memory] shard_on_disk``, in
memory-mapped files."""

from __future__ import annotations

from fldata import AgentDataSpec, ArrayDataset, load_agent_subset
from fldata.downloads import default_data_root
from fldata.mapped import keep_on_disk

from ..config import DataConfig, EdgeConfig


def agent_data_spec(data: DataConfig) -> AgentDataSpec:
    """The data config as fldata's description of the run's agents' data."""
    return AgentDataSpec(dataset=data.dataset, partition=data.partition, num_agents=data.num_agents, seed=data.seed,
                         root=data.root, download=data.download, train_samples=data.train_samples, test_samples=data.test_samples)


def load_agent_data(config: EdgeConfig) -> tuple[ArrayDataset, ArrayDataset]:
    """This agent's train and test shards, as the data config describes (``fldata.subsets``)."""
    return load_agent_subset(agent_data_spec(config.data), config.data.agent_index)


def shards_as_configured(config: EdgeConfig, train: ArrayDataset, test: ArrayDataset) -> tuple[ArrayDataset, ArrayDataset]:
    """The shards as ``[memory]`` wants them held: with ``shard_on_disk``, their images in
    unnamed files under the data directory, memory-mapped (:func:`fldata.mapped.keep_on_disk`)."""
    if not config.memory.shard_on_disk:
        return train, test
    where = default_data_root() / "shards"
    return keep_on_disk(train, where), keep_on_disk(test, where)
