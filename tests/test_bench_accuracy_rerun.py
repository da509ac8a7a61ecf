"""bench/accuracy_rerun.py: a rerun with the recorded figures is "same", one digit off is not,
and the wire is reported as a difference."""

from __future__ import annotations

import copy
from typing import Any

from test_bench_baselines import load


def _run() -> dict[str, Any]:
    return {"final_accuracy": 0.8, "rounds": [
        {"round": 1, "accuracy": 0.5, "local_accuracy": 0.52, "edge_accuracy": None, "edge_train_flops": 10, "samples": 4,
         "up_wire": 100, "down_wire": 50, "wire": 150},
        {"round": 2, "accuracy": 0.8, "local_accuracy": 0.81, "edge_accuracy": None, "edge_train_flops": 20, "samples": 8,
         "up_wire": 100, "down_wire": 50, "wire": 150}]}


def test_same_figures_to_the_last_digit_with_the_wire_as_a_difference() -> None:
    rerun = load("accuracy_rerun")
    new = _run()
    for r in new["rounds"]:
        r["up_wire"] += 27
        r["wire"] += 27
    out = rerun.compare(_run(), new)
    assert out["same_figures"] is True
    assert out["rounds"][0]["wire_delta_bytes"] == {"up_wire": 27, "down_wire": 0, "wire": 27}
    off = copy.deepcopy(new)
    off["rounds"][1]["local_accuracy"] = 0.8100001
    assert rerun.compare(_run(), off)["same_figures"] is False
    flops = copy.deepcopy(new)
    flops["rounds"][0]["edge_train_flops"] = 11
    assert rerun.compare(_run(), flops)["same_figures"] is False
    short = copy.deepcopy(new)
    short["rounds"].pop()
    assert rerun.compare(_run(), short)["same_figures"] is False
