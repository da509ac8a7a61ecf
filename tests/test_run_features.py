"""Features every method gets: client sampling (FedAvg's C) in sync rounds, method
figures per round in the report, the run's rounds in the method's context, and agent
models seeded from the run's seed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cloud_server.assemble import build_server_method
from cloud_server.config import ServerConfig
from cloud_server.coordinator import Coordinator
from cloud_server.report import validate_report
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import agent_config, in_memory_federation, method_server_config, server_config

FEDAVG_SMALL = {"model": "resnet8", "batch_size": 32}


def test_client_fraction_is_validated() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="client_fraction"):
            ServerConfig(client_fraction=bad)


def test_sampling_draws_the_fraction_reproducibly(tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "fedavg", FEDAVG_SMALL, agents=5, client_fraction=0.4, min_agents=1, seed=3)
    method = build_server_method(config, device="cpu")
    coord = Coordinator(config, method, InMemoryTransport(InMemoryBroker(), "server"))
    agents = [f"agent-{i}" for i in range(5)]
    draws = [coord.registry.sample(r, agents) for r in range(1, 21)]
    assert all(len(d) == math.ceil(0.4 * 5) for d in draws)
    assert all(set(d) <= set(agents) and len(set(d)) == len(d) for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # not the same agents every round
    assert draws == [coord.registry.sample(r, agents) for r in range(1, 21)]  # seeded by (seed, round)
    # min_agents is a floor on the draw; C = 1 takes everyone.
    floor = Coordinator(method_server_config(tmp_path, "fedavg", FEDAVG_SMALL, agents=5, client_fraction=0.1, min_agents=3),
                        method, InMemoryTransport(InMemoryBroker(), "server2"))
    assert len(floor.registry.sample(1, agents)) == 3
    full = Coordinator(method_server_config(tmp_path, "fedavg", FEDAVG_SMALL, agents=5), method, InMemoryTransport(InMemoryBroker(), "s3"))
    assert full.registry.sample(1, agents) == agents


def test_sampling_is_refused_for_rounds_that_are_not_sync(tmp_path: Path) -> None:
    config = server_config(tmp_path, agents=2, client_fraction=0.5, method_config={"mode": "async"})
    method = build_server_method(config, device="cpu")
    with pytest.raises(ValueError, match="asynchronous"):
        Coordinator(config, method, InMemoryTransport(InMemoryBroker(), "server"))


def test_sampled_rounds_use_only_the_drawn_agents_and_report_method_figures(tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "fedavg", FEDAVG_SMALL, agents=4, rounds=3, client_fraction=0.5, seed=1)
    fed = in_memory_federation(config, [agent_config("t1", i, 4, train_samples=64, test_samples=32) for i in range(4)])
    assert fed.coordinator.method.ctx.rounds == 3  # the run's length reaches the method
    # Numpy values and non-finite floats are made strict JSON by the coordinator.
    fed.coordinator.method.round_report = lambda r: {"round_twice": np.int64(2 * r), "vec": np.arange(2, dtype=np.float32), "nan": float("nan")}
    report = fed.start().join(timeout_s=240)
    validate_report(report)
    rounds = report["rounds"]
    assert [r["status"] for r in rounds] == ["ok"] * 3
    for r in rounds:
        assert len(r["participants"]) == 2
        assert r["participants"] == fed.coordinator.registry.sample(r["round"], [f"agent-{i}" for i in range(4)])
        assert set(r["per_agent"]) == set(r["participants"])  # nobody outside the draw trained
        assert r["method"] == {"round_twice": 2 * r["round"], "vec": [0.0, 1.0], "nan": None}


def _initial_edge_model(index: int, seed: int) -> dict[str, np.ndarray]:
    from dataclasses import replace

    from edge_agent.agent import EdgeAgent
    from models import state_dict_to_arrays
    from shared_protocol.messages import Welcome

    config = agent_config("t1", index, 2, train_samples=32, test_samples=8)
    config = replace(config, data=replace(config.data, seed=seed))
    agent = EdgeAgent(config, transport=InMemoryTransport(InMemoryBroker(), config.agent_id))
    agent._on_welcome(Welcome(run="t1", round=0, sender="server", accepted=True, method="fedgkt", settings=_gkt_settings()))
    return state_dict_to_arrays(agent.method.model)


def _gkt_settings() -> dict:
    config = server_config(Path("/nonexistent"), agents=2)
    return build_server_method(config, device="cpu").welcome_settings()


def test_agent_models_start_from_the_run_seed() -> None:
    first, again = _initial_edge_model(0, seed=0), _initial_edge_model(0, seed=0)
    assert all(np.array_equal(first[k], again[k]) for k in first)  # the same run config starts alike
    other_agent, other_seed = _initial_edge_model(1, seed=0), _initial_edge_model(0, seed=1)
    name = next(k for k in first if k.endswith("weight") and first[k].ndim == 4)
    assert not np.array_equal(first[name], other_agent[name])  # agents do not all start as one model
    assert not np.array_equal(first[name], other_seed[name])


def test_edgesplit_local_passes_the_client_fraction(tmp_path: Path) -> None:
    from cloud_server.launcher import build_parser, write_configs
    from shared_protocol.tomlio import read_toml

    args = build_parser().parse_args(["local", "--method", "fedavg", "--agents", "4", "--client-fraction", "0.5"])
    server_toml, agents = write_configs(args, "cf", tmp_path, "mqtt://127.0.0.1:1883")
    config = ServerConfig.from_dict(read_toml(server_toml))
    assert config.client_fraction == 0.5 and len(agents) == 4
