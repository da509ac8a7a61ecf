"""Helpers to run small federations inside a test: a server and agents in threads
(in-memory or over a real broker) or as separate processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cloud_server.assemble import build_server
from cloud_server.config import ServerConfig
from cloud_server.coordinator import Coordinator
from edge_agent.agent import EdgeAgent
from edge_agent.config import DataConfig, EdgeConfig
from shared_protocol.tomlio import write_toml
from shared_protocol.transport import InMemoryBroker, InMemoryTransport, MqttTransport, Transport, TransportConfig

ROOT = Path(__file__).resolve().parents[1]

# Small enough for 2 CPU cores: ResNet-55 on a few hundred 32x32 maps per round.
FAST_GKT = {
    "server_epochs": 1,
    "edge_epochs": 1,
    "server_batch_size": 32,
    "edge_batch_size": 32,
    "upload_batch_samples": 64,
}


def server_config(tmp: Path, run_id: str = "t1", agents: int = 2, rounds: int = 2, method_config: dict | None = None, **kw: Any) -> ServerConfig:
    base = dict(
        run_id=run_id, out_dir=str(tmp / "run"), expected_agents=agents, rounds=rounds, round_deadline_s=120.0,
        registration_timeout_s=60.0, dataset="synthetic", num_classes=10, progress=False, eval_samples=80,
        method_config={**FAST_GKT, **(method_config or {})},
    )
    base.update(kw)
    return ServerConfig(**base)


def agent_config(run_id: str, index: int, agents: int, broker_url: str = "mqtt://127.0.0.1:1", train_samples: int = 160, test_samples: int = 80, **kw: Any) -> EdgeConfig:
    data = DataConfig(dataset="synthetic", partition="iid", num_agents=agents, agent_index=index, seed=0,
                      train_samples=train_samples, test_samples=test_samples)
    return EdgeConfig(agent_id=f"agent-{index}", run_id=run_id, broker_url=broker_url, data=data, progress=False, **kw)


@dataclass
class Federation:
    coordinator: Coordinator
    agents: list[EdgeAgent]
    threads: list[threading.Thread] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    error: list[BaseException] = field(default_factory=list)

    def start(self) -> "Federation":
        def serve() -> None:
            try:
                self.result.update(self.coordinator.run())
            except BaseException as exc:  # re-raised by join() in the test thread
                self.error.append(exc)

        t = threading.Thread(target=serve, name="server", daemon=True)
        t.start()
        self.threads.append(t)
        for agent in self.agents:
            at = threading.Thread(target=agent.run, name=agent.config.agent_id, daemon=True)
            at.start()
            self.threads.append(at)
        return self

    def join(self, timeout_s: float = 300) -> dict[str, Any]:
        self.threads[0].join(timeout_s)
        assert not self.threads[0].is_alive(), "server did not finish in time"
        for agent in self.agents:
            agent.stop()
        for t in self.threads[1:]:
            t.join(30)
        if self.error:
            raise self.error[0]
        return self.result


def make_server(config: ServerConfig, transport: Transport) -> Coordinator:
    """The server as ``cloud-server run`` builds it, on the CPU, over ``transport``."""
    return build_server(config, transport, device="cpu")


def in_memory_federation(config: ServerConfig, agent_configs: list[EdgeConfig]) -> Federation:
    broker = InMemoryBroker()
    coord = make_server(config, InMemoryTransport(broker, "server"))
    agents = [EdgeAgent(c, transport=InMemoryTransport(broker, c.agent_id)) for c in agent_configs]
    return Federation(coord, agents)


def mqtt_federation(config: ServerConfig, agent_configs: list[EdgeConfig], broker_url: str) -> Federation:
    config = replace(config, broker_url=broker_url)
    coord = make_server(config, MqttTransport(replace(config.transport_config(), connect_timeout_s=10)))
    agents = [EdgeAgent(replace(c, broker_url=broker_url)) for c in agent_configs]
    return Federation(coord, agents)


def write_agent_toml(path: Path, config: EdgeConfig) -> Path:
    agent = {k: v for k, v in config.to_dict().items() if k not in ("data", "memory") and v is not None}
    data = {k: v for k, v in config.to_dict()["data"].items() if v is not None}
    write_toml(path, {"agent": agent, "data": data, "memory": config.to_dict()["memory"]})
    return path


def write_server_toml(path: Path, config: ServerConfig) -> Path:
    d = config.to_dict()
    method_cfg = d.pop("method_config")
    server = {k: v for k, v in d.items() if v is not None}
    write_toml(path, {"server": server, config.method: method_cfg})
    return path


def child_pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a child process: ``first``, the project root, then this process's own
    PYTHONPATH (where a machine may keep packages, e.g. the GPU kit's /tmp/site with paho-mqtt)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*(str(p) for p in first), str(ROOT), *inherited])


def spawn(module: str, *args: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
    f = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def method_server_config(tmp: Path, method: str, method_config: dict | None = None, **kw: Any) -> ServerConfig:
    """``server_config`` for another method: its own table instead of FedGKT's fast settings."""
    return replace(server_config(tmp, **kw), method=method, method_config=dict(method_config or {}))


def distinct_resnet8_state(seed: int) -> dict[str, "np.ndarray"]:
    """A ResNet-8 state (10 classes, 1 channel) with every entry, BatchNorm buffers and
    counters included, distinct per seed: what aggregation tests average."""
    import numpy as np
    import torch

    from models import build_model, state_dict_to_arrays

    torch.manual_seed(seed)
    state = state_dict_to_arrays(build_model("resnet8", 10, 1))
    rng = np.random.default_rng(seed)
    for name, array in state.items():
        if array.dtype.kind == "f":
            state[name] = (array + rng.normal(size=array.shape)).astype(array.dtype)
            if name.endswith("running_var"):
                state[name] = np.abs(state[name]) + 0.1
        else:
            state[name] = np.asarray(rng.integers(0, 1000), dtype=array.dtype)
    return state
