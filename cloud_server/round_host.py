"""The coordinator's side of :class:`~cloud_server.rounds.RoundHost`: what a round
scheduler asks of it (open a round, start an agent's round, request the evaluation,
hand the method what arrived, close and record a round).

A mixin of :class:`cloud_server.coordinator.Coordinator`, which holds the state these
operations read and write (the method, the agent registry, the open rounds, the
recorder and the evaluator); the scheduler sees only these operations.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_protocol.errors import ProtocolError, StaleMessageError, UnknownEvalSetError
from shared_protocol.messages import EvalReport, EvalRequest, EvalSetData, EvalSetRequest, Message, PublicEvalSet, RoundEnd, RoundStart

from .evaluation import check_global_results
from .methods import RoundOutcome
from .records import RoundEvaluation, RoundRecord
from .rounds import HookClock, OpenRound

if TYPE_CHECKING:
    from .agents import AgentRegistry
    from .config import ServerConfig
    from .evaluation import EvalSet, Evaluator
    from .methods import ServerMethod
    from .recorder import RunRecorder
    from .robust import RobustnessLedger
    from .schedulers import RoundScheduler

log = logging.getLogger("cloud_server")

__all__ = ["RoundHostOps"]


class RoundHostOps:
    """Open, start, evaluate and close rounds for the scheduler."""

    config: ServerConfig
    method: ServerMethod
    registry: AgentRegistry
    scheduler: RoundScheduler
    recorder: RunRecorder
    evaluator: Evaluator
    eval_set: EvalSet | None
    ledger: RobustnessLedger
    metrics: Any  # ServerMetrics or None
    open_rounds: dict[int, OpenRound]
    completed_round: int
    hook_clock: HookClock  # times every call to a method hook, by round

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

    # -- evaluation messages ------------------------------------------------------- #

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

    # -- round mechanics (the scheduler's RoundHost) --------------------------------- #

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

    # -- closing rounds -------------------------------------------------------------- #

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
