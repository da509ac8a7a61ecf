"""An agent uses its RoundStart's ``deadline_s``: training that cannot finish in time is
skipped a batch at a time, and the agent says so (a warning, and the count in its
round_end's costs), instead of training for a round the server has already closed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cloud_server.assemble import build_server_method
from edge_agent.agent import EdgeAgent
from edge_agent.deadline import RoundDeadline
from fedhelpers import agent_config, method_server_config
from shared_protocol.messages import RoundStart, Welcome
from shared_protocol.transport import InMemoryBroker, InMemoryTransport


def test_batches_that_cannot_finish_in_time_are_skipped_and_counted() -> None:
    now_s = [0.0]
    deadline = RoundDeadline(10.0, clock=lambda: now_s[0])  # training may use 8 s (the rest is kept for the upload)
    loader = list(range(10))
    trained = []
    for _epoch in range(2):
        for batch in deadline.batches(loader):
            now_s[0] += 1.0  # each step takes 1 s
            trained.append(batch)
    assert trained == list(range(8))  # the 9th would end past 8 s
    assert deadline.trained_batches == 8 and deadline.skipped_batches == 2 + 10  # the second epoch did not fit at all
    assert len(deadline.batches(loader)) == 10


def test_the_first_batch_always_runs_and_no_deadline_skips_nothing() -> None:
    late = RoundDeadline(0.0, clock=lambda: 0.0)
    assert list(late.batches([1, 2, 3])) == [1] and late.skipped_batches == 2
    unbounded = RoundDeadline()
    assert list(unbounded.batches([1, 2, 3])) == [1, 2, 3] and unbounded.skipped_batches == 0
    with pytest.raises(ValueError, match="deadline_s"):
        RoundDeadline(-1.0)


@pytest.mark.parametrize("deadline_s, skipped", [(0.0, 4), (600.0, 0)])
def test_an_agent_skips_training_past_its_deadline_and_says_so(tmp_path: Path, caplog, deadline_s: float, skipped: int) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    config = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 32}, agents=1)
    server = build_server_method(config, device="cpu")
    agent = EdgeAgent(agent_config("t1", 0, 1, train_samples=160, test_samples=16),  # 5 batches of 32
                      transport=InMemoryTransport(InMemoryBroker(), "agent-0"))
    agent.transport.connect()
    agent._on_welcome(Welcome(run="t1", round=0, sender="server", accepted=True, method="fedavg", settings=server.welcome_settings()))
    round_config, weights = server.round_config(1, "agent-0", False)
    agent._on_round_start(RoundStart(run="t1", round=1, sender="server", method="fedavg", config=round_config,
                                     deadline_s=deadline_s, weights=weights))
    costs = agent._last_round_end.costs
    assert costs.skipped_batches == skipped
    assert costs.samples == 32 * (5 - skipped)
    warned = [r.getMessage() for r in caplog.records if "could not finish within the round's deadline" in r.getMessage()]
    assert warned == ([f"round 1: skipped 4 of 5 training batches: they could not finish within the round's deadline (0 s); "
                       "the round_end says so"] if skipped else [])


def test_a_generator_with_a_stated_length_counts_what_it_skipped() -> None:
    # The onnxruntime backend trains from a batch generator, which has no len().
    now = [0.0]
    deadline = RoundDeadline(10.0, clock=lambda: now[0])  # 8 s for training
    taken = []
    for batch in deadline.batches((b for b in range(6)), length=6):
        taken.append(batch)
        now[0] += 3.0  # each batch takes 3 s: the third would end past 8 s
    assert taken == [0, 1] and deadline.skipped_batches == 4
    assert list(deadline.batches((b for b in range(6)), length=6)) == [] and deadline.skipped_batches == 10
