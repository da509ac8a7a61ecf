"""One way to an agent's data: the seeded subset, then its share; the agent process,
the simulation and the exporter all take it, so agent i trains on the same samples
however it was started, and partition "none" means the same everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.agent import load_agent_data
from edge_agent.config import DataConfig, EdgeConfig
from edge_agent.simulate import shards
from fldata import NO_PARTITION, AgentDataSpec, load_agent_subset, load_agent_subsets, load_dataset, seeded_subset, take

SUBSET = dict(train_samples=300, test_samples=90, seed=4)


def ids(ds) -> list[int]:  # type: ignore[no-untyped-def]
    return ds.sample_ids.tolist()


def test_the_subset_is_a_seeded_stratified_take_of_each_split() -> None:
    train, test = seeded_subset("synthetic", **SUBSET)
    assert ids(train) == ids(take(load_dataset("synthetic", "train"), 300, 4))
    assert ids(test) == ids(take(load_dataset("synthetic", "test"), 90, 4))
    assert ids(seeded_subset("synthetic", **SUBSET)[0]) == ids(train)  # reproducible
    assert ids(seeded_subset("synthetic", train_samples=300, seed=5)[0]) != ids(train)  # and seeded
    whole, _ = seeded_subset("synthetic", train_samples=10**9)
    assert len(whole) == len(load_dataset("synthetic", "train"))  # more than the split has: all of it
    with pytest.raises(ValueError, match="train_samples"):
        seeded_subset("synthetic", train_samples=-1)


@pytest.mark.parametrize("partition", ["iid", "dirichlet:0.5", "step:2"])
def test_one_agent_loaded_alone_gets_its_share_of_all_agents(partition: str) -> None:
    spec = AgentDataSpec("synthetic", partition=partition, num_agents=3, **SUBSET)
    everyone = load_agent_subsets(spec)
    assert len(everyone) == 3
    for i, (train, test) in enumerate(everyone):
        alone_train, alone_test = load_agent_subset(spec, i)
        assert ids(alone_train) == ids(train) and ids(alone_test) == ids(test)
    trained = [s for train, _ in everyone for s in ids(train)]
    assert len(trained) == len(set(trained))  # disjoint shares
    if partition == "iid":
        assert sorted(trained) == sorted(ids(seeded_subset("synthetic", **SUBSET)[0]))  # of the whole subset


def test_partition_none_is_the_agents_own_data_used_whole() -> None:
    train, test = seeded_subset("synthetic", **SUBSET)
    own = load_agent_subset(AgentDataSpec("synthetic", partition=NO_PARTITION, num_agents=5, **SUBSET), 3)
    assert ids(own[0]) == ids(train) and ids(own[1]) == ids(test)
    (single,) = load_agent_subsets(AgentDataSpec("synthetic", partition=NO_PARTITION, num_agents=1, **SUBSET))
    assert ids(single[0]) == ids(train)
    # Several simulated agents with "none" would all hold the same samples: refused, not turned into iid.
    with pytest.raises(ValueError, match='partition "none" would give all 3 agents the same samples.*iid'):
        load_agent_subsets(AgentDataSpec("synthetic", partition=NO_PARTITION, num_agents=3, **SUBSET))


def test_agent_index_out_of_range() -> None:
    with pytest.raises(ValueError, match="agent_index"):
        load_agent_subset(AgentDataSpec("synthetic", partition="iid", num_agents=2), 2)
    with pytest.raises(ValueError, match="num_agents"):
        AgentDataSpec("synthetic", num_agents=0)


def test_the_agent_process_and_the_simulation_load_the_same_shards() -> None:
    data = DataConfig(dataset="synthetic", partition="dirichlet:0.5", num_agents=3, train_samples=300, test_samples=90, seed=4)
    simulated = shards(data, 3)
    for i in range(3):
        train, test = load_agent_data(EdgeConfig(agent_id=f"a{i}", data=DataConfig(**{**data.__dict__, "agent_index": i})))
        assert ids(train) == ids(simulated[i][0]) and ids(test) == ids(simulated[i][1])
        np.testing.assert_array_equal(train.images, simulated[i][0].images)
    own = DataConfig(dataset="synthetic", partition="none", train_samples=300, test_samples=90, seed=4)
    assert ids(load_agent_data(EdgeConfig(agent_id="solo", data=own))[0]) == ids(shards(own, 1)[0][0])
    with pytest.raises(ValueError, match='partition "none"'):
        shards(own, 2)
