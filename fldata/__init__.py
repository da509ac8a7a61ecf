"""Datasets and partitioners shared by the edge agent and the cloud server.

The core (datasets, partitions, subsets: every module but :mod:`fldata.torch_data`)
needs numpy only, so a torch-free edge backend can use it. Everything torch lives in
:mod:`fldata.torch_data`, which is *not* imported here: importing ``fldata``
never imports torch.

This package imports none of ``shared_protocol``, ``models``, ``edge_agent`` or
``cloud_server``.
"""

from fldata.array_dataset import SPLIT_ID_OFFSETS, ArrayDataset
from fldata.count_table import read_count_table
from fldata.downloads import DOWNLOAD_TIMEOUT_S, DownloadError
from fldata.loaders import DATASET_NAMES, load_dataset
from fldata.npz_io import load_npz, save_npz
from fldata.partition_schemes import partition_indices
from fldata.partition_spec import PARTITION_SCHEMES, PartitionSpec
from fldata.registry import (
    DatasetSpec,
    get_dataset_spec,
    list_datasets,
    register_dataset,
)
from fldata.sampling import take
from fldata.shards import (
    agent_shard,
    class_count_table,
    class_counts_per_agent,
    partition_test_indices,
    test_shard_for_agent,
)
from fldata.stats import compute_stats, dataset_stats
from fldata.subsets import (
    NO_PARTITION,
    AgentDataSpec,
    agent_share,
    agent_shares,
    load_agent_subset,
    load_agent_subsets,
    seeded_subset,
    train_holdout,
)
from fldata.synthetic import make_synthetic

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
    "train_holdout",
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
