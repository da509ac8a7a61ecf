"""bench/server_loop.py's measurement of the server step's cost per map by batch size."""

from __future__ import annotations

from test_bench_baselines import load


def test_step_cost_measures_each_batch_size() -> None:
    cost = load("server_loop").step_cost("resnet55_server", batches=(2, 4), steps=1)
    assert set(cost["by_batch"]) == {"2", "4"}
    assert all(v["ms_per_map"] > 0 and v["step_ms"] > 0 for v in cost["by_batch"].values())
    assert all(v["ms_per_map"] == v["step_ms"] / int(b) for b, v in cost["by_batch"].items())
