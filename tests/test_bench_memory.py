"""bench/low_memory.py and bench/footprint.py: the accuracy cost of --low-memory is
computed from paired seeds, and the recorded results are of the settings the agent uses."""

from __future__ import annotations

import json

from edge_agent.config import MemoryConfig
from test_bench_baselines import RESULTS, load


def _run(mode: str, seed: int, server: float, edges: float) -> dict:
    return {"mode": mode, "seed": seed, "final_accuracy": server, "final_edge_accuracy": edges}


def test_differences_pair_runs_of_the_same_seed() -> None:
    low_memory = load("low_memory")
    runs = [_run("micro-batch-16", 1, 0.70, 0.50), _run("default", 0, 0.80, 0.60), _run("micro-batch-16", 0, 0.78, 0.61),
            _run("default", 1, 0.75, 0.55), _run("micro-batch-8", 2, 0.9, 0.9)]  # seed 2 has no default: no pair
    summary = low_memory.summarise(runs)
    assert summary["micro_minus_default"] == [
        {"mode": "micro-batch-16", "seed": 0, "server_points": -2.0, "edge_points": 1.0},
        {"mode": "micro-batch-16", "seed": 1, "server_points": -5.0, "edge_points": -5.0},
    ]
    assert abs(summary["default"]["final_accuracy_mean"] - 0.775) < 1e-9
    assert summary["micro-batch-8"]["seeds"] == [2]


def test_the_recorded_accuracy_cost_is_of_the_preset_on_paired_seeds() -> None:
    low_memory = load("low_memory")
    data = json.loads((RESULTS / "low_memory.json").read_text())
    preset = f"micro-batch-{MemoryConfig.low().micro_batch_samples}"
    assert low_memory.MODES[preset] == {"micro_batch_samples": MemoryConfig.low().micro_batch_samples}
    seeds = {mode: sorted(r["seed"] for r in data["runs"] if r["mode"] == mode) for mode in ("default", preset)}
    assert seeds["default"] == seeds[preset] and len(seeds["default"]) >= 2
    assert all(len(r["accuracy"]) == data["setting"]["rounds"] for r in data["runs"])
    assert data["summary"] == low_memory.summarise(data["runs"])


def test_the_footprint_bench_measures_the_agents_own_settings() -> None:
    footprint = load("footprint")
    assert footprint.memory_for("default") == MemoryConfig()
    assert footprint.memory_for("low-memory") == MemoryConfig.low()
    assert footprint.memory_for("micro-batch") == MemoryConfig(micro_batch_samples=MemoryConfig.low().micro_batch_samples)
