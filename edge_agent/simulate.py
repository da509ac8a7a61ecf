"""``edge-agent simulate``: many agents in one process.

Each simulated agent is a full :class:`EdgeAgent` with its own MQTT client id,
connection, state and data shard, so the broker and the server see N real
agents. The dataset is loaded once and partitioned once; compute is shared
sequentially (one agent trains at a time), which lets 128 agents run on a
2-core machine within memory. Used by scale tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from fldata import ArrayDataset, load_agent_subsets

from .agent import EdgeAgent, agent_data_spec
from .config import DataConfig, EdgeConfig

log = logging.getLogger("edge_agent.simulate")


@dataclass(frozen=True)
class SimulationConfig:
    base: EdgeConfig  # agent ids become f"{prefix}{i}"
    agents: int
    prefix: str = "sim-"
    first_index: int = 0

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError(f"agents must be >= 1, got {self.agents}")


def shards(data: DataConfig, agents: int) -> list[tuple[ArrayDataset, ArrayDataset]]:
    """Every agent's (train, test) shard, loading and partitioning the dataset once; agent i's
    is the one a separate agent process with ``agent_index = i`` loads. Partition "none" (the
    data is the agent's own) is refused for several agents: each would get the same samples."""
    return load_agent_subsets(dataclasses.replace(agent_data_spec(data), num_agents=agents))


def build_agents(sim: SimulationConfig) -> list[EdgeAgent]:
    lock = threading.Lock()
    data = dataclasses.replace(sim.base.data, num_agents=sim.agents)
    agents = []
    for i, shard in enumerate(shards(data, sim.agents)):
        cfg = dataclasses.replace(
            sim.base,
            agent_id=f"{sim.prefix}{sim.first_index + i}",
            data=dataclasses.replace(data, agent_index=i),
            progress=False,
            threads=1,
            metrics_address=None,  # one port cannot serve many agents; the server's metrics show each of them
        )
        agents.append(EdgeAgent(cfg, data=shard, compute_lock=lock))
    return agents


def run_simulation(sim: SimulationConfig, stop: threading.Event | None = None) -> list[int]:
    """Run every agent in its own thread until the server ends the run (or ``stop``)."""
    agents = build_agents(sim)
    codes: list[int] = [0] * len(agents)

    def run(i: int) -> None:
        codes[i] = agents[i].run()

    threads = [threading.Thread(target=run, args=(i,), name=a.config.agent_id, daemon=True) for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    log.info("simulating %d agents", len(agents))
    try:
        while any(t.is_alive() for t in threads):
            if stop is not None and stop.is_set():
                for a in agents:
                    a.stop()
            for t in threads:
                t.join(0.5)
    except KeyboardInterrupt:
        for a in agents:
            a.stop()
        for t in threads:
            t.join(10)
    return codes
