"""A Pi-sized agent stays Pi-sized for the whole run: what it holds after round 15 is what it
held after round 3.

A FedGKT agent runs 15 rounds over the in-memory transport against a scripted server (round
start, feature uploads, server logits for every sample, an evaluation each round: what the
real server sends, in its order), with tracemalloc on; its Python-level allocations (numpy
arrays included) after round 15 may exceed those after round 3 by at most
:data:`GROWTH_BOUND_BYTES`. A deliberately leaking agent (a transport that keeps every blob it
sent, as an unbounded resend cache would) must fail the same check; the agent under test
has the MQTT transport's resend cache, which it must empty at every round start (kept, it
filled up to its bound over the first rounds). The per-round RSS side
(the agent's own per-round peak, the growth warning) is checked here too; the long-run
numbers are bench/micro/test_footprint.py::test_long_run's.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import mmap
import threading
import tracemalloc

import numpy as np
import pytest

from edge_agent.agent import EdgeAgent
from edge_agent.config import DataConfig, EdgeConfig, MemoryConfig
from edge_agent.costs import RoundPeakRss
from fldata import make_synthetic
from shared_protocol.messages import EvalRequest, RoundEnd, RoundStart, Shutdown, Welcome, decode_message, encode_message, peek_header
from shared_protocol.methods.fedgkt import GktRoundConfig, GktServerLogits
from shared_protocol.topics import Topics
from shared_protocol.mqtt.chunking import ChunkedBlob
from shared_protocol.transport import InMemoryBroker, InMemoryTransport, ResendCache, TransportConfig

pytest.importorskip("torch")

ROUNDS = 15
BASELINE_ROUND = 3
#: What an agent may add to its Python-level allocations between round 3 and round 15: the
#: noise of interpreter caches (a small fraction of this), below a leak of anything round-sized
#: (twelve rounds of this test's uploads kept are several times this).
GROWTH_BOUND_BYTES = 2 * 1024 * 1024
RUN, AGENT = "mem-rounds", "agent-0"


class CachesSentBlobs(InMemoryTransport):
    """The in-memory transport with the MQTT transport's resend cache (the same class, at its
    default bound): what the agent holds for resends is part of what it holds."""

    def __init__(self, broker: InMemoryBroker, client_id: str) -> None:
        super().__init__(broker, client_id)
        self.resend_cache = ResendCache(TransportConfig().resend_cache_bytes)

    def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
        self.resend_cache.remember(topic, ChunkedBlob(bytes(blob)))
        super().publish(topic, blob, retain, reply_topic, wait)

    def drop_resend_cache(self) -> None:
        self.resend_cache.clear()


class KeepsEverySentBlob(InMemoryTransport):
    """The control's leak: every published blob kept for a resend that never comes."""

    def __init__(self, broker: InMemoryBroker, client_id: str) -> None:
        super().__init__(broker, client_id)
        self.kept: list[bytes] = []

    def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
        self.kept.append(bytes(blob))
        super().publish(topic, blob, retain, reply_topic, wait)


def _traced_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """What a snapshot holds, less tracemalloc's own (an earlier snapshot kept for comparison)."""
    return sum(stat.size for stat in snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)]).statistics("filename"))


def _run_agent(transport_cls: type[InMemoryTransport], rounds: int = ROUNDS) -> tuple[dict[int, int], list[str], list[RoundEnd]]:
    """An agent over ``rounds`` FedGKT rounds against a scripted server, tracemalloc on.
    Returns (traced bytes after rounds 3 and ``rounds``' evaluations, the lines that grew
    most in between, the agent's RoundEnds)."""
    # Small images and shards: the rounds are what matters here, not their size.
    train = make_synthetic(64, in_channels=1, size=16, seed=0)
    test = make_synthetic(32, in_channels=1, size=16, seed=1, split="test")
    config = EdgeConfig(agent_id=AGENT, run_id=RUN, progress=False, threads=1, memory=MemoryConfig.low(),
                        data=DataConfig(dataset="synthetic", partition="none", seed=0))
    broker = InMemoryBroker()
    server = InMemoryTransport(broker, "server")
    server.connect()
    topics = Topics(RUN)
    server.subscribe(topics.up(AGENT))
    base = {"run": RUN, "sender": "server"}

    def send(msg) -> None:  # type: ignore[no-untyped-def]
        server.publish(topics.down(AGENT), encode_message(msg))

    traced: dict[int, int] = {}
    ends: list[RoundEnd] = []
    snapshots: dict[int, tracemalloc.Snapshot] = {}
    tracemalloc.start(1)
    try:
        agent = EdgeAgent(config, transport=transport_cls(broker, AGENT), data=(train, test))
        ids = np.asarray(train.sample_ids, np.int64)
        thread = threading.Thread(target=agent.run, name="agent", daemon=True)
        thread.start()
        current = 0
        while thread.is_alive():
            delivery = server.receive(timeout_s=30)
            assert delivery is not None, f"the agent went silent in round {current}"
            kind = peek_header(delivery.payload)["type"]
            if kind == "hello" and current == 0:
                send(Welcome(**base, round=0, accepted=True, method="fedgkt", settings={"num_classes": 10, "edge_model": "resnet8"}))
                kind = "eval_report"  # start round 1
            elif kind == "round_end":
                end = decode_message(delivery.payload)
                assert isinstance(end, RoundEnd)
                ends.append(end)
                rng = np.random.default_rng(current)
                send(GktServerLogits(**base, round=current, sample_ids=ids, logits=rng.normal(size=(ids.size, 10)).astype(np.float32)))
                send(EvalRequest(**base, round=current))
                continue
            elif kind == "error":
                raise AssertionError(f"the agent failed: {decode_message(delivery.payload)}")
            if kind != "eval_report":
                continue
            if current:
                # The agent answered the evaluation and waits for the next round: what it holds now is
                # what it keeps between rounds.
                while agent.transport.backlog() or agent._current_round:
                    threading.Event().wait(0.01)
                if current in (BASELINE_ROUND, rounds):
                    gc.collect()
                    snapshots[current] = tracemalloc.take_snapshot()
                    traced[current] = _traced_bytes(snapshots[current])
            if current == rounds:
                send(Shutdown(**base, round=current, reason="done"))
                break
            current += 1
            send(RoundStart(**base, round=current, method="fedgkt", config=dataclasses.asdict(GktRoundConfig(batch_size=64)),
                            deadline_s=600.0, evaluate=True))
        thread.join(30)
        assert not thread.is_alive()
    finally:
        tracemalloc.stop()
    no_tracemalloc = [tracemalloc.Filter(False, tracemalloc.__file__)]
    grown = [f"{s.traceback}: {s.size_diff / 1e6:+.2f} MB in {s.count_diff:+d} blocks"
             for s in snapshots[rounds].filter_traces(no_tracemalloc).compare_to(
                 snapshots[BASELINE_ROUND].filter_traces(no_tracemalloc), "lineno")[:5]]
    return traced, grown, ends


def _growth(traced: dict[int, int]) -> int:
    return traced[ROUNDS] - traced[BASELINE_ROUND]


def test_an_agent_holds_no_more_after_round_15_than_after_round_3() -> None:
    traced, grown, ends = _run_agent(CachesSentBlobs)
    assert _growth(traced) <= GROWTH_BOUND_BYTES, (
        f"the agent's Python-level allocations grew by {_growth(traced) / 1e6:.2f} MB from round {BASELINE_ROUND} to "
        f"round {ROUNDS} (bound {GROWTH_BOUND_BYTES / 1e6:.1f} MB); grew most:\n" + "\n".join(grown))
    assert [end.round for end in ends] == list(range(1, ROUNDS + 1)) and all(end.costs.peak_rss_bytes > 0 for end in ends)


def test_the_check_fails_for_an_agent_that_keeps_every_blob_it_sent() -> None:
    traced, _, _ = _run_agent(KeepsEverySentBlob)
    assert _growth(traced) > GROWTH_BOUND_BYTES, f"a leaking agent grew by only {_growth(traced) / 1e6:.2f} MB: the check cannot fail"


def test_a_round_peak_is_the_rounds_own_not_the_process_lifetime_maximum() -> None:
    meter = RoundPeakRss()
    if not meter.per_round:
        pytest.skip("this system cannot reset the peak RSS (/proc/self/clear_refs)")
    meter.take()
    # 64 MiB of fresh pages, touched (a mapping of its own: malloc could serve an array from
    # memory that is resident already), then given back.
    big = mmap.mmap(-1, 64 * 1024 * 1024)
    np.frombuffer(big, np.uint8)[::4096] = 1
    first = meter.take()  # the window that held it
    big.close()
    meter.take()  # the window in which it went (it began with the mapping resident)
    second = meter.take()  # a window without it
    assert first - second > 48 * 1024 * 1024, (first, second)


def test_the_agent_warns_when_its_round_peak_grows_three_rounds_in_a_row(caplog: pytest.LogCaptureFixture) -> None:
    agent = EdgeAgent(EdgeConfig(agent_id=AGENT, run_id=RUN, progress=False),
                      transport=InMemoryTransport(InMemoryBroker(), AGENT),
                      data=(make_synthetic(8, in_channels=1), make_synthetic(8, in_channels=1, split="test")))
    mb = 1_000_000
    with caplog.at_level(logging.WARNING, logger="edge_agent"):
        for round_, peak in enumerate([315, 328, 339, 339, 352, 367, 378], start=1):
            agent._watch_peak(round_, peak * mb)
            if round_ == 6:
                assert not [r for r in caplog.records if "grew" in r.getMessage()], "two rounds of growth are not three"
    warnings = [r.getMessage() for r in caplog.records if "grew" in r.getMessage()]
    assert warnings == ["round 7: peak RSS grew 3 rounds in a row (rounds 4-7: 339 -> 352 -> 367 -> 378 MB, +39 MB): memory is "
                        "not flat over rounds (a leak, a filling cache or a fragmenting heap); see docs/deploy.md#memory-on-the-device"]
    assert [r for r, _ in agent._rising_peaks] == [4, 5, 6, 7]


def test_the_resend_cache_keeps_the_latest_blobs_within_its_bound_and_empties_on_demand() -> None:
    cache = ResendCache(max_bytes=2500)
    blobs = [ChunkedBlob(bytes([i]) * 1000) for i in range(4)]
    for blob in blobs:
        cache.remember("t", blob)
    assert len(cache) == 2 and cache.bytes == 2000  # the two latest
    assert cache.get(blobs[0].transfer_id) is None and cache.get(blobs[3].transfer_id) == ("t", blobs[3])
    cache.remember("t", ChunkedBlob(b"x" * 3000))  # larger than the bound: never kept
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.get(blobs[3].transfer_id) is None


def test_the_agent_empties_its_transports_resend_cache_at_every_round_start() -> None:
    """The agent under the long-run test above did; here without tracemalloc, the calls counted."""
    drops: list[int] = []

    class Counting(CachesSentBlobs):
        def drop_resend_cache(self) -> None:
            drops.append(len(self.resend_cache))
            super().drop_resend_cache()

    _, _, ends = _run_agent(Counting, rounds=3)
    # At round 1 it holds the hello and status messages; then each previous round's uploads too.
    assert len(ends) == 3 and len(drops) == 3 and all(n > drops[0] + 2 for n in drops[1:]), drops
