"""The coordinator: the loop of a run. It wires together the agent registry
(:mod:`cloud_server.agents`: who joined, liveness, drops), the round scheduler the
method's declared ``schedule`` picks (:mod:`cloud_server.schedulers`: sync,
sequential turn-taking, async; deadlines and quorum) and the run's record (byte
accounting, the report, checkpoints). It receives and dispatches every inbound
message (``pump``). Methods only configure rounds and consume uploads (see
:mod:`cloud_server.methods.base`); the scheduler drives rounds through the
coordinator's :class:`~cloud_server.rounds.RoundHost` operations (``open_round``,
``start_agent_round``, ``send``, ``close_round``, ...), never its fields.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_protocol.errors import ProtocolError, StaleMessageError, UnknownEvalSetError, UnknownSenderError
from shared_protocol.frame import FrameLimits
from shared_protocol.messages import (
    Discover,
    ErrorReply,
    EvalReport,
    EvalRequest,
    EvalSetData,
    EvalSetRequest,
    Hello,
    Message,
    PublicEvalSet,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    decode_message,
    encode_message,
)
from shared_protocol.registry import load_method_messages
from shared_protocol.topics import Topics
from shared_protocol.transport import Transport

from .agents import AgentRegistry, AgentState, RunAborted
from .audit_keeper import AuditKeeper
from .config import ServerConfig
from .evaluation import EvalSet, Evaluator, check_global_results
from .methods import AnswersUploads, RoundOutcome, ServerMethod, StreamedUploads
from .recorder import RunCounters, RunRecorder, server_info
from .records import RoundEvaluation, RoundRecord, RunReport, now_iso
from .privacy import PrivacyLedger
from .robust import ImplausibleUploadError
from .phase_ticker import PhaseTicker
from .rounds import HookClock, OpenRound
from .schedulers import make_scheduler
if TYPE_CHECKING:  # imported for real only when metrics are on
    from .metrics import ServerMetrics

log = logging.getLogger("cloud_server")

SERVER_ID = "server"
VERSION = "0.1.0"

__all__ = ["AgentState", "Coordinator", "OpenRound", "RunAborted"]


class Coordinator:
    MAX_COMPLETION_REQUESTS = 3  # per agent and round, then what arrived is judged as it is

    def __init__(self, config: ServerConfig, method: ServerMethod, transport: Transport) -> None:
        self.config = config
        self.method = method
        self.transport = transport
        self.topics = Topics(config.run_id)
        self.out_dir = Path(config.out_dir)
        self.limits = FrameLimits(max_body_bytes=256 * 1024 * 1024)
        self.rejected: Counter[str] = Counter()
        self.registry = AgentRegistry(config, method, transport, self.limits, lambda reason: self.rejected.update((reason,)))
        self.completed_round = 0
        self.open_rounds: dict[int, OpenRound] = {}
        self.hook_clock = HookClock()
        self.recorder = RunRecorder(self.out_dir, config.rounds, RunCounters(
            agents=self.registry.infos, rejected=lambda: self.rejected, rejected_chunks=self.transport.rejections,
            refused=lambda: self.registry.refused,
            server_connection=self.transport.stats.snapshot,
        ))
        # The global test set every evaluated round is scored on (None: the config names none).
        self.eval_set = EvalSet.load(config.eval_set_spec())
        self.evaluator = Evaluator(self.eval_set, method.ctx.device)
        self.scheduler = make_scheduler(method.schedule, self, config, self.registry)
        if config.client_fraction < 1.0 and not self.scheduler.samples_agents:
            raise ValueError(f"client_fraction < 1 samples the agents of sync rounds; {method.name} runs "
                             f"{self.scheduler.description} rounds")
        robustness = config.robustness_config()
        if not method.aggregates_weights and (robustness.aggregation != "mean" or robustness.clip_update_norm):
            raise ValueError(
                f"server.aggregation = {robustness.aggregation!r} / server.clip_update_norm = {robustness.clip_update_norm!r} "
                f"apply to the methods that aggregate weights (ServerMethod.aggregates_weights); {method.name} does "
                "not: leave them at 'mean' / 0 (its uploads are still checked for plausibility)")
        # The method's context carries the [server] robustness settings and the ledger the
        # round records read (a method made outside the coordinator may have the defaults).
        method.ctx.robustness = robustness
        method.ctx.ledger.cfg = robustness
        method.ctx.defence = defence = config.defence_config()
        if defence.validates and method.ctx.validation is None:  # cloud_server/robust/validation.py
            if not method.aggregates_weights:
                raise ValueError(f"server.validation_samples judges weight updates; {method.name} does not share weights: "
                                 "leave it at 0 (feature-map uploads have their labels judged instead: plausible_min_label_agreement)")
            from .robust.validation_screen import ValidationScreen

            method.ctx.validation = ValidationScreen(defence)
        self.ledger = method.ctx.ledger
        method.ctx.privacy = privacy = PrivacyLedger(config.privacy_config())  # cloud_server/privacy.py
        privacy.check_method(method, robustness.plain_mean)
        load_method_messages(method.name)
        # The leakage audit's keeper (cloud_server/audit_keeper.py): sees what is sent and received.
        self.audit: AuditKeeper | None = (AuditKeeper(self.out_dir, method.name, config.audit_samples_per_agent, method.ctx.secagg)
                                          if config.audit else None)
        # The live view (cloud_server/metrics.py): imported only when configured.
        endpoint = config.metrics_endpoint()
        self.metrics: ServerMetrics | None = None
        if endpoint is not None:
            endpoint.require_client_library()
            from .metrics import ServerMetrics

            self.metrics = ServerMetrics(self, endpoint)

    @property
    def agents(self) -> dict[str, AgentState]:
        return self.registry.agents

    # -- report and checkpoints (kept by the recorder) ----------------------------- #

    @property
    def report(self) -> RunReport:
        return self.recorder.report

    def save_checkpoint(self) -> None:
        self.recorder.save_checkpoint(self.method.state(), round_=self.completed_round, config=self.config.to_dict(),
                                      method_config=self.method.resolved_config(), rejected=self.rejected,
                                      robustness=self.ledger.state(), contract=self.registry.contract_state())

    def load_checkpoint(self) -> None:
        saved = self.recorder.load_checkpoint()
        if saved.method_config != self.method.resolved_config():
            log.warning("resuming with a different method config than the checkpoint's")
        self.method.load_state(saved.method_state)
        self.completed_round, self.rejected = saved.round, Counter(saved.rejected)
        self.method.ctx.privacy.resume([(r.round, r.privacy) for r in self.report.rounds])
        self.report.resumed.append({"after_round": self.completed_round, "at": now_iso()})
        self.ledger.load_state(saved.robustness)
        self.registry.load_contract_state(saved.contract)
        log.info("resumed from checkpoint after round %d", self.completed_round)

    # -- messaging -------------------------------------------------------------- #

    def send(self, agent: str | None, msg: Message) -> None:
        topic = self.topics.down(agent) if agent else self.topics.down_all
        before = self.transport.stats.snapshot()
        codecs = dict(self.method.download_codecs.get(msg.TYPE, {})) or None
        # An agent may ask for missing chunks only on its own up topic (the ACL allows no other).
        self.transport.publish(topic, encode_message(msg, codecs=codecs), reply_topic=self.topics.up(agent) if agent else None)
        if self.audit is not None:
            self.audit.on_sent(agent, msg)
        after = self.transport.stats.snapshot()
        self._account(msg.round, "down", after["payload_bytes_out"] - before["payload_bytes_out"],
                      after["wire_bytes_out"] - before["wire_bytes_out"], msg.for_evaluation, agent or "all")

    def _account(self, round_: int, direction: str, payload: int, wire: int, evaluation: bool = False,
                 agent: str | None = None) -> None:
        """Attribute a message's bytes to its round if it is open (registration, status and
        stale rounds count outside rounds); evaluation's messages to the round's evaluation."""
        in_round = round_ in self.open_rounds
        if agent == "all":
            agents: Collection[str] = self.open_rounds[round_].participants if in_round else ()
        else:
            agents = (agent,) if agent in self.agents else ()
        self.recorder.account(round_ if in_round else None, direction, payload, wire, evaluation, agents)
        if self.metrics is not None:
            traffic = ("evaluation" if evaluation else "round") if in_round else "outside"
            self.metrics.on_bytes(agent, direction, traffic, payload, wire)

    def _base(self, round_: int) -> dict[str, Any]:
        return {"run": self.config.run_id, "round": round_, "sender": SERVER_ID}

    def discover(self, agent: str | None, round_: int) -> None:
        self.send(agent, Discover(**self._base(round_)))

    def backlog(self) -> int:
        return self.transport.backlog()

    def _reject(self, agent: str | None, reason: str, detail: str, names_sender: bool = True) -> None:
        if self.registry.reject(agent, reason, detail, names_sender):
            self.scheduler.missed(agent or "", "dropped")  # stop waiting for it

    def pump(self, timeout_s: float) -> None:
        """Receive and handle at most one inbound message."""
        self._pump(timeout_s)
        for agent, msg in self.method.due_messages():
            self.send(agent, msg)
        if self.metrics is not None:
            self.metrics.refresh()

    def _pump(self, timeout_s: float) -> None:
        delivery = self.transport.receive(timeout_s=max(0.0, timeout_s))
        if delivery is None:
            return
        agent = self.topics.agent_of(delivery.topic)
        try:
            msg = decode_message(delivery.payload, self.limits)
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes, agent=agent)
            self._reject(agent, exc.code, str(exc), names_sender=False)
            return
        try:
            if msg.run != self.config.run_id:
                raise StaleMessageError(f"message for run {msg.run!r}")
            if agent is None or msg.sender != agent:
                raise UnknownSenderError(f"sender {msg.sender!r} published on {delivery.topic}")
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes, agent=agent)
            self._reject(agent, exc.code, str(exc))
            return
        self._account(msg.round, "up", len(delivery.payload), delivery.wire_bytes, msg.for_evaluation, agent)
        state = self.agents.get(agent)
        if state is not None and state.dropped:
            self.rejected["dropped_agent"] += 1
            return
        if state is not None:
            state.last_heard_at = time.monotonic()
        if self.audit is not None and state is not None:
            self.audit.on_received(agent, msg)  # before any method sees it
        if isinstance(msg, Status):
            if state is not None:
                self.registry.on_status(state, msg)
        elif isinstance(msg, Hello):
            self._on_hello(agent, msg)
        elif state is None:
            self._reject(agent, UnknownSenderError.code, f"{msg.TYPE} from an agent that never said hello")
        elif msg.for_evaluation:
            self._on_evaluation_message(agent, msg)
        elif isinstance(msg, ErrorReply):
            log.warning("agent %s reports %s: %s", agent, msg.code, msg.reason)
            if msg.code == "round_failed" and msg.round == state.round:
                self.scheduler.missed(agent, f"agent error: {msg.reason}")
        elif msg.round != state.round or state.round == 0:
            self._reject(agent, StaleMessageError.code, f"{msg.TYPE} for round {msg.round}, agent is in round {state.round}")
        elif isinstance(msg, RoundEnd):
            self._on_round_end(agent, msg)
        elif isinstance(msg, self.method.upload_types):
            self._on_upload(agent, msg)
        else:
            self._reject(agent, "unexpected_message", f"{msg.TYPE} is not expected from agents")

    def _on_upload(self, agent: str, msg: Message) -> None:
        method = self.method
        try:
            if isinstance(method, AnswersUploads) and isinstance(msg, method.answered_types):
                with self.hook_clock.timing(msg.round, "answer"):
                    reply = method.answer(agent, msg)
            else:
                with self.hook_clock.timing(msg.round, "on_upload"):
                    method.on_upload(agent, msg)
                reply = None
        except ImplausibleUploadError as exc:
            # Well-formed, but its numbers cannot be honest: refused and attributed to the agent in
            # the round record; it does not count toward dropping the agent (quarantine decides).
            self.rejected[exc.reason] += 1
            self.ledger.refuse(msg.round, agent, exc.reason, exc.detail)
            return
        except ProtocolError as exc:
            self._reject(agent, exc.code, str(exc))
            return
        if reply is not None:
            self.send(agent, reply)

    def welcome_settings(self) -> dict[str, Any]:
        """The method's fixed settings and when this run started (``run_started_at``, kept
        across ``--resume``): an agent keeps its local state (``state_dir``) for one run, and a
        new run with the same run_id (another out_dir, ``--force``) has another start time, so
        its agents start afresh instead of restoring the earlier run's model."""
        started = self.recorder.started_at  # None only before the run began (a test pumping by hand)
        privacy = self.method.ctx.privacy.cfg
        return {**self.method.welcome_settings(), **({"run_started_at": started} if started else {}),
                **({"privacy": privacy.agent_settings().to_dict()} if privacy.on else {})}

    def _on_hello(self, agent: str, hello: Hello) -> None:
        refusal = self.registry.refusal(agent, hello)
        if refusal is not None:
            code, reason = refusal
            self.send(agent, Welcome(**self._base(0), accepted=False, code=code, reason=reason))
            return
        prior = self.registry.agents.get(agent)
        same_session = prior is not None and prior.same_session(hello)  # judged before join() takes the new hello
        state = self.registry.join(agent, hello)
        if state.dropped:
            return
        self.send(agent, Welcome(**self._base(0), accepted=True, method=self.method.name, settings=self.welcome_settings()))
        # A participant that (re)joins while its round is open restarts it: it may have been
        # restarted or lost its session and with it the RoundStart. Not a hello repeated on the
        # connection its round started on (it answered a discover): that one still holds it.
        if state.round and state.round in self.open_rounds and agent not in self.open_rounds[state.round].done:
            if same_session:
                log.info("agent %s said hello again on the same connection; its round %d goes on", agent, state.round)
                return
            self.method.discard(agent)
            self.start_agent_round(agent, state.round)
        elif (late := self.scheduler.round_for_late_joiner(agent)) is not None:
            log.info("agent %s joins round %d in progress", agent, late)
            self.start_agent_round(agent, late)

    def _on_round_end(self, agent: str, end: RoundEnd) -> None:
        rnd = self.open_rounds.get(end.round)
        if rnd is None or agent in rnd.done:
            self._reject(agent, StaleMessageError.code, f"round_end for closed round {end.round}")
            return
        if isinstance(self.method, StreamedUploads) and rnd.resend_requests.get(agent, 0) < self.MAX_COMPLETION_REQUESTS:
            requests = self.method.missing_uploads(agent, end)
            if requests:
                rnd.resend_requests[agent] = rnd.resend_requests.get(agent, 0) + 1
                log.warning("agent %s's round %d upload is incomplete; asking it to resend (%d messages)", agent, end.round, len(requests))
                for msg in requests:
                    self.send(agent, msg)
                return  # it sends round_end again when done
        if end.costs.skipped_batches:
            log.warning("agent %s skipped %d training batches of round %d to finish within its deadline", agent,
                        end.costs.skipped_batches, end.round)
        rnd.done[agent] = end
        self.agents[agent].instance = end.instance
        if self.metrics is not None:
            self.metrics.on_round_end(agent, end)
        self.scheduler.on_round_end(rnd, agent, end)

    # -- the run ------------------------------------------------------------------- #

    def _finished_on_disk(self) -> dict[str, Any] | None:
        """The run directory's report when the run it holds is over (all rounds done, or it
        stopped at its target accuracy): a resume has nothing to do then."""
        path = self.out_dir / "report.json"
        if not path.exists():
            return None
        on_disk = json.loads(path.read_text())
        over = on_disk.get("status") == "stopped_target" or (
            on_disk.get("status") == "finished" and self.completed_round >= self.config.rounds)
        return on_disk if over else None

    def run(self, resume: bool = False) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()
            finished = self._finished_on_disk()
            if finished is not None:
                log.info("run %s in %s is already over (%s after round %d of %d): nothing to resume; to train more "
                         "rounds, resume with a larger --rounds, or start a new run with another --out",
                         self.config.run_id, self.out_dir, finished.get("status"), self.completed_round, self.config.rounds)
                return finished
        else:
            self.recorder.begin(RunReport(
                edgesplit_version=VERSION, run_id=self.config.run_id, method=self.method.name,
                config={**self.config.to_dict(), "method_config": self.method.resolved_config()},
                server=server_info(self.method.ctx.device), models=self.method.model_info(),
                eval_set=self.eval_set.describe() if self.eval_set is not None else None,
                defences=self.method.defences(self.config.rounds),
            ))
        run_shape = self.registry.run_input_shape()
        log.info("data contract: inputs (channels, height, width) = (%d, %s, %s), %d classes; channels from %s, size %s",
                 self.config.resolved_in_channels, *(run_shape[1:] if run_shape else ("?", "?")), self.config.num_classes,
                 self.config.in_channels_source,
                 f"from {self.registry.input_hw_source}" if run_shape else "fixed by the first agent to join ([server] image_size not set)")
        if self.metrics is not None and self.metrics.url is None:
            log.info("status page on %s (Prometheus metrics at /metrics)", self.metrics.start())
        self.transport.subscribe(self.topics.up_any)
        self.transport.subscribe(self.topics.status_any)
        self.transport.connect()
        self.discover(None, self.completed_round)
        ticker = PhaseTicker(self.hook_clock, self.config.rounds, self.config.progress_interval_s).start()
        try:
            self.registry.wait_for_agents(self.pump)
            first = self.completed_round + 1
            if first > self.config.rounds:
                log.info("all %d rounds already done", self.config.rounds)
                self.report.status = "finished"
            else:
                self.report.status = self.scheduler.status if self.scheduler.run(first) else "no_agents"
        except RunAborted:
            self.report.status = "aborted"
            raise
        finally:
            ticker.stop()
            if self.method.ctx.privacy.cfg.on:
                log.info("%s", self.method.ctx.privacy.summary_line())
            self.recorder.finish()
            if self.metrics is not None:
                self.metrics.refresh(force=True)
            try:
                self.send(None, Shutdown(**self._base(self.completed_round), reason=self.report.status))
            except (OSError, RuntimeError) as exc:
                log.warning("could not broadcast shutdown: %s", exc)
            self.transport.close()
        return self.report.to_json()

    def close_metrics(self) -> None:
        """Stop serving the metrics and the status page (they outlive ``run`` until this)."""
        if self.metrics is not None:
            self.metrics.close()

    # -- what a round scheduler asks (cloud_server.rounds.RoundHost): open a round, start an agent's round, request the evaluation, hand the method what arrived, close and record a round

    def request_evaluation(self, rnd: OpenRound, agents: list[str], wait_s: float | None = None) -> None:
        """Ask ``agents`` to evaluate round ``rnd`` (after its downloads went out); their
        reports are awaited until the round's deadline, or ``wait_s`` from now."""
        deadline = rnd.deadline_at if wait_s is None else time.monotonic() + wait_s
        # Agents that score a private model on the global set are told which set (and check it).
        public = self.eval_set.public() if self.method.scores_on_device and self.eval_set is not None else PublicEvalSet()
        for agent in agents:
            rnd.eval_requested[agent] = deadline
            for download in self.method.evaluation_downloads(rnd.round, agent):
                self.send(agent, download)
            self.send(agent, EvalRequest(**self._base(rnd.round), public_set=public))

    def _on_evaluation_message(self, agent: str, msg: Message) -> None:
        """An evaluation report, or a test activation a split method streams before it: taken
        while the server awaits that agent's evaluation of ``msg.round`` (in async mode the
        agent may be in its next round by then)."""
        rnd = self.open_rounds.get(msg.round)
        if rnd is None or agent not in rnd.eval_waiting():
            self._reject(agent, StaleMessageError.code, f"{msg.TYPE} for round {msg.round}: no evaluation of it awaited")
        elif isinstance(msg, EvalReport):
            try:
                check_global_results(msg, self.eval_set)
            except ProtocolError as exc:
                rnd.eval_requested[agent] = time.monotonic()  # answered, wrongly: no longer awaited, counted missing
                self._reject(agent, exc.code, str(exc))
                return
            rnd.eval_reports[agent] = msg
        elif isinstance(msg, EvalSetRequest):
            self._send_eval_set(agent, msg)
        elif isinstance(msg, self.method.upload_types):
            self._on_upload(agent, msg)
        else:
            self._reject(agent, "unexpected_message", f"{msg.TYPE} is not expected from agents")

    def _send_eval_set(self, agent: str, msg: EvalSetRequest) -> None:
        """The public global test set, to an agent that scores a private model on it and cannot
        load it itself (its bytes are the round's evaluation's)."""
        if self.eval_set is None or msg.images_sha256 != self.eval_set.images_sha256:
            held = self.eval_set.images_sha256[:16] + "..." if self.eval_set is not None else "none"
            self._reject(agent, UnknownEvalSetError.code, f"eval_set_request for images_sha256 {msg.images_sha256[:16]}...: "
                                                          f"this run's global test set is {held}")
            return
        data = self.eval_set.data
        self.send(agent, EvalSetData(**self._base(msg.round), name=data.name, num_classes=data.num_classes,
                                     images=np.ascontiguousarray(data.images), labels=data.labels.astype(np.int64),
                                     sample_ids=data.sample_ids.astype(np.int64)))

    def _evaluate(self, round_: int) -> bool:
        return self.method.evaluate_every_round or round_ % self.config.eval_every == 0 or round_ == self.config.rounds

    def open_round(self, round_: int) -> OpenRound:
        if round_ not in self.open_rounds:
            now = time.monotonic()
            self.open_rounds[round_] = OpenRound(round_, self._evaluate(round_), now, self.scheduler.deadline_for(now))
        return self.open_rounds[round_]

    def start_agent_round(self, agent: str, round_: int) -> None:
        rnd = self.open_round(round_)
        rnd.participants.add(agent)
        rnd.missing.discard(agent)
        self.registry.assign(agent, round_)
        hello = self.registry.agents[agent].hello
        self.registry.agents[agent].round_session = (hello.instance, hello.connection) if hello.instance else None
        self.registry.expect_from(agent)  # the method may know the agent's uploads better by now
        with self.hook_clock.timing(round_, "round_config"):
            config, weights = self.method.round_config(round_, agent, rnd.evaluate)
        self.send(
            agent,
            RoundStart(
                **self._base(round_), method=self.method.name, config=config, deadline_s=self.scheduler.time_given_s(rnd),
                evaluate=rnd.evaluate, participants=sorted(rnd.participants), weights=weights,
            ),
        )

    def _evaluation(self, rnd: OpenRound) -> tuple[RoundEvaluation, str | None]:
        """The round's evaluation (cloud_server/evaluation.py): the method's hook says what to
        score, the evaluator scores it on the global set; the agents' costs are added here."""
        reports = dict(rnd.eval_reports)
        missing = sorted(set(rnd.eval_requested) - set(reports))
        if missing:
            log.warning("round %d: evaluated without the evaluation reports of %s", rnd.round, ", ".join(missing))
        with self.hook_clock.timing(rnd.round, "evaluation"):
            evaluation = self.method.evaluation(rnd.round, reports)
        costs = [r.costs for r in reports.values()]
        with self.hook_clock.phase(rnd.round, "scoring"):
            figures = self.evaluator.run(evaluation)
        scored = dataclasses.replace(
            figures, missing=missing, edge_eval_flops=sum(c.flops for c in costs),
            edge_eval_s=sum(c.compute_s + c.encode_s + c.network_s for c in costs) / len(costs) if costs else 0.0,
        )
        return scored, evaluation.edge

    def complete(self, rnd: OpenRound, ends: dict[str, RoundEnd]) -> RoundOutcome:
        with self.hook_clock.timing(rnd.round, "complete"):
            return self.method.complete(rnd.round, ends, rnd.evaluate)

    def discard(self, agent: str) -> None:
        self.method.discard(agent)

    def close_round(self, rnd: OpenRound, status: str) -> RoundRecord:
        evaluation, edge_label = self._evaluation(rnd) if rnd.evaluate and status == "ok" else (None, None)
        del self.open_rounds[rnd.round]
        with self.hook_clock.timing(rnd.round, "end_round"):
            self.method.end_round(rnd.round)
        self.ledger.close_round(rnd.round, sorted(rnd.done))
        robustness, warnings = self.ledger.take(rnd.round)
        privacy = self.method.ctx.privacy
        privacy_record = privacy.close_round(rnd.round, {a: end.metrics for a, end in rnd.done.items()})
        if privacy.cfg.on:
            self.recorder.report.privacy = privacy.section()
        record = self.recorder.round_record(
            rnd.round, status, participants=rnd.participants, ends=rnd.done, outcomes=rnd.outcomes,
            started_at=rnd.started_at, server=self.method.ctx.device_meter.take(),
            method_figures={**self.method.round_report(rnd.round), **self.method.secagg_report(rnd.round)},
            evaluation=evaluation, edge_label=edge_label, robustness=robustness, privacy=privacy_record, warnings=warnings,
            hook_seconds=self.hook_clock.take(rnd.round),
        )
        self.completed_round = rnd.round
        self.recorder.add_round(record, checkpoint=self.save_checkpoint)
        if self.metrics is not None:
            self.metrics.on_round_closed(record)
        return record
