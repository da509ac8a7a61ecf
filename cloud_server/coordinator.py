"""The coordinator: the loop of a run. It wires together the agent registry
(:mod:`cloud_server.agents`: who joined, liveness, drops), the round scheduler the
method's declared ``schedule`` picks (:mod:`cloud_server.schedulers`: sync,
sequential turn-taking, async; deadlines and quorum) and the run's record (byte
accounting, the report, checkpoints). It receives and dispatches every inbound
message (``pump``). Methods only configure rounds and consume uploads (see
:mod:`cloud_server.methods.base`).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import shutil
import socket
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shared_protocol.errors import ProtocolError, StaleMessageError, UnknownSenderError
from shared_protocol.frame import FrameLimits
from shared_protocol.messages import (
    Discover,
    ErrorReply,
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
from shared_protocol.methods import load_method_messages
from shared_protocol.topics import Topics
from shared_protocol.transport import Transport

from . import report as run_report
from .agents import AgentRegistry, AgentState, RunAborted
from .config import ServerConfig
from .methods import RoundOutcome, ServerMethod
from .schedulers import OpenRound, make_scheduler

log = logging.getLogger("cloud_server")

SERVER_ID = "server"
VERSION = "0.1.0"

__all__ = ["AgentState", "Coordinator", "OpenRound", "RunAborted"]


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Coordinator:
    MAX_COMPLETION_REQUESTS = 3  # per agent and round, then what arrived is judged as it is
    WAITING_LOG_EVERY_S = 60.0  # while a round is open, who the server still waits for, and why
    # A participant that says it is idle (its round is over) but whose round_end has not
    # arrived this long after is asked to announce itself again (and then redoes the round).
    NUDGE_AFTER_S = 30.0

    def __init__(self, config: ServerConfig, method: ServerMethod, transport: Transport) -> None:
        self.config = config
        self.method = method
        self.transport = transport
        self.topics = Topics(config.run_id)
        self.out_dir = Path(config.out_dir)
        self.limits = FrameLimits(max_body_bytes=256 * 1024 * 1024)
        self.rejected: Counter[str] = Counter()
        self.registry = AgentRegistry(config, method, transport, self.limits, lambda reason: self.rejected.update((reason,)))
        self.report: dict[str, Any] = {}
        self.completed_round = 0
        self.open_rounds: dict[int, OpenRound] = {}
        self.stopping = False  # no new rounds or turns are started (a stop condition was met)
        self._started = time.monotonic()
        self._failed_in_a_row = 0
        self.round_bytes: dict[int, dict[str, int]] = {}
        self._completion_requests: dict[tuple[str, int], int] = {}
        self.other_bytes = {"up_payload": 0, "up_wire": 0, "down_payload": 0, "down_wire": 0}
        self.scheduler = make_scheduler(method.schedule, self)
        if config.client_fraction < 1.0 and not self.scheduler.samples_agents:
            raise ValueError(f"client_fraction < 1 samples the agents of sync rounds; {method.name} runs "
                             f"{self.scheduler.description} rounds")
        load_method_messages(method.name)

    @property
    def agents(self) -> dict[str, AgentState]:
        return self.registry.agents

    # -- report --------------------------------------------------------------- #

    def _new_report(self) -> dict[str, Any]:
        import torch

        return {
            "edgesplit_version": VERSION,
            "run_id": self.config.run_id,
            "method": self.method.name,
            "config": {**self.config.to_dict(), "method_config": self.method.resolved_config()},
            "started_at": _now_iso(),
            "finished_at": None,
            "status": "running",
            "server": {
                "device": self.method.ctx.device,
                "cpu_model": _cpu_model(),
                "torch": torch.__version__,
                "hostname": socket.gethostname(),
            },
            "agents": {},
            "models": self.method.model_info(),
            "rounds": [],
            "totals": {},
        }

    def _agent_report(self) -> dict[str, Any]:
        return {
            a.agent_id: {
                "cpu_model": a.hello.cpu_model,
                "arch": a.hello.arch,
                "cores": a.hello.cores,
                "memory_bytes": a.hello.memory_bytes,
                "backend": a.hello.backend,
                "num_samples": a.hello.num_samples,
                "class_counts": list(a.hello.class_counts),
            }
            for a in sorted(self.agents.values(), key=lambda a: a.agent_id)
        }

    def _update_totals(self) -> None:
        rounds = self.report["rounds"]
        accs = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
        edge_accs = [r["edge_accuracy"] for r in rounds if r["edge_accuracy"] is not None]
        totals: dict[str, Any] = {
            "rounds_completed": sum(1 for r in rounds if r["status"] == "ok"),
            "best_accuracy": max(accs) if accs else None,
            "final_accuracy": accs[-1] if accs else None,
            "final_edge_accuracy": edge_accs[-1] if edge_accs else None,
        }
        for key in ("up_payload", "up_wire", "down_payload", "down_wire"):
            totals[key] = sum(r["bytes"][key] for r in rounds)
        totals["wire_total"] = totals["up_wire"] + totals["down_wire"]
        totals["edge_train_flops"] = sum(r["edge_train_flops"] for r in rounds)
        totals["wall_time_s"] = time.monotonic() - self._started + self.report.get("_prior_wall_s", 0.0)
        totals["rejected_messages"] = sum(self.rejected.values())
        totals["rejected_by_reason"] = dict(self.rejected)
        # Chunks refused below the message layer (they never became messages), by code.
        chunk_rejections = {**self.report.get("_prior_chunk_rejections", {})}
        for code, n in self.transport.rejections().items():
            chunk_rejections[code] = chunk_rejections.get(code, 0) + n
        totals["rejected_chunks"] = sum(chunk_rejections.values())
        totals["rejected_chunks_by_reason"] = chunk_rejections
        # Bytes outside any round (registration, status, stale messages) and everything
        # the server's connection carried.
        totals["outside_rounds"] = dict(self.other_bytes)
        totals["server_connection"] = self.transport.stats.snapshot()
        self.report["totals"] = totals

    def write_report(self) -> None:
        self.report["agents"] = self._agent_report()
        self._update_totals()
        public = {k: v for k, v in self.report.items() if not k.startswith("_")}
        run_report.write_report(self.out_dir, public)

    # -- checkpoints ----------------------------------------------------------- #

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> None:
        from models.state_io import save_state

        staging = self.out_dir / "checkpoint.new"
        if staging.exists():
            shutil.rmtree(staging)
        save_state(staging, "method", self.method.state())
        save_state(
            staging,
            "coordinator",
            {
                "round": self.completed_round,
                "config": self.config.to_dict(),
                "method_config": self.method.resolved_config(),
                "report": {**self.report, "_prior_wall_s": self.report["totals"].get("wall_time_s", 0.0)},
                "rejected": dict(self.rejected),
            },
        )
        # Swap directories so a crash mid-save leaves the previous checkpoint intact.
        old = self.out_dir / "checkpoint.old"
        if self.checkpoint_dir.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(self.checkpoint_dir, old)
        os.replace(staging, self.checkpoint_dir)
        if old.exists():
            shutil.rmtree(old)

    def load_checkpoint(self) -> None:
        from models.state_io import load_state

        if not (self.checkpoint_dir / "coordinator.json").exists():
            raise FileNotFoundError(f"no checkpoint in {self.checkpoint_dir}; run without --resume to start a new run")
        state = load_state(self.checkpoint_dir, "coordinator")
        if state["method_config"] != self.method.resolved_config():
            log.warning("resuming with a different method config than the checkpoint's")
        self.method.load_state(load_state(self.checkpoint_dir, "method"))
        self.completed_round = int(state["round"])
        self.report = state["report"]
        self.report["status"] = "running"
        self.rejected = Counter(state["rejected"])
        self.report["_prior_chunk_rejections"] = dict(self.report.get("totals", {}).get("rejected_chunks_by_reason", {}))
        log.info("resumed from checkpoint after round %d", self.completed_round)

    # -- messaging -------------------------------------------------------------- #

    def _send(self, agent: str | None, msg: Message) -> None:
        topic = self.topics.down(agent) if agent else self.topics.down_all
        before = self.transport.stats.snapshot()
        codecs = self.method.download_codecs(msg) or None
        # An agent may ask for missing chunks only on its own up topic (the ACL allows no other).
        self.transport.publish(topic, encode_message(msg, codecs=codecs), reply_topic=self.topics.up(agent) if agent else None)
        after = self.transport.stats.snapshot()
        self._account(msg.round, "down", after["payload_bytes_out"] - before["payload_bytes_out"], after["wire_bytes_out"] - before["wire_bytes_out"])

    def _account(self, round_: int, direction: str, payload: int, wire: int) -> None:
        """Attribute a message's bytes to its round (async rounds overlap in time)."""
        bucket = self.round_bytes.get(round_) if round_ in self.open_rounds else None
        if bucket is None:
            bucket = self.other_bytes  # registration, status, stale rounds
        bucket[f"{direction}_payload"] += payload
        bucket[f"{direction}_wire"] += wire

    def _base(self, round_: int) -> dict[str, Any]:
        return {"run": self.config.run_id, "round": round_, "sender": SERVER_ID}

    def _reject(self, agent: str | None, reason: str, detail: str, names_sender: bool = True) -> None:
        if self.registry.reject(agent, reason, detail, names_sender):
            self.scheduler.missed(agent or "", "dropped")  # stop waiting for it

    def pump(self, timeout_s: float) -> None:
        """Receive and handle at most one inbound message."""
        delivery = self.transport.receive(timeout_s=max(0.0, timeout_s))
        if delivery is None:
            return
        agent = self.topics.agent_of(delivery.topic)
        try:
            msg = decode_message(delivery.payload, self.limits)
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes)
            self._reject(agent, exc.code, str(exc), names_sender=False)
            return
        try:
            if msg.run != self.config.run_id:
                raise StaleMessageError(f"message for run {msg.run!r}")
            if agent is None or msg.sender != agent:
                raise UnknownSenderError(f"sender {msg.sender!r} published on {delivery.topic}")
        except ProtocolError as exc:
            self._account(-1, "up", len(delivery.payload), delivery.wire_bytes)
            self._reject(agent, exc.code, str(exc))
            return
        self._account(msg.round, "up", len(delivery.payload), delivery.wire_bytes)
        state = self.agents.get(agent)
        if state is not None and state.dropped:
            self.rejected["dropped_agent"] += 1
            return
        if state is not None:
            state.last_heard_at = time.monotonic()
        if isinstance(msg, Status):
            if state is not None:
                self.registry.on_status(state, msg)
        elif isinstance(msg, Hello):
            self._on_hello(agent, msg)
        elif state is None:
            self._reject(agent, UnknownSenderError.code, f"{msg.TYPE} from an agent that never said hello")
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
        try:
            replies = self.method.on_upload(agent, msg)
        except ProtocolError as exc:
            self._reject(agent, exc.code, str(exc))
            return
        for target, reply in replies or ():
            self._send(target, reply)

    def _on_hello(self, agent: str, hello: Hello) -> None:
        refusal = self.registry.refusal(agent, hello)
        if refusal is not None:
            self._send(agent, Welcome(**self._base(0), accepted=False, reason=refusal))
            return
        state = self.registry.join(agent, hello)
        if state.dropped:
            return
        self._send(agent, Welcome(**self._base(0), accepted=True, method=self.method.name, settings=self.method.welcome_settings()))
        # A participant that (re)joins while its round is open restarts it: it may have
        # been restarted and lost the RoundStart.
        if state.round and state.round in self.open_rounds and agent not in self.open_rounds[state.round].done:
            self.method.discard(agent)
            self._start_agent_round(agent, state.round)
        elif (late := self.scheduler.round_for_late_joiner(agent)) is not None:
            log.info("agent %s joins round %d in progress", agent, late)
            self._start_agent_round(agent, late)

    # -- round mechanics --------------------------------------------------------- #

    def _evaluate(self, round_: int) -> bool:
        return round_ % self.config.eval_every == 0 or round_ == self.config.rounds

    def _open(self, round_: int) -> OpenRound:
        if round_ not in self.open_rounds:
            now = time.monotonic()
            self.open_rounds[round_] = OpenRound(round_, self._evaluate(round_), now, self.scheduler.deadline_for(now))
            self.round_bytes[round_] = {"up_payload": 0, "up_wire": 0, "down_payload": 0, "down_wire": 0}
        return self.open_rounds[round_]

    def _start_agent_round(self, agent: str, round_: int) -> None:
        rnd = self._open(round_)
        rnd.participants.add(agent)
        rnd.missing.discard(agent)
        self.registry.assign(agent, round_)
        self.registry.expect_from(agent)  # the method may know the agent's uploads better by now
        config, weights = self.method.round_config(round_, agent, rnd.evaluate)
        self._send(
            agent,
            RoundStart(
                **self._base(round_), method=self.method.name, config=config, deadline_s=self.scheduler.time_given_s(rnd),
                evaluate=rnd.evaluate, participants=sorted(rnd.participants), weights=weights,
            ),
        )

    def _on_round_end(self, agent: str, end: RoundEnd) -> None:
        rnd = self.open_rounds.get(end.round)
        if rnd is None or agent in rnd.done:
            self._reject(agent, StaleMessageError.code, f"round_end for closed round {end.round}")
            return
        key = (agent, end.round)
        if self._completion_requests.get(key, 0) < self.MAX_COMPLETION_REQUESTS:
            requests = self.method.check_round_end(agent, end)
            if requests:
                self._completion_requests[key] = self._completion_requests.get(key, 0) + 1
                log.warning("agent %s's round %d upload is incomplete; asking it to resend (%d messages)", agent, end.round, len(requests))
                for target, msg in requests:
                    self._send(target, msg)
                return  # it sends round_end again when done
        skipped = end.costs.get("skipped_batches", 0)  # validated as a finite number >= 0 when it is one
        if isinstance(skipped, int) and skipped > 0:
            log.warning("agent %s skipped %d training batches of round %d to finish within its deadline", agent, skipped, end.round)
        rnd.done[agent] = end
        self.agents[agent].instance = end.instance
        self.scheduler.on_round_end(rnd, agent, end)

    def _why_waiting(self, agent: str, rnd: OpenRound) -> str:
        return self.registry.why_waiting(agent, self._completion_requests.get((agent, rnd.round), 0))

    def _deliver(self, outcome: RoundOutcome) -> None:
        for agent, msg in outcome.downloads:
            self._send(agent, msg)

    # -- closing rounds -------------------------------------------------------------- #

    def _close(self, rnd: OpenRound, status: str) -> dict[str, Any]:
        del self.open_rounds[rnd.round]
        round_bytes = self.round_bytes.pop(rnd.round)
        ends = rnd.done
        outcomes = rnd.outcomes
        correct = sum(o.correct for o in outcomes)
        total = sum(o.total for o in outcomes)
        edge_correct = sum(int(e.metrics.get("edge_correct", 0) or 0) for e in ends.values())
        edge_total = sum(int(e.metrics.get("edge_total", 0) or 0) for e in ends.values())
        # A diverged (NaN) loss is reported as unknown rather than breaking the report.
        losses = [(o.server_loss, o.samples) for o in outcomes if o.server_loss is not None and math.isfinite(o.server_loss) and o.samples]

        def mean_cost(key: str) -> float:
            values = [float(e.costs.get(key, 0.0)) for e in ends.values()]
            return sum(values) / len(values) if values else 0.0

        per_agent = {}
        for agent, e in sorted(ends.items()):
            c = e.costs
            per_agent[agent] = {
                "samples": int(c.get("samples", 0)),
                "train_flops": int(c.get("train_flops", 0)),
                "compute_s": float(c.get("compute_s", 0.0)),
                "encode_s": float(c.get("encode_s", 0.0)),
                "network_s": float(c.get("network_s", 0.0)),
                "idle_s": float(c.get("idle_s", 0.0)),
                "peak_rss_bytes": int(c.get("peak_rss_bytes", 0)),
                "payload_bytes_up": int(c.get("payload_bytes_up", 0)),
                "wire_bytes_up": int(c.get("wire_bytes_up", 0)),
                "payload_bytes_down": int(c.get("payload_bytes_down", 0)),
                "wire_bytes_down": int(c.get("wire_bytes_down", 0)),
                "codec": str(c.get("codec", "")),
                "codec_ratio": float(c.get("codec_ratio", 1.0)),
                "edge_accuracy": e.metrics.get("edge_accuracy"),
            }
        excluded = {a: why for o in outcomes for a, why in o.excluded.items()}
        record = {
            "round": rnd.round,
            "status": status,
            "participants": sorted(rnd.participants),
            "completed": sorted(set(ends) - set(excluded)),
            "missing": sorted((rnd.participants - set(ends)) | set(excluded)),
            "accuracy": correct / total if total else None,
            "edge_accuracy": edge_correct / edge_total if edge_total else None,
            "server_loss": sum(l * n for l, n in losses) / sum(n for _, n in losses) if losses else None,
            "samples": sum(o.samples for o in outcomes),
            # Every message of this round as the server's connection saw it (uploads in,
            # round starts and server logits out), attributed by the round it names.
            "bytes": round_bytes,
            "edge_train_flops": sum(int(e.costs.get("train_flops", 0)) for e in ends.values()),
            "time_s": {
                "round": time.monotonic() - rnd.started_at,
                "server_train": sum(o.server_train_s for o in outcomes),
                "edge_compute": mean_cost("compute_s"),
                "edge_encode": mean_cost("encode_s"),
                "edge_network": mean_cost("network_s"),
                "edge_idle": mean_cost("idle_s"),
            },
            "per_agent": per_agent,
            # The server's device in this round: name, training seconds, peak memory, utilisation.
            "server": self.method.ctx.device_meter.take(),
        }
        if excluded:
            record["excluded"] = excluded
        method_figures = _plain_json(self.method.round_report(rnd.round))
        if method_figures:
            record["method"] = method_figures
        self.report["rounds"].append(record)
        self.completed_round = rnd.round
        # Checkpoint before the report: a report that shows round r implies a checkpoint of r.
        self.report["agents"] = self._agent_report()
        self._update_totals()
        self.save_checkpoint()
        self.write_report()
        print(run_report.format_summary_line(record, self.config.rounds), flush=True)
        return record

    # -- the run ------------------------------------------------------------------- #

    def _should_stop(self, record: dict[str, Any]) -> bool:
        self._failed_in_a_row = 0 if record["status"] == "ok" else self._failed_in_a_row + 1
        if self._failed_in_a_row >= self.config.max_failed_rounds:
            self.report["status"] = "aborted"
            log.error("%d rounds in a row without quorum: aborting", self._failed_in_a_row)
            return True
        target = self.config.target_accuracy
        if target is not None and record["accuracy"] is not None and record["accuracy"] >= target:
            self.report["status"] = "stopped_target"
            log.info("target accuracy %.2f%% reached in round %d", 100 * target, record["round"])
            return True
        return False

    def run(self, resume: bool = False) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()
        else:
            self.report = self._new_report()
        self.transport.subscribe(self.topics.up_any)
        self.transport.subscribe(self.topics.status_any)
        self.transport.connect()
        self._send(None, Discover(**self._base(self.completed_round)))
        try:
            self.registry.wait_for_agents(self.pump)
            first = self.completed_round + 1
            if first > self.config.rounds:
                log.info("all %d rounds already done", self.config.rounds)
            elif not self.scheduler.run(first):
                self.report["status"] = "no_agents"
            if self.report["status"] == "running":
                self.report["status"] = "finished"
        except RunAborted:
            self.report["status"] = "aborted"
            raise
        finally:
            self.report["finished_at"] = _now_iso()
            self.write_report()
            try:
                self._send(None, Shutdown(**self._base(self.completed_round), reason=self.report["status"]))
            except (OSError, RuntimeError) as exc:
                log.warning("could not broadcast shutdown: %s", exc)
            self.transport.close()
        return self.report


def _plain_json(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python numbers and lists, so a method's
    round figures go into the strict-JSON report as they are."""
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar or array
        return _plain_json(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
