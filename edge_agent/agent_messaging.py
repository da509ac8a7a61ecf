"""The agent's side of the conversation with the server: publishing its messages
and status, a method's uploads and its requests within a round (split learning's
per-batch exchange), the hello, and validating what comes in (a bad frame is
logged with its reason, counted, and dropped)."""

from __future__ import annotations

import dataclasses
import logging
import platform
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fldata import ArrayDataset
from shared_protocol.errors import ProtocolError, UnknownSenderError, StaleMessageError
from shared_protocol.frame import FrameLimits
from shared_protocol.hostinfo import host_info
from shared_protocol.messages import (
    Hello,
    Message,
    RoundStart,
    Shutdown,
    Status,
    decode_message,
    encode_message,
)
from shared_protocol.topics import Topics
from shared_protocol.transport_interface import Transport

from . import __version__
from .config import EdgeConfig
from .costs import RoundMeter
from .backends import describe_backend

if TYPE_CHECKING:  # imported for real only when metrics are on
    from .metrics import AgentMetrics

log = logging.getLogger("edge_agent")

SERVER_ID = "server"


class RequestTimeoutError(RuntimeError):
    """The server did not answer a request within its timeout, after every attempt."""


class RoundInterruptedError(RuntimeError):
    """The run ended (Shutdown, or the agent was stopped) while a request waited for its answer."""


class RoundRestartedError(RuntimeError):
    """The server started the round in progress again (it saw this agent say hello
    mid-round); the new RoundStart is handled next, so the round restarts cleanly."""


class AgentMessaging:
    """Messaging for :class:`~edge_agent.agent.EdgeAgent`."""

    # Set up by EdgeAgent.__init__ (agent.py).
    config: EdgeConfig
    transport: Transport
    topics: Topics
    instance: str
    train: ArrayDataset
    rejected: Counter[str]
    limits: FrameLimits
    metrics: AgentMetrics | None
    last_round_done: int
    _stop: threading.Event
    _deferred: deque[Message]
    _current_round: int

    def _publish(self, msg: Message, retain: bool = False, topic: str | None = None) -> None:
        self.transport.publish(topic or self.topics.up(self.config.agent_id), encode_message(msg), retain=retain)

    def _base(self, round_: int = 0) -> dict[str, Any]:
        return {"run": self.config.run_id, "round": round_, "sender": self.config.agent_id}

    def _status(self, state: str) -> None:
        self._publish(Status(**self._base(), state=state), retain=True, topic=self.topics.status(self.config.agent_id))
        if self.metrics is not None:
            self.metrics.on_state(state)

    def send(self, msg: Message, meter: RoundMeter, codecs: dict[str, str] | None = None) -> None:
        """Encode and publish a method's upload, metering time and bytes."""
        with meter.phase("encode"):
            blob = encode_message(msg, codecs=codecs)
        meter.raw_bytes += sum(
            int(value.nbytes) for f in dataclasses.fields(msg) if isinstance(value := getattr(msg, f.name), np.ndarray)
        )
        meter.encoded_bytes += len(blob)
        with meter.phase("network"):
            # Pipelined: the next batch is extracted while this one's chunks are in flight;
            # the round's uploads are flushed before round_end.
            self.transport.publish(self.topics.up(self.config.agent_id), blob, wait=False)

    def request(
        self,
        msg: Message,
        meter: RoundMeter,
        is_reply: Callable[[Message], bool],
        timeout_s: float,
        codecs: dict[str, str] | None = None,
        attempts: int = 3,
    ) -> Message:
        """Send ``msg`` and wait for the server's answer: the first inbound message for
        which ``is_reply`` is true. For methods that exchange within a round (split
        learning: activations up, gradients back, per batch).

        Without an answer within ``timeout_s`` the same frame is sent again (the server
        answers a repeated request from its cache), at most ``attempts`` times in all.
        Other messages arriving meanwhile are handled after the round; a Shutdown
        interrupts the wait. Waiting counts as network time: for split learning that
        is the per-batch round trip, the server's forward/backward included.
        """
        if timeout_s <= 0 or attempts < 1:
            raise ValueError("request needs timeout_s > 0 and attempts >= 1")
        with meter.phase("encode"):
            blob = encode_message(msg, codecs=codecs)
        meter.raw_bytes += sum(
            int(value.nbytes) for f in dataclasses.fields(msg) if isinstance(value := getattr(msg, f.name), np.ndarray)
        )
        topic = self.topics.up(self.config.agent_id)
        for attempt in range(1, attempts + 1):
            meter.encoded_bytes += len(blob)
            with meter.phase("network"):
                self.transport.publish(topic, blob)
                deadline = time.monotonic() + timeout_s
                while (remaining := deadline - time.monotonic()) > 0:
                    if self._stop.is_set():
                        raise RoundInterruptedError("agent stopped while waiting for the server")
                    delivery = self.transport.receive(timeout_s=min(remaining, 0.5))
                    if delivery is None:
                        continue
                    reply = self._decode(delivery.payload)
                    if reply is None:
                        continue  # rejected and counted by _decode
                    if is_reply(reply):
                        return reply
                    self._deferred.append(reply)
                    if isinstance(reply, Shutdown):
                        raise RoundInterruptedError(f"server ended the run: {reply.reason or 'done'}")
                    if isinstance(reply, RoundStart) and reply.round == self._current_round:
                        # The server reset its side of this round: answers to the old one would not come.
                        raise RoundRestartedError(f"server restarted round {reply.round}")
            log.warning("no answer to %s within %.0f s (attempt %d of %d)", msg.TYPE, timeout_s, attempt, attempts)
        raise RequestTimeoutError(f"no answer to {msg.TYPE} after {attempts} attempts of {timeout_s:.0f} s")

    def hello(self) -> None:
        counts = self.train.class_counts().tolist()
        methods, backend_software = describe_backend(self.config.backend)
        self._publish(
            Hello(
                **self._base(),
                **host_info().to_dict(),  # cpu_model, arch, cores, memory_bytes
                backend=self.config.backend,
                num_samples=len(self.train),
                class_counts=[int(c) for c in counts],
                methods=methods,
                software={"edgesplit": __version__, "python": platform.python_version(), **backend_software},
                last_round_done=self.last_round_done,
                memory=dataclasses.asdict(self.config.memory),
                input_shape=[int(d) for d in self.train.images.shape[1:]],  # (C, H, W) as the model sees it
                num_classes=int(self.train.num_classes),
                instance=self.instance,
                connection=int(self.transport.connect_count),
            )
        )

    def _reject(self, reason: str, detail: str, ref: str = "", round_: int = 0) -> None:
        self.rejected[reason] += 1
        if self.metrics is not None:
            self.metrics.on_rejected(reason)
        log.warning("rejected message (%s): %s", reason, detail)

    def _decode(self, blob: bytes) -> Message | None:
        """A validated message from the server of this run, or None (rejected, logged, counted)."""
        try:
            msg = decode_message(blob, self.limits)
            if msg.run != self.config.run_id:
                raise StaleMessageError(f"message for run {msg.run!r}, this agent is in run {self.config.run_id!r}")
            if msg.sender != SERVER_ID:
                raise UnknownSenderError(f"message from {msg.sender!r}; agents only take orders from the server")
        except ProtocolError as exc:
            self._reject(exc.code, str(exc))
            return None
        return msg
