"""Secure aggregation run in one process, without a transport: the server's round and the
agents' clients exchange their messages by hand, so each step can be tampered with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cloud_server.secagg_server import SecAggRound
from edge_agent.secagg_client import SecAggClient, wire_view
from shared_protocol.message_base import Message, decode_message, encode_message
from shared_protocol.secagg import SecAggParams

RUN = "sa"


@dataclass
class FakeCtx:
    agent_id: str
    run_id: str = RUN


def through_wire(msg: Message) -> Message:
    """What arrives: the message encoded and decoded (its checks run)."""
    return decode_message(encode_message(msg))


@dataclass
class Federation:
    """K clients and the server's round; ``answers[agent]`` is what the server sent it last."""

    agents: list[str]
    params: SecAggParams
    length: int
    round: int = 1
    clients: dict[str, SecAggClient] = field(default_factory=dict)
    server: SecAggRound = field(init=False)
    answers: dict[str, Message] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.server = SecAggRound(RUN, self.round, self.params, self.length + 1)
        for agent in self.agents:
            self.clients[agent] = SecAggClient(FakeCtx(agent), self.params, self.round, deadline_at=float("inf"))
            self.server.expect(agent)

    def deliver(self) -> list[tuple[str, Message]]:
        out = self.server.due()
        for agent, msg in out:
            self.answers[agent] = through_wire(msg)
        return out

    def advertise(self, num_samples: dict[str, int]) -> None:
        from shared_protocol.secagg import public_bytes
        from shared_protocol.secagg_messages import SecAggAdvertise

        for agent, client in self.clients.items():
            msg = SecAggAdvertise(run=RUN, round=self.round, sender=agent, num_samples=num_samples[agent],
                                  c_public=public_bytes(client.keys.c_key), s_public=public_bytes(client.keys.s_key))
            self.server.receive(agent, through_wire(msg))
        self.deliver()
        for agent, client in self.clients.items():
            client.take_roster(self.answers[agent])  # type: ignore[arg-type]

    def share(self, skip: tuple[str, ...] = ()) -> None:
        for agent, client in self.clients.items():
            if agent not in skip:
                self.server.receive(agent, through_wire(client.share_keys()))
        self.deliver()

    def take_shares(self, skip: tuple[str, ...] = ()) -> None:
        for agent, client in self.clients.items():
            if agent not in skip:
                client.take_shares(self.answers[agent])  # type: ignore[arg-type]

    def masked_inputs(self, updates: dict[str, np.ndarray], num_samples: dict[str, int]) -> dict[str, np.ndarray]:
        from shared_protocol.secagg_messages import SecAggMaskedInput

        sent = {}
        for agent, update in updates.items():
            masked = self.clients[agent].mask(update, num_samples[agent])
            sent[agent] = masked
            msg = SecAggMaskedInput(run=RUN, round=self.round, sender=agent, model_version=0, masked=wire_view(masked))
            self.server.receive(agent, through_wire(msg))
        return sent

    def unmask(self, agents: list[str]) -> None:
        self.deliver()
        for agent in agents:
            self.server.receive(agent, through_wire(self.clients[agent].unmask_shares(self.answers[agent])))  # type: ignore[arg-type]
        self.deliver()


def weighted_update_mean(updates: dict[str, np.ndarray], num_samples: dict[str, int]) -> np.ndarray:
    total = sum(num_samples[a] for a in updates)
    return sum(updates[a] * num_samples[a] for a in updates) / total  # type: ignore[return-value]


def fixed_point_tolerance(params: SecAggParams, agents: int, scale: Any = 1.0) -> float:
    """How far the secure mean may sit from the exact one: each agent's entry and weight are
    rounded to half a fixed-point unit, and the weight's rounding moves the mean by its share."""
    return float(agents * 2.0 ** -params.fraction_bits * (1 + scale))
