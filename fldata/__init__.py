"""Datasets and partitioners shared by the edge agent and the cloud server.

The core (:mod:`fldata.datasets`, :mod:`fldata.partition`) needs numpy only, so a
torch-free edge backend can use it. Everything torch lives in
:mod:`fldata.torch_data`, which is *not* imported here: importing ``fldata``
never imports torch.

This package imports none of ``shared_protocol``, ``models``, ``edge_agent`` or
``cloud_server``.
"""

from fldata.datasets import (
    DATASET_NAMES,
    DOWNLOAD_TIMEOUT_S,
    SPLIT_ID_OFFSETS,
    ArrayDataset,
    DownloadError,
    compute_stats,
    dataset_stats,
    load_dataset,
    load_npz,
    make_synthetic,
    save_npz,
    take,
)
from fldata.partition import (
    PARTITION_SCHEMES,
    PartitionSpec,
    agent_shard,
    class_count_table,
    class_counts_per_agent,
    partition_indices,
    partition_test_indices,
    read_count_table,
    test_shard_for_agent,
)
from fldata.registry import DatasetSpec, get_dataset_spec, list_datasets, register_dataset
from fldata.subsets import NO_PARTITION, AgentDataSpec, agent_share, agent_shares, load_agent_subset, load_agent_subsets, seeded_subset

__all__ = [
    "DATASET_NAMES",
    "DOWNLOAD_TIMEOUT_S",
    "NO_PARTITION",
    "PARTITION_SCHEMES",
    "SPLIT_ID_OFFSETS",
    "AgentDataSpec",
    "ArrayDataset",
    "DatasetSpec",
    "DownloadError",
    "PartitionSpec",
    "agent_share",
    "agent_shard",
    "agent_shares",
    "class_count_table",
    "class_counts_per_agent",
    "compute_stats",
    "dataset_stats",
    "get_dataset_spec",
    "list_datasets",
    "load_agent_subset",
    "load_agent_subsets",
    "load_dataset",
    "load_npz",
    "make_synthetic",
    "partition_indices",
    "partition_test_indices",
    "read_count_table",
    "register_dataset",
    "save_npz",
    "seeded_subset",
    "take",
    "test_shard_for_agent",
]
