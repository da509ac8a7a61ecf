"""The run recorder: the one place that builds the run report's records.

A :class:`RunRecorder` owns the :class:`~cloud_server.records.RunReport`, the
byte accounting per round, the totals, the checkpoint and the report files. The
coordinator hands it each closed round; the centralized trainer, which has no
agents, hands it its rounds the same way, so both write the same report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared_protocol.hostinfo import cpu_model
from shared_protocol.messages import RoundEnd
from shared_protocol.records import plain_json

from .methods.base import RoundOutcome
from .records import (AgentBytes, AgentInfo, AgentRoundRecord, ByteCounts, RoundEvaluation, RoundRecord, RoundTimes, RunReport,
                      RunTotals, ServerDeviceRecord, ServerInfo, memory_growth_warnings, now_iso)
from .report import format_summary_line, write_report
from .report.per_device import per_device_section

log = logging.getLogger("cloud_server")

__all__ = ["RunCounters", "Checkpoint", "RunRecorder", "server_info"]


def server_info(device: str) -> ServerInfo:
    """This host, as the report's ``server`` describes it."""
    import torch

    return ServerInfo(device=device, cpu_model=cpu_model(), torch=torch.__version__, hostname=socket.gethostname())


def _no_counts() -> Mapping[str, int]:
    return {}


@dataclass(frozen=True)
class RunCounters:
    """Where the recorder reads what the rest of the server counts, whenever it writes
    the totals (a run without agents or a broker keeps the defaults)."""

    agents: Callable[[], dict[str, AgentInfo]] = dict
    rejected: Callable[[], Mapping[str, int]] = _no_counts  # messages, by reason
    rejected_chunks: Callable[[], Mapping[str, int]] = _no_counts  # chunks, by code, since this process started
    server_connection: Callable[[], dict[str, Any] | None] = lambda: None
    refused: Callable[[], list[dict[str, str]]] = list  # agents refused at join: agent, code, reason


@dataclass(frozen=True)
class Checkpoint:
    """What :meth:`RunRecorder.load_checkpoint` restores besides the report."""

    round: int
    config: dict[str, Any]
    method_config: dict[str, Any]
    rejected: dict[str, int]
    method_state: Any
    robustness: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The run's data contract as it stood: {"input_hw": [h, w], "input_hw_source": "..."} once fixed.
    contract: dict[str, Any] = dataclasses.field(default_factory=dict)


def _agent_accuracy(scored: RoundEvaluation | None, agent: str, edge_label: str | None) -> float | None:
    """An agent's own model (the edge models where they differ from the deployed one, else
    the deployed one) on the global set, as the round's evaluation scored it."""
    if scored is None:
        return None
    figures = scored.per_agent.get(agent, {}).get("accuracy", {})
    return figures.get(edge_label or "model")


class RunRecorder:
    def __init__(self, out_dir: str | Path, total_rounds: int, counters: RunCounters | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.total_rounds = total_rounds
        self.counters = counters or RunCounters()
        self._report: RunReport | None = None
        self._started = time.monotonic()
        # Carried over from the checkpoint of a resumed run.
        self._prior_wall_s = 0.0
        self._prior_rejected_chunks: dict[str, int] = {}
        self._prior_refused: list[dict[str, str]] = []
        self._round_bytes: dict[int, ByteCounts] = {}
        self._eval_bytes: dict[int, ByteCounts] = {}  # evaluation's messages, apart from training's
        self._agent_bytes: dict[int, dict[str, AgentBytes]] = {}  # the same messages, by the agent sending or receiving
        self.outside_rounds = ByteCounts()  # registration, status, stale rounds

    @property
    def report(self) -> RunReport:
        if self._report is None:
            raise RuntimeError("the recorder has no report yet: call begin() or load_checkpoint() first")
        return self._report

    @property
    def started_at(self) -> str | None:
        """When the run started (kept across a resume); None before ``begin`` / ``load_checkpoint``."""
        return None if self._report is None else self._report.started_at

    @property
    def status(self) -> str:
        """The run's status ("starting" before ``begin`` / ``load_checkpoint``)."""
        return "starting" if self._report is None else self._report.status

    def begin(self, report: RunReport) -> None:
        self._report = report

    # -- bytes ------------------------------------------------------------------ #

    def account(self, round_: int | None, direction: str, payload: int, wire: int, evaluation: bool = False,
                agents: Collection[str] = ()) -> None:
        """Attribute a message's bytes to an open round (async rounds overlap in time), to
        that round's evaluation when the message is evaluation's, or, with ``round_`` None,
        to the bytes outside rounds; in a round, to each of ``agents`` too (its sender, or
        those it was sent to: every one of them receives a broadcast whole)."""
        if round_ is None:
            self.outside_rounds.add(direction, payload, wire)
            return
        (self._eval_bytes if evaluation else self._round_bytes).setdefault(round_, ByteCounts()).add(direction, payload, wire)
        by_agent = self._agent_bytes.setdefault(round_, {})
        for agent in agents:
            held = by_agent.setdefault(agent, AgentBytes())
            (held.evaluation if evaluation else held.train).add(direction, payload, wire)

    # -- rounds ------------------------------------------------------------------- #

    def round_record(
        self,
        round_: int,
        status: str,
        *,
        participants: Collection[str],
        ends: Mapping[str, RoundEnd],
        outcomes: Sequence[RoundOutcome],
        started_at: float,
        server: ServerDeviceRecord | None,
        method_figures: Mapping[str, Any] | None = None,
        server_train_flops: int | None = None,
        evaluation: RoundEvaluation | None = None,
        edge_label: str | None = None,
        robustness: Mapping[str, Any] | None = None,
        privacy: Mapping[str, Any] | None = None,
        warnings: Sequence[str] = (),
        hook_seconds: Mapping[str, float] | None = None,
    ) -> RoundRecord:
        """The record of a closed round: what the agents that finished it sent (``ends``),
        what the method made of it (``outcomes``), how it was evaluated (``evaluation``, whose
        bytes are the evaluation messages the recorder counted; ``edge_label``: the label of
        the models left on the devices), and its bytes so far."""
        eval_bytes = self._eval_bytes.pop(round_, None) or ByteCounts()
        scored = None if evaluation is None else dataclasses.replace(evaluation, bytes=eval_bytes)
        # A diverged (NaN) loss is reported as unknown rather than breaking the report.
        losses = [(o.server_loss, o.samples) for o in outcomes
                  if o.server_loss is not None and math.isfinite(o.server_loss) and o.samples]
        excluded = {a: why for o in outcomes for a, why in o.excluded.items()}

        def mean_cost(name: str) -> float:
            values = [float(getattr(e.costs, name)) for e in ends.values()]
            return sum(values) / len(values) if values else 0.0

        return RoundRecord(
            round=round_,
            status=status,
            participants=sorted(participants),
            completed=sorted(set(ends) - set(excluded)),
            missing=sorted((set(participants) - set(ends)) | set(excluded)),
            accuracy=scored.accuracy.get("model") if scored else None,
            local_accuracy=scored.local_accuracy.get("model") if scored else None,
            edge_accuracy=scored.accuracy.get(edge_label) if scored and edge_label else None,
            edge_local_accuracy=scored.local_accuracy.get(edge_label) if scored and edge_label else None,
            server_loss=sum(l * n for l, n in losses) / sum(n for _, n in losses) if losses else None,
            samples=sum(o.samples for o in outcomes),
            bytes=self._round_bytes.pop(round_, None) or ByteCounts(),
            edge_train_flops=sum(e.costs.train_flops for e in ends.values()),
            server_train_flops=server_train_flops,
            time_s=RoundTimes(
                round=time.monotonic() - started_at,
                server_train=sum(o.server_train_s for o in outcomes),
                edge_compute=mean_cost("compute_s"),
                edge_encode=mean_cost("encode_s"),
                edge_network=mean_cost("network_s"),
                edge_idle=mean_cost("idle_s"),
            ),
            per_agent={a: AgentRoundRecord.of(e.costs, _agent_accuracy(scored, a, edge_label)) for a, e in sorted(ends.items())},
            device_bytes=dict(sorted((self._agent_bytes.pop(round_, None) or {}).items())),
            server=server,
            server_hooks_s={hook: float(s) for hook, s in sorted((hook_seconds or {}).items())},
            excluded=excluded,
            method=plain_json(dict(method_figures or {})),
            evaluation=scored,
            robustness=plain_json(dict(robustness or {})),
            privacy=plain_json(dict(privacy or {})),
            warnings=list(warnings),
        )

    def add_round(self, record: RoundRecord, checkpoint: Callable[[], None] | None = None) -> None:
        """Append a closed round, then checkpoint (when given) and write the report files."""
        self.report.rounds.append(record)
        self.refresh()
        for warning in self.report.memory_warnings:
            if warning["last_round"] == record.round:
                log.warning("%s", warning["message"])
        if checkpoint is not None:
            checkpoint()  # before the report: a report that shows round r implies a checkpoint of r
        self._write_files()
        print(format_summary_line(record.to_json(), self.total_rounds), flush=True)

    # -- totals and files ------------------------------------------------------------ #

    def refresh(self) -> None:
        """Bring the agents and the totals up to date."""
        report = self.report
        report.agents = self.counters.agents()
        report.refused_agents = self._prior_refused + [r for r in self.counters.refused() if r not in self._prior_refused]
        chunks = dict(self._prior_rejected_chunks)
        for code, n in self.counters.rejected_chunks().items():
            chunks[code] = chunks.get(code, 0) + n
        report.memory_warnings = memory_growth_warnings(report.rounds)
        report.per_device = per_device_section(report.to_json())
        report.totals = RunTotals.of(
            report.rounds,
            wall_time_s=time.monotonic() - self._started + self._prior_wall_s,
            rejected=self.counters.rejected(),
            rejected_chunks=chunks,
            outside_rounds=self.outside_rounds,
            server_connection=self.counters.server_connection(),
        )

    def write(self) -> None:
        self.refresh()
        self._write_files()

    def _write_files(self) -> None:
        write_report(self.out_dir, self.report.to_json())

    def finish(self, status: str | None = None) -> None:
        """Stamp the end of the run (and its final status, when given) and write the report."""
        if status is not None:
            self.report.status = status
        self.report.finished_at = now_iso()
        self.write()

    # -- checkpoint ----------------------------------------------------------------- #

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def save_checkpoint(self, method_state: Any, *, round_: int, config: dict[str, Any],
                        method_config: dict[str, Any], rejected: Mapping[str, int],
                        robustness: Mapping[str, Any] | None = None, contract: Mapping[str, Any] | None = None) -> None:
        from models.state_io import save_state

        staging = self.out_dir / "checkpoint.new"
        if staging.exists():
            shutil.rmtree(staging)
        save_state(staging, "method", method_state)
        save_state(staging, "coordinator", {
            "round": round_, "config": config, "method_config": method_config,
            "report": self.report.to_json(), "rejected": dict(rejected),
            "robustness_json": json.dumps(plain_json(dict(robustness or {}))),  # the quarantine's state
            "contract_json": json.dumps(plain_json(dict(contract or {}))),  # the image size the first agent fixed
        })
        # Swap directories so a crash mid-save leaves the previous checkpoint intact.
        old = self.out_dir / "checkpoint.old"
        if self.checkpoint_dir.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(self.checkpoint_dir, old)
        os.replace(staging, self.checkpoint_dir)
        if old.exists():
            shutil.rmtree(old)

    def load_checkpoint(self) -> Checkpoint:
        """Restore the report (status back to running) and the counters carried over; return
        the rest for the caller to restore."""
        from models.state_io import load_state

        if not (self.checkpoint_dir / "coordinator.json").exists():
            raise FileNotFoundError(f"no checkpoint in {self.checkpoint_dir}; run without --resume to start a new run")
        state = load_state(self.checkpoint_dir, "coordinator")
        self._report = RunReport.from_json(state["report"], "checkpoint report")
        self._report.status = "running"
        self._prior_wall_s = self._report.totals.wall_time_s
        # report.json is written after the checkpoint, and at the end of the run: the later
        # wall time, so that the time after the last checkpoint (a run's closing) is not lost.
        on_disk = self.out_dir / "report.json"
        if on_disk.exists():
            try:
                written = json.loads(on_disk.read_text())
                if written.get("run_id") == self._report.run_id and len(written.get("rounds", [])) == len(self._report.rounds):
                    self._prior_wall_s = max(self._prior_wall_s, float(written.get("totals", {}).get("wall_time_s", 0.0)))
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("could not read the wall time of %s (%s); using the checkpoint's", on_disk, exc)
        self._report.totals = dataclasses.replace(self._report.totals, wall_time_s=self._prior_wall_s)
        self._prior_rejected_chunks = dict(self._report.totals.rejected_chunks_by_reason)
        self._prior_refused = list(self._report.refused_agents)
        return Checkpoint(round=int(state["round"]), config=state["config"], method_config=state["method_config"],
                          rejected=dict(state["rejected"]), method_state=load_state(self.checkpoint_dir, "method"),
                          robustness=json.loads(state.get("robustness_json", "{}")),
                          contract=json.loads(state.get("contract_json", "{}")))
