"""Seeded, deterministic partitions of a dataset across agents (numpy only), by their
public names.

Each job lives in its own module; this one gathers their public names so that
``from fldata.partition import ...`` keeps working (new code imports from the
module that does the job):

- :mod:`fldata.partition_spec`: :class:`PartitionSpec`, how a dataset is split;
- :mod:`fldata.partition_schemes`: :func:`partition_indices`, the schemes
  (``iid``, ``dirichlet``, ``step``, ``table``) and their rules;
- :mod:`fldata.count_table`: :func:`read_count_table`, the ``table`` scheme's CSV;
- :mod:`fldata.shards`: each agent's shard and local test shard, class counts.
"""

from __future__ import annotations

from fldata.count_table import read_count_table
from fldata.partition_schemes import partition_indices
from fldata.partition_spec import PARTITION_SCHEMES, PartitionSpec
from fldata.shards import (
    agent_shard,
    class_count_table,
    class_counts_per_agent,
    partition_test_indices,
    test_shard_for_agent,
)

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
