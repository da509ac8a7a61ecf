"""FedKD runs are reproducible when the agents are threads of one process (in-memory
federations, ``edge-agent simulate``, the benchmarks).

The agents' initial models (FedKD's private mentor and W_h) were drawn from torch's global
RNG, which every thread of the process shares, after ``torch.manual_seed`` of the agent's
seed. Agents welcomed at the same time seeded and drew in whatever order the threads were
scheduled, so the same seed gave other mentors, other uploads and other accuracies from run
to run. Every agent now draws from its own generator (``EdgeContext.weights_generator``,
``models.seeding``).

The server did the same with the initial global mentee (``torch.manual_seed(seed)``, then the
mentee from the global RNG), while the test's other thread (or, in the full suite, threads
left by other tests) reseeded that RNG: dumping two runs per round showed their first
difference in the server's initial mentee, every agent's initial mentor and W_h equal; all
uploads and aggregates differed from there on. The server draws from its own generator too
(tests/test_server_seeding.py pins it for every method that builds initial models)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.methods.base import EdgeContext
from edge_agent.methods.fedkd import FedKdEdge
from fldata import make_synthetic
from models import state_dict_to_arrays

from fedhelpers import agent_config, in_memory_federation, server_config

# Tiny models (the KD grid's pair: ConvNet mentors, SimpleCNN mentee) and data: a run is seconds.
TINY_KD = {"mentor_model": "convnet", "mentee_model": "simplecnn", "batch_size": 16, "local_epochs": 1}
AGENTS = 4


def _context(seed: int) -> EdgeContext:
    train = make_synthetic(32, in_channels=1, seed=0)
    test = make_synthetic(16, in_channels=1, seed=0, split="test")
    return EdgeContext(agent_id="agent-0", run_id="det", instance="i", train=train, test=test,
                       settings={"num_classes": 10, **TINY_KD}, send=lambda *a, **k: None, seed=seed)


def _initial(edge: FedKdEdge) -> dict[str, np.ndarray]:
    return {**{f"mentor/{k}": v for k, v in state_dict_to_arrays(edge.mentor).items()},
            **{f"projection/{k}": v for k, v in state_dict_to_arrays(edge.projection).items()}}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def _another_thread_using_the_global_rng(pause_s: float = 0.001) -> Iterator[None]:
    """What other threads of the process (other agents, the server) may do meanwhile: draw
    from torch's global RNG and reseed it."""
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            torch.manual_seed(int(torch.randint(0, 1000, ())))
            time.sleep(pause_s)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_an_agents_initial_mentor_depends_on_its_seed_alone() -> None:
    with _another_thread_using_the_global_rng():
        first, second, other_seed = (_initial(FedKdEdge(_context(seed))) for seed in (1000, 1000, 1001))
    assert _same(first, second)
    assert not _same(first, other_seed)


def _run(tmp: Path, seed: int, rounds: int = 2) -> dict[str, Any]:
    """A FedKD federation of AGENTS agent threads, in memory; what it reports per round, minus
    what is measured in time (wall times, and the round_end frames that carry them)."""
    # The round deadline beyond the join's 300 s: an agent starved of CPU past 80% of a round's
    # deadline skips its remaining batches by design (edge_agent/deadline.py), which is a
    # difference of timing, not of seeding (seen once with two CPU hogs outranking the niced
    # test); here a starved run fails as "did not finish in time" instead.
    cfg = replace(server_config(tmp, run_id="kd-det", agents=AGENTS, rounds=rounds, seed=seed, client_fraction=0.5, eval_samples=32,
                                round_deadline_s=900.0),
                  method="fedkd", method_config=dict(TINY_KD))
    agents = []
    for i in range(AGENTS):
        base = agent_config(cfg.run_id, i, AGENTS, train_samples=64, test_samples=32)
        agents.append(replace(base, data=replace(base.data, seed=seed, partition="dirichlet:0.5")))
    fed = in_memory_federation(cfg, agents).start()
    report = fed.join(300)
    server = fed.coordinator.method
    rounds = [{key: r.get(key) for key in ("round", "participants", "completed", "accuracy", "local_accuracy")}
              | {"by_label": {k: r["evaluation"][k] for k in ("accuracy", "local_accuracy")},
                 "svd_bytes": {k: r["method"][k] for k in ("up_svd_bytes", "down_svd_bytes", "fedkd_bytes")},
                 "ranks": r["method"]["ranks"]}
              for r in report["rounds"]]
    mentee = hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(server.global_state.items()))).hexdigest()
    # Per agent and round: ranks, factor bytes, update frame bytes, mentor and mentee losses.
    return {"rounds": rounds, "agents": [h["agents"] for h in server.history], "global_mentee_sha256": mentee}


@pytest.mark.slow
def test_two_in_memory_runs_with_the_same_seed_agree(tmp_path: Path) -> None:
    first = _run(tmp_path / "a", seed=0)  # the agents' own threads race as they are scheduled
    with _another_thread_using_the_global_rng(pause_s=0.01):  # and here something else draws too
        second = _run(tmp_path / "b", seed=0)
    assert first == second
    # The comparison can fail: another seed (another split, other initial models) differs from
    # its first round on (one round is enough to see it).
    other = _run(tmp_path / "c", seed=1, rounds=1)
    assert other["rounds"][0] != first["rounds"][0] and other["agents"][0] != first["agents"][0]
