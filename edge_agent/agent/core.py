"""The edge agent: connection lifecycle, message dispatch, rounds, costs, local state.

The agent owns the transport; a method's edge step only trains and hands
messages to ``send``. Every inbound frame is validated before use; a bad one is
logged with its reason, counted, and answered with an ErrorReply, and the agent
keeps running.

This module holds :class:`EdgeAgent`, one class: its lifecycle, main loop and dispatch,
messaging, rounds and local state; its data (:mod:`.data`) is a module of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import threading
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fldata import ArrayDataset
from shared_protocol.errors import ProtocolError, StaleMessageError, UnknownSenderError
from shared_protocol.frame import FrameLimits
from shared_protocol.hostinfo import host_info
from shared_protocol.memory_growth import growing_since, growth_message, rising_run_start
from shared_protocol.messages import (
    Discover,
    ErrorReply,
    EvalReport,
    EvalRequest,
    Hello,
    Message,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    decode_message,
    encode_message,
)
from shared_protocol.mqtt.transport import MqttTransport
from shared_protocol.records import EvalCosts
from shared_protocol.registry import load_method_messages
from shared_protocol.topics import Topics
from shared_protocol.transport_interface import Transport, TransportError

from .. import __version__
from ..activation_guard import agent_key
from ..backends import describe_backend, get_backend_method
from ..config import EdgeConfig
from ..costs import RoundMeter, RoundPeakRss
from ..deadline import RoundDeadline
from ..faults import AgentFault
from ..memory import trim_malloc
from ..methods import EdgeContext, EdgeMethod, get_edge_method
from ..public_set import PublicTestSet
from .data import load_agent_data, shards_as_configured

if TYPE_CHECKING:  # imported for real only when metrics are on
    from ..metrics import AgentMetrics

__all__ = [
    "EXIT_CONFIG", "EXIT_OK", "EXIT_REFUSED", "SERVER_ID", "EdgeAgent", "RequestTimeoutError", "RoundInterruptedError",
    "RoundRestartedError",
]

log = logging.getLogger("edge_agent")

# Exit codes (edge-agent.service restarts on any other failure, never on these two):
# 2: a configuration error on this device (bad config, unreadable data, data that does not fit
# the run, wrong credentials): restarting cannot help until someone fixes it;
# 3: refused by the server (not in its allow-list, a method it lacks).
EXIT_OK, EXIT_CONFIG, EXIT_REFUSED = 0, 2, 3
SERVER_ID = "server"


class RequestTimeoutError(RuntimeError):
    """The server did not answer a request within its timeout, after every attempt."""


class RoundInterruptedError(RuntimeError):
    """The run ended (Shutdown, or the agent was stopped) while a request waited for its answer."""


class RoundRestartedError(RuntimeError):
    """The server started the round in progress again (it saw this agent say hello
    mid-round); the new RoundStart is handled next, so the round restarts cleanly."""


class EdgeAgent:
    """One agent: it owns the transport and the main loop, dispatches what the server
    sends, is welcomed into a run, runs its rounds and keeps its local state (the sections
    below, in that order)."""

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
        # A fault on purpose ([agent] fault): corrupts this agent's shard or its uploads, never a method's code.
        spec = config.fault_spec()
        self.fault = AgentFault(spec, config.agent_id, label_seed=config.data.seed) if spec is not None else None
        if self.fault is not None:
            self.fault.announce()
            self.train = self.fault.train_set(self.train)
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
            from ..metrics import AgentMetrics

            self.metrics = AgentMetrics(config.run_id, config.agent_id, self.transport, endpoint)

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
        if self.fault is not None and "secagg" in self.settings and self.fault.spec.kind != "random_labels":
            log.warning("fault %s: under secure aggregation this agent's update goes masked into the sum; the fault "
                        "acts only on what is sent in the clear", self.fault.spec.describe())

    def close_metrics(self) -> None:
        """Stop serving this agent's metrics (they outlive ``run`` until this)."""
        if self.metrics is not None:
            self.metrics.close()

    # -- messaging: sending, waiting for replies, refusing what does not fit

    def _publish(self, msg: Message, retain: bool = False, topic: str | None = None) -> None:
        self.transport.publish(topic or self.topics.up(self.config.agent_id), encode_message(msg), retain=retain)

    def _base(self, round_: int = 0) -> dict[str, Any]:
        return {"run": self.config.run_id, "round": round_, "sender": self.config.agent_id}

    def _status(self, state: str) -> None:
        self._publish(Status(**self._base(), state=state), retain=True, topic=self.topics.status(self.config.agent_id))
        if self.metrics is not None:
            self.metrics.on_state(state)

    def _outgoing(self, msg: Message, codecs: dict[str, str] | None) -> bytes:
        """The frame of a method's upload: the one place a fault on purpose ([agent] fault) acts on it."""
        if self.fault is None:
            return encode_message(msg, codecs=codecs)
        held = self.method.held_global if self.method is not None else (lambda version: None)
        msg = self.fault.upload(msg, held)
        return encode_message(msg, codecs=codecs, validate=not self.fault.skips_checks)

    def send(self, msg: Message, meter: RoundMeter, codecs: dict[str, str] | None = None) -> None:
        """Encode and publish a method's upload, metering time and bytes."""
        with meter.phase("encode"):
            blob = self._outgoing(msg, codecs)
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
            blob = self._outgoing(msg, codecs)
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
                fault=self.fault.spec.describe() if self.fault is not None else "",
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

    # -- rounds: running one, its costs and its end

    def _on_round_start(self, msg: RoundStart) -> None:
        if self.method is None or msg.method != self.method.name:
            self._reject("not_ready", f"round_start for {msg.method!r} before a welcome for it")
            self._publish(ErrorReply(**self._base(msg.round), code="not_ready", reason="no welcome received yet", ref_msg_id=msg.msg_id))
            self.hello()
            return
        if msg.round <= self.last_round_done:
            log.warning("round %d again: this agent finished it already (its round_end may not have reached the server, "
                        "or the server restarted from a checkpoint before that round); the server asks for it again, "
                        "so it is redone", msg.round)
        elif msg.round in self._rounds_started:
            log.warning("round %d again: the server sent its round_start once more (it saw this agent reconnect or "
                        "restart mid-round and lost its part of the round); starting the round over", msg.round)
        self._rounds_started.add(msg.round)
        # What the transport kept for resends belongs to rounds that are over: the server asks for
        # a missing chunk only while the transfer is open, and it sent this round_start after
        # closing the previous round and its evaluation. Kept, those blobs would pile up round
        # after round up to the cache's bound (64 MiB: bench/results/footprint.json, test_long_run).
        self.transport.drop_resend_cache()
        meter = RoundMeter(deadline=RoundDeadline(max(0.0, msg.deadline_s)))  # a negative or NaN deadline: none left
        if self._last_round_end_at is not None:
            meter.seconds["idle"] = max(0.0, time.monotonic() - self._last_round_end_at - self._eval_s_since_round_end)
        self._eval_s_since_round_end = 0.0
        before = self.transport.stats.snapshot()
        started = time.monotonic()
        self._status("training")
        self._current_round = msg.round
        try:
            with self._compute_lock:
                result = self.method.run_round(msg, meter)
        except RoundRestartedError as exc:
            log.warning("round %d abandoned: %s; starting it again", msg.round, exc)
            self._status("idle")
            return
        except (ProtocolError, ValueError, RuntimeError) as exc:
            log.error("round %d failed: %s", msg.round, exc)
            self._publish(ErrorReply(**self._base(msg.round), code="round_failed", reason=str(exc)[:500], ref_msg_id=msg.msg_id))
            self._status("idle")
            return
        finally:
            self._current_round = 0
        try:
            with meter.phase("network"):
                self.transport.flush()
        except TransportError as exc:
            log.error("round %d upload refused by the broker: %s", msg.round, exc)
            self._status("idle")
            return
        after = self.transport.stats.snapshot()
        costs = meter.costs(
            round_s=time.monotonic() - started, peak_rss_bytes=self._round_peak.take(), before=before, after=after,
            codec=str(msg.config.get("upload_codec", "")), peak_rss_per_round=self._round_peak.per_round,
        )
        if meter.deadline.skipped_batches:
            log.warning("round %d: skipped %d of %d training batches: they could not finish within the round's "
                        "deadline (%.0f s); the round_end says so", msg.round, meter.deadline.skipped_batches,
                        meter.deadline.skipped_batches + meter.deadline.trained_batches, msg.deadline_s)
        self._last_round_end = RoundEnd(
            **self._base(msg.round), num_samples=result.num_samples, instance=self.instance, uploads=result.uploads, costs=costs, metrics=result.metrics
        )
        self._publish(self._last_round_end)
        if costs.peak_rss_per_round:  # a lifetime peak rises by nature (simulated agents share a process)
            self._watch_peak(msg.round, costs.peak_rss_bytes)
        if self.metrics is not None:
            self.metrics.on_round(msg.round, msg.method, costs)
        self.last_round_done = msg.round
        self.rounds_done.append(msg.round)
        self._last_round_end_at = time.monotonic()
        self._save_local_state()
        self._status("idle")
        trim_malloc()  # the round's freed heap back to the system (see edge_agent/memory.py)
        acc = result.metrics.get("edge_accuracy")
        log.info(
            "round %d done: %d samples, %.1f s compute, %.2f MB up%s",
            msg.round, result.num_samples, meter.seconds["compute"], costs.wire_bytes_up / 1e6,
            f", edge acc {acc:.2%}" if isinstance(acc, float) else "",
        )

    def _watch_peak(self, round_: int, peak_bytes: int) -> None:
        """Warn when this agent's per-round peak RSS has grown several rounds in a row
        (:mod:`shared_protocol.memory_growth`); the server's report says so too."""
        self._rising_peaks.append((round_, peak_bytes))
        peaks = [p for _, p in self._rising_peaks]
        self._rising_peaks = self._rising_peaks[rising_run_start(peaks):]  # only the run still growing
        if growing_since([p for _, p in self._rising_peaks]) is not None:
            log.warning("round %d: %s", round_, growth_message([r for r, _ in self._rising_peaks],
                                                                 [p for _, p in self._rising_peaks]))

    def _on_eval_request(self, msg: EvalRequest) -> None:
        """Evaluate what this agent holds for round ``msg.round`` and report it; the time,
        FLOPs and bytes are evaluation's, not the round's (the next round's idle time
        excludes them)."""
        if self.method is None:
            self._reject("not_ready", f"eval_request for round {msg.round} before a welcome")
            return
        started = time.monotonic()
        meter = RoundMeter()
        before = self.transport.stats.snapshot()
        try:
            with self._compute_lock:
                answer = self.method.evaluate(msg, meter)
            with meter.phase("network"):
                self.transport.flush()  # the streamed test activations, before the report
        except (ProtocolError, ValueError, RuntimeError, TransportError) as exc:
            log.error("evaluation of round %d failed: %s", msg.round, exc)
            self._publish(ErrorReply(**self._base(msg.round), code="eval_failed", reason=str(exc)[:500], ref_msg_id=msg.msg_id))
            return
        after = self.transport.stats.snapshot()
        costs = EvalCosts(
            flops=meter.train_flops, compute_s=meter.seconds["compute"], encode_s=meter.seconds["encode"],
            network_s=meter.seconds["network"],
            payload_bytes_up=after["payload_bytes_out"] - before["payload_bytes_out"],
            wire_bytes_up=after["wire_bytes_out"] - before["wire_bytes_out"],
            payload_bytes_down=after["payload_bytes_in"] - before["payload_bytes_in"],
            wire_bytes_down=after["wire_bytes_in"] - before["wire_bytes_in"],
        )
        models = {f"{label}/{name}": array for label, arrays in answer.models.items() for name, array in arrays.items()}
        try:
            self._publish(EvalReport(**self._base(msg.round), instance=self.instance, results=answer.results,
                                     global_results=answer.global_results,
                                     public_set_sha256=msg.public_set.images_sha256 if answer.global_results else "",
                                     uploads=answer.uploads, costs=costs, models=models))
        except ProtocolError as exc:  # e.g. a model that is no longer finite: the server hears why, the agent goes on
            log.error("evaluation report of round %d cannot be sent: %s", msg.round, exc)
            self._publish(ErrorReply(**self._base(msg.round), code="eval_failed", reason=str(exc)[:500], ref_msg_id=msg.msg_id))
            return
        self._eval_s_since_round_end += time.monotonic() - started
        trim_malloc()
        model = answer.results.get("model")
        scored = answer.global_results.get("model")
        log.info("round %d evaluated: %s%s%s", msg.round,
                 f"{model['correct']} / {model['total']} local test samples right" if model else "nothing held locally",
                 f", {scored['correct']} / {scored['total']} of the global test set (scored here)" if scored else "",
                 f", {sum(a.nbytes for a in models.values()) / 1e3:.0f} KB of model(s) for the global set" if models else "")

    def _resend_round_end(self) -> None:
        if self._last_round_end is not None:
            self._publish(self._last_round_end)

    # -- local state: what the agent keeps across restarts

    def _state_paths(self) -> tuple[Path, Path] | None:
        if not self.config.state_dir:
            return None
        base = Path(self.config.state_dir)
        return base / f"{self.config.agent_id}.npz", base / f"{self.config.agent_id}.json"

    def _save_local_state(self) -> None:
        paths = self._state_paths()
        if paths is None or self.method is None:
            return
        arrays_path, meta_path = paths
        arrays_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = arrays_path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.method.state_arrays())
        os.replace(tmp, arrays_path)
        meta = {"run": self.config.run_id, "method": self.method.name, "last_round_done": self.last_round_done, "settings": self.settings}
        meta_path.write_text(json.dumps(meta))

    def _load_local_state(self) -> None:
        paths = self._state_paths()
        if paths is None or self.method is None or not paths[0].exists() or not paths[1].exists():
            return
        meta = json.loads(paths[1].read_text())
        if meta.get("run") != self.config.run_id or meta.get("method") != self.method.name or meta.get("settings") != self.settings:
            earlier = (meta.get("settings") or {}).get("run_started_at")
            if meta.get("run") == self.config.run_id and earlier and earlier != self.settings.get("run_started_at"):
                log.info("ignoring local state in %s: it is from an earlier run %s (started %s, this one %s); "
                         "starting this run's models afresh", paths[0], self.config.run_id, earlier, self.settings.get("run_started_at"))
            else:
                log.info("ignoring local state of another run/method in %s", paths[0])
            return
        with np.load(paths[0], allow_pickle=False) as data:
            self.method.load_state_arrays({k: data[k] for k in data.files})
        self.last_round_done = int(meta.get("last_round_done", -1))
