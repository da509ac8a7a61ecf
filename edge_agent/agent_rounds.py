"""What the agent does in a round: run the method's round under a meter and report
its round_end (costs, metrics; a failure as an ErrorReply), watch the per-round
peak memory, and evaluate on request (evaluation's costs kept apart)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from shared_protocol.errors import ProtocolError
from shared_protocol.memory_growth import growing_since, growth_message, rising_run_start
from shared_protocol.messages import (
    ErrorReply,
    EvalReport,
    EvalRequest,
    RoundEnd,
    RoundStart,
)
from shared_protocol.records import EvalCosts
from shared_protocol.transport_interface import Transport, TransportError

from .agent_messaging import RoundRestartedError
from .costs import RoundMeter, RoundPeakRss
from .deadline import RoundDeadline
from .memory import trim_malloc
from .methods import EdgeMethod

if TYPE_CHECKING:  # imported for real only when metrics are on
    from .metrics import AgentMetrics

log = logging.getLogger("edge_agent")


class AgentRounds:
    """Rounds and evaluations for :class:`~edge_agent.agent.EdgeAgent` (its messaging comes
    from :class:`~edge_agent.agent_messaging.AgentMessaging`, saving its state from
    :class:`~edge_agent.agent_state.AgentLocalState`)."""

    # Set up by EdgeAgent.__init__ (agent.py).
    transport: Transport
    instance: str
    method: EdgeMethod | None
    metrics: AgentMetrics | None
    last_round_done: int
    rounds_done: list[int]
    _current_round: int
    _compute_lock: Any
    _last_round_end: RoundEnd | None
    _last_round_end_at: float | None
    _eval_s_since_round_end: float
    _rounds_started: set[int]
    _round_peak: RoundPeakRss
    _rising_peaks: list[tuple[int, int]]

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
        # after round up to the cache's bound (64 MiB: bench/results/footprint.json, long_run).
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
