"""The server's live view: Prometheus metrics and the status page (``[server]
metrics_address``, ``cloud-server run --metrics``). Imported only when metrics are on.

The coordinator calls the ``on_*`` hooks from its own thread; the HTTP thread only
reads: counters (thread-safe in prometheus_client) and a :class:`LiveState` snapshot the
coordinator thread rebuilds at most every ``REFRESH_S`` while it pumps, and whenever a
round closes. Nothing is read from the coordinator's dicts during a scrape.

Conventions: base units (seconds, bytes, ratios in 0-1), ``_total`` counters, labels
``run`` and ``method`` on every series, ``agent`` bounded by the registry (bytes on
topics of senders the server never accepted count as ``agent="unregistered"``,
broadcasts as ``agent="all"``), nothing labelled by message id or round. Byte counters
split by ``traffic``: ``round`` (a round's training messages), ``evaluation`` and
``outside`` (registration, status, stale messages) exactly as report.json's
``totals`` (``up_wire`` ... / ``eval_bytes`` / ``outside_rounds``) count them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared_protocol.messages import RoundEnd
from shared_protocol.metrics_endpoint import MetricsEndpointConfig
from shared_protocol.metrics_http import MetricsServer, SelfCost, timed_update

from .phase_ticker import describe_phase
from .live_state import AgentView, LiveState, OpenRoundView, RoundPoint
from .records import RoundRecord



class RunLoop(Protocol):
    """What the metrics read of the coordinator (:class:`cloud_server.coordinator.Coordinator`),
    on its own thread: the run's config and method, the agents' registry, the transport's
    inbound progress and refusals, the open rounds, the recorder's status, the hook clock."""

    config: Any
    method: Any
    registry: Any
    transport: Any
    topics: Any
    open_rounds: Mapping[int, Any]
    recorder: Any
    completed_round: int
    rejected: Mapping[str, int]
    hook_clock: Any
    out_dir: Path  # where the run's report.json and summary.md are written

__all__ = ["ServerMetrics", "LiveState", "AgentView", "RoundPoint"]

PHASES = ("compute", "encode", "network", "idle")
ROUND_BUCKETS_S = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)


class ServerMetrics:
    REFRESH_S = 0.5

    def __init__(self, loop: RunLoop, endpoint: MetricsEndpointConfig) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.run, self.method = loop.config.run_id, loop.method.name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the server process's CPU seconds and RSS
        base = ["run", "method"]
        r = self.registry
        self.rounds = Counter("edgesplit_rounds", "Rounds closed, by outcome (ok, failed_quorum).", [*base, "status"], registry=r)
        self.round_duration = Histogram("edgesplit_round_duration_seconds", "Wall time of closed rounds.", base,
                                        buckets=ROUND_BUCKETS_S, registry=r)
        self.accuracy = Gauge("edgesplit_accuracy_ratio", "Accuracy of the latest evaluated round: scope global (the run's "
                              "held-out set) or local (agents' own shards, sample-weighted); model is the evaluation label "
                              "(model = the method's deployed model).", [*base, "scope", "model"], registry=r)
        self.evaluated_round = Gauge("edgesplit_evaluated_round", "The round edgesplit_accuracy_ratio is from.", base, registry=r)
        bytes_labels = [*base, "agent", "direction", "traffic"]
        self.wire = Counter("edgesplit_wire_bytes", "MQTT packet bytes as the server's connection saw them; direction up "
                            "(agent to server) or down; traffic round | evaluation | outside.", bytes_labels, registry=r)
        self.payload = Counter("edgesplit_payload_bytes", "Message bytes before chunking (frames), as edgesplit_wire_bytes.",
                               bytes_labels, registry=r)
        agent = [*base, "agent"]
        self.agent_phase = Counter("edgesplit_agent_phase_seconds", "Agents' round seconds by phase (compute, encode, "
                                   "network, idle), as their round_ends reported them.", [*agent, "phase"], registry=r)
        self.agent_flops = Counter("edgesplit_agent_train_flops", "Agents' training FLOPs (2 x MACs, forward + backward).",
                                   agent, registry=r)
        self.agent_rounds = Counter("edgesplit_agent_rounds", "Rounds an agent finished (round_end accepted).", agent, registry=r)
        self.last_phase = Gauge("edgesplit_agent_last_round_phase_seconds", "An agent's last finished round: seconds by phase.",
                                [*agent, "phase"], registry=r)
        self.last_round_s = Gauge("edgesplit_agent_last_round_seconds", "An agent's last finished round: wall time.", agent, registry=r)
        self.last_flops = Gauge("edgesplit_agent_last_round_train_flops", "An agent's last finished round: training FLOPs.",
                                agent, registry=r)
        self.last_rss = Gauge("edgesplit_agent_last_round_peak_rss_bytes", "An agent's last finished round: its own peak RSS (since the round before ended).",
                              agent, registry=r)
        self.last_round = Gauge("edgesplit_agent_last_round", "The round an agent's last_round_* figures are from.", agent, registry=r)
        self.server_train = Counter("edgesplit_server_train_seconds", "Seconds the server spent training.", base, registry=r)
        self.gpu_peak = Gauge("edgesplit_server_gpu_peak_memory_bytes", "Peak GPU memory allocated in the last closed round "
                              "(CUDA only).", base, registry=r)
        self.gpu_util = Gauge("edgesplit_server_gpu_utilization_ratio", "Mean GPU utilisation while the server trained in the "
                              "last closed round (CUDA with NVML only).", base, registry=r)
        # What watching costs, served with the rest (shared_protocol/metrics_http.py).
        self.self_cost = SelfCost()
        self.registry.register(self.self_cost.collector({"run": self.run, "method": self.method}))
        self._history: list[RoundPoint] = []
        self._cumulative_wire = 0
        self._costs: dict[str, tuple[int, dict[str, Any]]] = {}
        self._refreshed_at = 0.0
        self._serving_until: float | None = None
        self.state = self._build_state()
        self.registry.register(_LiveCollector(self))
        self._server: MetricsServer | None = None

    # -- serving -------------------------------------------------------------------- #

    def start(self) -> str:
        """Serve ``/metrics``, the status page ``/``, ``/status.json`` and the run's ``/report.json``
        and ``/summary.md``; returns the page's URL."""
        from .status_page import fragment, render_page

        self._server = MetricsServer(self.endpoint, self.registry, self_cost=self.self_cost, pages={
            "/": lambda: (render_page(self.live()).encode(), "text/html; charset=utf-8"),
            "/live": lambda: (fragment(self.live()).encode(), "text/html; charset=utf-8"),
            "/status.json": lambda: (json.dumps(self.live().to_json()).encode(), "application/json"),
            "/report.json": lambda: self._run_file("report.json", "application/json"),
            "/summary.md": lambda: self._run_file("summary.md", "text/markdown; charset=utf-8"),
        }).start()
        return self._server.url

    def _run_file(self, name: str, content_type: str) -> tuple[bytes, str]:
        """The run's report file as written so far (the final one once the run has ended)."""
        path = Path(self.loop.out_dir) / name
        if not path.is_file():
            return f"{name} is not written yet\n".encode(), \
                "text/plain; charset=utf-8"
        return path.read_bytes(), content_type

    def live(self) -> LiveState:
        """The latest snapshot with the server's work as it is now (HTTP thread)."""
        current = self.loop.hook_clock.current()
        if current is None:
            return self.state
        round_, what, started = current
        return dataclasses.replace(self.state, server_phase=f"{describe_phase(what)} (round {round_}, "
                                                           f"{time.monotonic() - started:.0f} s)")

    def linger(self, seconds: float) -> float:
        """The run has ended and the page stays up ``seconds`` more: say so on it; returns until when."""
        self._serving_until = time.time() + seconds
        self.refresh(force=True)
        return self._serving_until

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- hooks (coordinator thread) ------------------------------------------------------ #

    def agent_label(self, agent: str | None) -> str:
        if agent is None:
            return "unregistered"
        return agent if agent in self.loop.registry.agents else "unregistered"

    @timed_update
    def on_bytes(self, agent: str | None, direction: str, traffic: str, payload: int, wire: int) -> None:
        label = "all" if agent == "all" else self.agent_label(agent)
        self.wire.labels(self.run, self.method, label, direction, traffic).inc(wire)
        self.payload.labels(self.run, self.method, label, direction, traffic).inc(payload)

    @timed_update
    def on_round_end(self, agent: str, end: RoundEnd) -> None:
        costs = end.costs
        labels = (self.run, self.method, agent)
        for phase in PHASES:
            seconds = float(getattr(costs, f"{phase}_s"))
            self.agent_phase.labels(*labels, phase).inc(max(0.0, seconds))
            self.last_phase.labels(*labels, phase).set(seconds)
        self.agent_flops.labels(*labels).inc(costs.train_flops)
        self.agent_rounds.labels(*labels).inc()
        self.last_round_s.labels(*labels).set(costs.round_s)
        self.last_flops.labels(*labels).set(costs.train_flops)
        self.last_rss.labels(*labels).set(costs.peak_rss_bytes)
        self.last_round.labels(*labels).set(end.round)
        self._costs = {**self._costs, agent: (end.round, costs.to_json())}
        self.refresh(force=True)

    @timed_update
    def on_round_closed(self, record: RoundRecord) -> None:
        base = (self.run, self.method)
        self.rounds.labels(*base, record.status).inc()
        self.round_duration.labels(*base).observe(record.time_s.round)
        self.server_train.labels(*base).inc(record.time_s.server_train)
        if record.evaluation is not None:
            self.evaluated_round.labels(*base).set(record.round)
            for scope, figures in (("global", record.evaluation.accuracy), ("local", record.evaluation.local_accuracy)):
                for label, value in figures.items():
                    self.accuracy.labels(*base, scope, label).set(value)
        server = record.server
        if server is not None and server.peak_memory_bytes is not None:
            self.gpu_peak.labels(*base).set(server.peak_memory_bytes)
        if server is not None and server.gpu_utilization_percent is not None:
            self.gpu_util.labels(*base).set(server.gpu_utilization_percent / 100.0)
        self._cumulative_wire += record.bytes.up_wire + record.bytes.down_wire
        self._history.append(RoundPoint(record.round, record.status, record.accuracy, record.local_accuracy,
                                        self._cumulative_wire, record.time_s.round))
        self.refresh(force=True)

    @timed_update
    def refresh(self, force: bool = False) -> None:
        """Rebuild the snapshot the HTTP thread reads (at most every REFRESH_S unless forced)."""
        now = time.monotonic()
        if force or now - self._refreshed_at >= self.REFRESH_S:
            self._refreshed_at = now
            self.state = self._build_state()

    def _build_state(self) -> LiveState:
        loop = self.loop
        agents = {}
        for agent_id, s in sorted(loop.registry.agents.items()):
            last_round, costs = self._costs.get(agent_id, (0, {}))
            agents[agent_id] = AgentView(
                online=s.online, dropped=s.dropped, status=s.status, round=s.round, rejections=s.rejections,
                reassembly_bytes=loop.transport.inbound_progress(loop.topics.up(agent_id))[1],
                last_round=last_round, costs=costs,
            )
        open_rounds = tuple(
            OpenRoundView(rnd.round, len(rnd.participants), len(rnd.done), len(rnd.missing), tuple(rnd.waiting_for()),
                          rnd.started_at, rnd.deadline_at)
            for _, rnd in sorted(loop.open_rounds.items())
        )
        return LiveState(
            run=self.run, method=self.method, schedule=loop.method.schedule, status=loop.recorder.status,
            planned_rounds=loop.config.rounds, completed_round=loop.completed_round, open_rounds=open_rounds,
            agents=agents, rejected=dict(loop.rejected), rejected_chunks=dict(loop.transport.rejections()),
            history=tuple(self._history), updated_at=time.time(), serving_until=self._serving_until,
        )


class _LiveCollector(Collector):
    """The series read from the latest :class:`LiveState` at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        state = m.state
        base = [m.run, m.method]

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["run", "method", *(labels or [])])

        info = gauge("edgesplit_run_info", "The run (always 1): its schedule and status.", ["schedule", "status"])
        info.add_metric([*base, state.schedule, state.status], 1)
        yield info
        planned = gauge("edgesplit_rounds_planned", "Rounds the run is configured for.")
        planned.add_metric(base, state.planned_rounds)
        yield planned
        completed = gauge("edgesplit_round_completed", "The last closed round (0: none yet).")
        completed.add_metric(base, state.completed_round)
        yield completed
        current = gauge("edgesplit_round_in_progress", "The lowest open round (0: none open).")
        current.add_metric(base, state.round_in_progress)
        yield current
        progress = gauge("edgesplit_round_agents", "Agents of an open round: participants (expected), done, missing, "
                         "waiting.", ["round_state"])
        deadline = gauge("edgesplit_round_deadline_remaining_seconds", "Seconds until the lowest open round closes "
                         "whoever is missing (absent in async runs: each agent has its own deadline).")
        open_s = gauge("edgesplit_round_open_seconds", "Seconds the lowest open round has been open.")
        if state.open_rounds:
            rnd = state.open_rounds[0]
            for name, value in (("participants", rnd.participants), ("done", rnd.done), ("missing", rnd.missing),
                                ("waiting", len(rnd.waiting_for))):
                progress.add_metric([*base, name], value)
            open_s.add_metric(base, rnd.open_s)
            if rnd.deadline_left_s is not None:
                deadline.add_metric(base, max(0.0, rnd.deadline_left_s))
        yield progress
        yield deadline
        yield open_s
        views = state.agents.values()
        agents = gauge("edgesplit_agents", "Agents by state: registered, online, dropped.", ["agent_state"])
        for name, value in (("registered", len(state.agents)), ("online", sum(v.online and not v.dropped for v in views)),
                            ("dropped", sum(v.dropped for v in views))):
            agents.add_metric([*base, name], value)
        yield agents
        online = gauge("edgesplit_agent_online", "1 while the agent is online (its retained status), 0 after its last will.",
                       ["agent"])
        reasm = gauge("edgesplit_reassembly_bytes", "Bytes of an agent's uploads held while their chunks arrive.", ["agent"])
        own = CounterMetricFamily("edgesplit_agent_rejected_messages", "An agent's own messages the server rejected "
                                  "(toward max_rejections_per_agent).", labels=["run", "method", "agent"])
        for agent_id, view in state.agents.items():
            online.add_metric([*base, agent_id], float(view.online and not view.dropped))
            reasm.add_metric([*base, agent_id], view.reassembly_bytes)
            own.add_metric([*base, agent_id], view.rejections)
        yield online
        yield reasm
        yield own
        yield _counter("edgesplit_rejected_messages", "Messages the server rejected, by reason (error code).",
                       base, "reason", state.rejected)
        yield _counter("edgesplit_rejected_chunks", "Chunks refused below the message layer, by reason.", base, "reason",
                       state.rejected_chunks)


def _counter(name: str, doc: str, base: list[str], label: str, values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["run", "method", label])
    for key, value in sorted(values.items()):
        family.add_metric([*base, key], value)
    return family
