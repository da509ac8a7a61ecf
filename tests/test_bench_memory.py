"""The memory benches measure the agent's own settings: bench/micro/test_footprint.py's modes are the agent's
presets, and the low_memory experiment's micro-batches are `--low-memory`'s, set on every agent."""

from __future__ import annotations

from edge_agent.config import MemoryConfig
from fedhelpers import ROOT

from cloud_server.experiments.experiment_file import load_experiment
from cloud_server.experiments.runner import cell_command


def test_the_low_memory_experiment_pairs_the_default_with_the_presets_micro_batches_on_the_same_seeds() -> None:
    experiment = load_experiment(ROOT / "bench" / "experiments" / "low_memory.toml")
    preset = MemoryConfig.low().micro_batch_samples
    settings = {v.name: dict(v.overrides.settings) for v in experiment.variants}
    assert settings["default"] == {}
    assert {"memory.micro_batch_samples": preset} in settings.values()
    commands = {c.key: cell_command(experiment, c) for c in experiment.cells()}
    micro = [key for key, command in commands.items() if f"memory.micro_batch_samples={preset}" in command]
    plain = [key for key, command in commands.items() if not any(a.startswith("memory.") for a in command)]
    seeds = sorted(experiment.seeds)
    assert len(seeds) >= 2 and len(micro) == len(plain) == len(seeds) * len(experiment.partitions)
    assert all(v.seeds in ((), tuple(seeds)) for v in experiment.variants)  # every mode on the same seeds: paired


def test_the_footprint_bench_measures_the_agents_own_settings() -> None:
    import importlib.util
    import sys

    if str(ROOT / "bench" / "micro") not in sys.path:
        sys.path.append(str(ROOT / "bench" / "micro"))  # agent_worker.py imports fresh.py beside it
    spec = importlib.util.spec_from_file_location("edgesplit_bench_agent_worker", ROOT / "bench" / "micro" / "agent_worker.py")
    assert spec is not None and spec.loader is not None
    footprint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(footprint)
    assert footprint.memory_for("default") == MemoryConfig()
    assert footprint.memory_for("low-memory") == MemoryConfig.low()
    assert footprint.memory_for("micro-batch") == MemoryConfig(micro_batch_samples=MemoryConfig.low().micro_batch_samples)
