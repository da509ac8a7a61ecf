"""The edge agent: connection lifecycle, message dispatch, rounds, costs, local state.

The agent owns the transport; a method's edge step only trains and hands
messages to ``send``. Every inbound frame is validated before use; a bad one is
logged with its reason, counted, and answered with an ErrorReply, and the agent
keeps running.

This module holds :class:`EdgeAgent`'s lifecycle, main loop and dispatch; its
messaging (:mod:`.agent_messaging`), rounds (:mod:`.agent_rounds`), local state
(:mod:`.agent_state`) and data (:mod:`.agent_data`) are modules of their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from fldata import ArrayDataset
from shared_protocol.errors import ProtocolError
from shared_protocol.frame import FrameLimits
from shared_protocol.messages import (
    Discover,
    EvalRequest,
    Message,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    encode_message,
)
from shared_protocol.methods import load_method_messages
from shared_protocol.mqtt_transport import MqttTransport
from shared_protocol.topics import Topics
from shared_protocol.transport_interface import Transport

from .activation_guard import agent_key
from .agent_data import agent_data_spec, load_agent_data, shards_as_configured
from .agent_messaging import SERVER_ID, AgentMessaging, RequestTimeoutError, RoundInterruptedError, RoundRestartedError
from .agent_rounds import AgentRounds
from .agent_state import AgentLocalState
from .backends import get_backend_method
from .config import EdgeConfig
from .costs import RoundPeakRss
from .methods import EdgeContext, EdgeMethod, get_edge_method
from .public_set import PublicTestSet

if TYPE_CHECKING:  # imported for real only when metrics are on
    from .metrics import AgentMetrics

__all__ = [
    "EXIT_CONFIG", "EXIT_OK", "EXIT_REFUSED", "SERVER_ID", "EdgeAgent", "RequestTimeoutError", "RoundInterruptedError",
    "RoundRestartedError", "agent_data_spec", "load_agent_data", "shards_as_configured",
]

log = logging.getLogger("edge_agent")

# Exit codes (edge-agent.service restarts on any other failure, never on these two):
# 2: a configuration error on this device (bad config, unreadable data, data that does not fit
# the run, wrong credentials): restarting cannot help until someone fixes it;
# 3: refused by the server (not in its allow-list, a method it lacks).
EXIT_OK, EXIT_CONFIG, EXIT_REFUSED = 0, 2, 3


class EdgeAgent(AgentMessaging, AgentRounds, AgentLocalState):
    """One agent: it owns the transport and the main loop, dispatches what the server
    sends, and is welcomed into a run (messaging, rounds and local state are its
    parts in :mod:`.agent_messaging`, :mod:`.agent_rounds` and :mod:`.agent_state`)."""

    def __init__(
        self,
        config: EdgeConfig,
        transport: Transport | None = None,
        data: tuple[ArrayDataset, ArrayDataset] | None = None,
        compute_lock: threading.Lock | None = None,
    ) -> None:
        self.config = config
        # Simulated agents in one process share the CPU: one trains at a time.
        self._compute_lock = compute_lock or contextlib.nullcontext()
        self.topics = Topics(config.run_id)
        self.instance = uuid.uuid4().hex[:12]
        self.private_key = agent_key(config.private_seed)  # kept here; the methods' noise and private init
        self.train, self.test = shards_as_configured(config, *(data if data is not None else load_agent_data(config)))
        if len(self.train) == 0:
            raise ValueError(f"agent {config.agent_id} has no training samples (check data.partition / train_samples)")
        self.transport = transport or MqttTransport(config.transport_config())
        # The run's public global test set, for methods that score a private model on it.
        self.public_test_set = PublicTestSet(config.data, self.request, self._base)
        self.method: EdgeMethod | None = None
        self.settings: dict[str, Any] = {}
        self.rejected: Counter[str] = Counter()
        self.rounds_done: list[int] = []
        self.last_round_done = -1
        self._last_round_end_at: float | None = None
        self._last_round_end: RoundEnd | None = None
        self._stop = threading.Event()
        # Messages that arrived while a method waited for an answer within its round
        # (``request``); handled, in order, when the round is over.
        self._deferred: deque[Message] = deque()
        self._current_round = 0  # the round run_round is in, 0 between rounds
        self._eval_s_since_round_end = 0.0  # evaluation time since the last round_end: not idle
        self.exit_code = EXIT_OK
        self._rounds_started: set[int] = set()  # rounds this process began (a repeat is logged with its reason)
        self.config_path = ""  # the TOML the config came from, named in error messages (set by the CLI)
        self.limits = FrameLimits(max_body_bytes=256 * 1024 * 1024)
        # Each round reports its own peak RSS; simulated agents sharing a process report the
        # process's lifetime peak instead (one agent's reset would cut into another's round).
        self._round_peak = RoundPeakRss(per_round=compute_lock is None)
        self._rising_peaks: list[tuple[int, int]] = []  # (round, peak RSS) of the rounds whose peak kept growing
        # This agent's Prometheus metrics (edge_agent/metrics.py): imported only when configured.
        endpoint = config.metrics_endpoint()
        self.metrics: AgentMetrics | None = None
        if endpoint is not None:
            endpoint.require_client_library()
            from .metrics import AgentMetrics

            self.metrics = AgentMetrics(self, endpoint)

    # -- plumbing ----------------------------------------------------------- #

    def stop(self) -> None:
        self._stop.set()

    # -- main loop ---------------------------------------------------------- #

    def run(self) -> int:
        if self.config.backend == "torch":
            import torch

            torch.set_num_threads(self.config.threads)
        else:
            os.environ.setdefault("EDGESPLIT_ORT_THREADS", str(self.config.threads))
        me = self.config.agent_id
        if self.metrics is not None and self.metrics.url is None:
            log.info("metrics on %s", self.metrics.start())
        offline = encode_message(Status(**self._base(), state="offline"))
        self.transport.set_will(self.topics.status(me), offline)
        if isinstance(self.transport, MqttTransport):
            self.transport.set_reply_topic(self.topics.down(me))
        self.transport.subscribe(self.topics.down(me))
        self.transport.subscribe(self.topics.down_all)
        self.transport.connect()
        log.info("agent %s (instance %s) connected; %d train / %d test samples", me, self.instance, len(self.train), len(self.test))
        self._status("online")
        self.hello()
        seen_connects = self.transport.connect_count
        try:
            while not self._stop.is_set():
                while self._deferred and not self._stop.is_set():
                    self._dispatch(self._deferred.popleft())
                if self._stop.is_set():
                    break
                if self.transport.connect_count != seen_connects:
                    seen_connects = self.transport.connect_count
                    log.info("reconnected; announcing again")
                    self._status("online")
                    self.hello()
                delivery = self.transport.receive(timeout_s=0.5)
                if delivery is None:
                    continue
                self._handle(delivery.payload)
        finally:
            # Every way out, a refusal (data mismatch, a refused agent) included: the retained
            # status must not go on saying "online" for an agent that has exited.
            try:
                # Not waiting for the broker's acknowledgement: with the broker gone that
                # wait would last publish_timeout_s and a stopped agent would not exit.
                # Sent before close()'s DISCONNECT, in order, to a broker that is there.
                self.transport.publish(self.topics.status(me), encode_message(Status(**self._base(), state="offline")),
                                       retain=True, wait=False)
            except (OSError, RuntimeError) as exc:
                log.warning("could not publish offline status: %s", exc)
            self.transport.close()
        return self.exit_code

    def _handle(self, blob: bytes) -> None:
        msg = self._decode(blob)
        if msg is not None:
            self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, Discover):
            self.hello()
        elif isinstance(msg, Shutdown):
            log.info("server ended the run: %s", msg.reason or "done")
            if self.config.exit_on_shutdown:
                self._stop.set()
        elif isinstance(msg, RoundStart):
            self._on_round_start(msg)
        elif isinstance(msg, EvalRequest):
            self._on_eval_request(msg)
        else:
            try:
                handled = self.method is not None and self.method.on_message(msg)
            except ProtocolError as exc:
                self._reject(exc.code, f"{msg.TYPE}: {exc}")
                return
            if not handled:
                self._reject("unexpected_message", f"{msg.TYPE} not expected now")

    def _on_welcome(self, msg: Welcome) -> None:
        if not msg.accepted:
            if msg.code == "data_mismatch":
                log.error("server refused this agent: its data does not fit the run: %s (data: %s, [data] in %s)",
                          msg.reason, self.config.data.root or self.config.data.dataset, self.config_path or "the config")
                self.exit_code = EXIT_CONFIG
            else:
                log.error("server refused this agent: %s", msg.reason)
                self.exit_code = EXIT_REFUSED
            self._stop.set()
            return
        num_classes = int(msg.settings.get("num_classes", 0))
        if num_classes and int(self.train.labels.max()) >= num_classes:
            log.error("local labels go up to %d but the run has %d classes: this device's data has more classes "
                      "(class folders) than the run's [server] num_classes", int(self.train.labels.max()), num_classes)
            self.exit_code = EXIT_CONFIG
            self._stop.set()
            return
        if self.method is not None and self.settings == msg.settings and self.method.name == msg.method:
            return  # a repeated welcome (after a reconnect or a server restart)
        load_method_messages(msg.method)
        if self.method is not None:
            log.info("the server's run changed (another start or method): rounds count from this run's first")
        # A welcome with other settings is another run (its start time is in them): what this
        # process did for an earlier one says nothing about this run's rounds.
        self.last_round_done = -1
        self._rounds_started.clear()
        self.settings = dict(msg.settings)
        if self.config.backend == "torch":
            cls = get_edge_method(msg.method)
        else:
            cls = get_backend_method(self.config.backend, msg.method)
        ctx = EdgeContext(
            agent_id=self.config.agent_id,
            run_id=self.config.run_id,
            instance=self.instance,
            train=self.train,
            test=self.test,
            settings=self.settings,
            send=self.send,
            request=self.request,
            public_set=self.public_test_set.get,
            resend_round_end=self._resend_round_end,
            device=self.config.device,
            progress=self.config.progress,
            seed=self.config.data.seed * 1000 + self.config.data.agent_index,
            memory=self.config.memory,
            private_key=self.private_key,
            augment=self.config.data.augment if self.config.data.augment is not None else self.config.data.dataset in ("cifar10", "cifar100", "cinic10"),
        )
        with self._compute_lock:  # simulated agents share the CPU: one builds or trains at a time
            # The agent's own models start from ctx.seed = (run seed, agent index), drawn from the
            # agent's own generator (ctx.weights_generator()), never from torch's global RNG, which
            # every thread of a simulation shares: two runs with the same config start alike
            # whatever the thread schedule (FedAvg-like methods then load the server's model).
            self.method = cls(ctx)
        self._load_local_state()
        log.info("welcomed into run %s, method %s", self.config.run_id, msg.method)

    def close_metrics(self) -> None:
        """Stop serving this agent's metrics (they outlive ``run`` until this)."""
        if self.metrics is not None:
            self.metrics.close()
