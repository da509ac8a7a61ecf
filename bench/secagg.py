"""What secure aggregation costs per round at 4, 16 and 64 agents: bytes, messages and time
of the protocol alone (no training), over a real mosquitto. Writes ``bench/results/secagg.json``.

The server's round (cloud_server/secagg_server.py) and every agent's client
(edge_agent/secagg_client.py) run as threads of one process, each agent on its own MQTT
connection through the project's transport, on the run's topics. The update has the size of
a ResNet-8's float entries (the FedAvg family's small full model), random values. A cell
with ``dropped = 1`` has one agent go away after sharing its keys (it is recovered). The
figure next to it, ``plain_update_bytes``, is what a plain ``fedavg.update`` of the same
model would weigh (zstd of fp32 random-ish weights, framed).

Usage: ``OMP_NUM_THREADS=1 python bench/secagg.py [--agents 4 16 64] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import RESULTS, machine, write_json

from cloud_server.secagg_server import SecAggRound
from edge_agent.costs import RoundMeter
from edge_agent.secagg_client import SecAggClient
from models import build_model, state_dict_to_arrays
from shared_protocol.errors import SecAggError
from shared_protocol.local_broker import LocalBroker
from shared_protocol.message_base import Message, decode_message, encode_message
from shared_protocol.methods.fedavg import FedAvgUpdate, split_state
from shared_protocol.mqtt.config import TransportConfig
from shared_protocol.secagg import SecAggParams
from shared_protocol.topics import Topics
from shared_protocol.transport import MqttTransport

RUN = "secagg-bench"


class _AgentContext:
    """The part of EdgeContext the client uses, over one MQTT connection."""

    def __init__(self, agent: str, broker_url: str) -> None:
        self.agent_id, self.run_id, self.topics = agent, RUN, Topics(RUN)
        self.transport = MqttTransport(TransportConfig(broker_url=broker_url, client_id=f"{RUN}-{agent}", connect_timeout_s=30))
        self.transport.subscribe(self.topics.down(agent))
        self.transport.connect()

    def send(self, msg: Message, meter: Any, codecs: Any = None) -> None:
        self.transport.publish(self.topics.up(self.agent_id), encode_message(msg))

    def request(self, msg: Message, meter: Any, is_reply: Callable[[Message], bool], timeout_s: float, attempts: int = 3) -> Message:
        self.send(msg, meter)
        deadline = time.monotonic() + timeout_s * attempts
        while time.monotonic() < deadline:
            delivery = self.transport.receive(timeout_s=0.5)
            if delivery is None:
                continue
            reply = decode_message(delivery.payload)
            if is_reply(reply):
                return reply
        raise TimeoutError(f"{self.agent_id}: no answer to {msg.TYPE}")


def _server(broker_url: str, rnd: SecAggRound, stop: threading.Event, counts: dict[str, int], gone: list[str]) -> None:
    topics = Topics(RUN)
    transport = MqttTransport(TransportConfig(broker_url=broker_url, client_id=f"{RUN}-server", connect_timeout_s=30))
    transport.subscribe(topics.up_any)
    transport.connect()
    try:
        while not stop.is_set() and rnd.stage not in ("done", "failed"):
            while gone:  # the round is the server thread's alone: drops are handed over
                rnd.drop(gone.pop())
            delivery = transport.receive(timeout_s=0.2)
            if delivery is not None:
                counts["wire_bytes_up"] += delivery.wire_bytes
                msg = decode_message(delivery.payload)
                rnd.receive(topics.agent_of(delivery.topic) or "", msg)
            for agent, msg in rnd.due():
                blob = encode_message(msg)
                before = transport.stats.snapshot()["wire_bytes_out"]
                transport.publish(topics.down(agent), blob)
                counts["wire_bytes_down"] += transport.stats.snapshot()["wire_bytes_out"] - before
    finally:
        transport.close()


def one_round(broker_url: str, agents: int, update: np.ndarray, params: SecAggParams, dropped: int, round_: int) -> dict[str, Any]:
    names = [f"agent-{k:02d}" for k in range(agents)]
    rnd = SecAggRound(RUN, round_, params, update.size + 1)
    for name in names:
        rnd.expect(name)
    counts = {"wire_bytes_up": 0, "wire_bytes_down": 0}
    stop = threading.Event()
    contexts = [_AgentContext(name, broker_url) for name in names]
    leaving = set(names[-dropped:]) if dropped else set()
    agent_s: list[float] = []
    errors: list[str] = []
    gone: list[str] = []

    def agent(ctx: _AgentContext) -> None:
        client = SecAggClient(ctx, params, round_, deadline_at=time.monotonic() + 600)
        try:
            client.setup(RoundMeter(), 100 + len(ctx.agent_id))
            if ctx.agent_id in leaving:
                gone.append(ctx.agent_id)  # the coordinator drops an agent that fails its round
                return
            client.upload(RoundMeter(), client.mask(update, 100), 0, {})
            agent_s.append(client.compute_s)
        except (SecAggError, TimeoutError) as exc:
            errors.append(f"{ctx.agent_id}: {exc}")

    server = threading.Thread(target=_server, args=(broker_url, rnd, stop, counts, gone))
    started = time.perf_counter()
    server.start()
    threads = [threading.Thread(target=agent, args=(c,)) for c in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.join(600)
    wall = time.perf_counter() - started
    stop.set()
    for c in contexts:
        c.transport.close()
    report = rnd.report()
    return {
        "agents": agents, "dropped": dropped, "status": rnd.stage, "failure": rnd.failure or None, "errors": errors,
        "round_s": round(wall, 3), "stage_s": report["stage_s"], "server_unmask_s": report["unmask_s"],
        "agent_compute_s_mean": round(statistics.mean(agent_s), 4) if agent_s else None,
        "agent_compute_s_max": round(max(agent_s), 4) if agent_s else None,
        "messages_up": report["messages_up"], "messages_down": report["messages_down"],
        "frame_bytes_up": report["bytes_up"], "frame_bytes_down": report["bytes_down"],
        "wire_bytes_up": counts["wire_bytes_up"], "wire_bytes_down": counts["wire_bytes_down"],
        "frame_bytes_per_agent_up": report["bytes_up"] // agents,
        "recovered": report["recovered_dropped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per cell (the figures are per round)")
    parser.add_argument("--ring-bits", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "secagg.json")
    args = parser.parse_args()
    params = SecAggParams(ring_bits=args.ring_bits, stage_timeout_s=120.0)
    floats, ints = split_state(state_dict_to_arrays(build_model("resnet8", 10, 3)))
    size = sum(a.size for a in floats.values())
    rng = np.random.default_rng(0)
    update = rng.normal(scale=0.01, size=size)
    plain = FedAvgUpdate(run=RUN, round=1, sender="agent-00", instance="i", num_samples=100, model_version=0, int_buffers=ints,
                         weights={n: (a + rng.normal(scale=0.01, size=a.shape)).astype(np.float32) for n, a in floats.items()})
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalBroker(Path(tmp)).start()
        try:
            for agents in args.agents:
                for dropped in (0, 1):
                    for r in range(1, args.rounds + 1):
                        cell = one_round(broker.url, agents, update, params, dropped, r)
                        print(f"{agents} agents, {dropped} dropped, round {r}: {cell['status']} in {cell['round_s']} s, "
                              f"{cell['frame_bytes_up'] + cell['frame_bytes_down']} bytes, "
                              f"{cell['messages_up'] + cell['messages_down']} messages", flush=True)
                        cells.append(cell)
        finally:
            broker.stop()
    write_json(args.out, {
        "benchmark": "secagg", "machine": machine(), "params": params.to_dict(), "model": "resnet8",
        "update_entries": size, "plain_update_bytes": len(encode_message(plain)),
        "note": "the protocol alone (no training): agents are threads of one process, each on its own MQTT "
                "connection to one mosquitto on loopback; frame bytes as framed, wire bytes as MQTT packets",
        "cells": cells,
    })


if __name__ == "__main__":
    main()
