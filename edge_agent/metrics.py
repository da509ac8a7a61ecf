"""An agent's own Prometheus metrics (``[agent] metrics_address``, ``edge-agent run
--metrics``), so that a Prometheus scraping the fleet sees each device: its last round's
costs as it measured them, running totals, its MQTT connection and reconnects, the bytes
its connection carried and the messages it rejected. Imported only when metrics are on.

The agent thread calls the ``on_*`` hooks; a scrape reads prometheus_client's
thread-safe instruments and the transport's locked counters, nothing else. Series carry
``run`` and ``agent``; the round's figures also ``method``. Names start with
``edgesplit_edge_`` so they never mix with the server's view of the same agent
(``edgesplit_agent_*``, from its round_end messages).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared_protocol.metrics_endpoint import MetricsEndpointConfig
from shared_protocol.metrics_http import MetricsServer, SelfCost, timed_update
from shared_protocol.records import AgentRoundCosts

if TYPE_CHECKING:
    from shared_protocol.transport_interface import Transport

__all__ = ["AgentMetrics"]

PHASES = ("compute", "encode", "network", "idle")
STATES = ("online", "training", "idle", "offline")


class AgentMetrics:
    def __init__(self, run_id: str, agent_id: str, transport: "Transport", endpoint: MetricsEndpointConfig) -> None:
        self.transport = transport  # read at scrape time: its connection and traffic counters
        self.endpoint = endpoint
        self.run, self.agent_id = run_id, agent_id
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # the agent process's CPU seconds and current RSS
        base = ["run", "agent"]
        round_labels = [*base, "method"]
        self.rounds = Counter("edgesplit_edge_rounds", "Rounds this agent finished (round_end sent).", round_labels, registry=r)
        self.phase_total = Counter("edgesplit_edge_phase_seconds", "Round seconds by phase (compute, encode, network, idle).",
                                   [*round_labels, "phase"], registry=r)
        self.flops_total = Counter("edgesplit_edge_train_flops", "Training FLOPs (2 x MACs, forward + backward).", round_labels,
                                   registry=r)
        self.last_round = Gauge("edgesplit_edge_last_round", "The round the last_round_* figures are from.", round_labels, registry=r)
        self.last_phase = Gauge("edgesplit_edge_last_round_phase_seconds", "The last round's seconds by phase.",
                                [*round_labels, "phase"], registry=r)
        self.last_round_s = Gauge("edgesplit_edge_last_round_seconds", "The last round's wall time (from its RoundStart to "
                                  "its round_end).", round_labels, registry=r)
        self.last_flops = Gauge("edgesplit_edge_last_round_train_flops", "The last round's training FLOPs.", round_labels, registry=r)
        self.last_samples = Gauge("edgesplit_edge_last_round_samples", "Samples trained in the last round.", round_labels, registry=r)
        self.last_rss = Gauge("edgesplit_edge_last_round_peak_rss_bytes", "The last finished round's own peak RSS (since the round before ended).",
                              round_labels, registry=r)
        self.last_bytes = Gauge("edgesplit_edge_last_round_wire_bytes", "The last round's MQTT packet bytes, up (to the server) "
                                "or down.", [*round_labels, "direction"], registry=r)
        self.skipped = Counter("edgesplit_edge_skipped_batches", "Training batches skipped to finish within round deadlines.",
                               round_labels, registry=r)
        self.rejected = Counter("edgesplit_edge_rejected_messages", "Inbound messages this agent rejected, by reason.",
                                [*base, "reason"], registry=r)
        self.state = Gauge("edgesplit_edge_state", "1 for the state this agent last announced (online, training, idle, offline).",
                           [*base, "state"], registry=r)
        self.registry.register(_ConnectionCollector(self))
        # What watching costs, served with the rest (shared_protocol/metrics_http.py).
        self.self_cost = SelfCost()
        self.registry.register(self.self_cost.collector({"run": self.run, "agent": self.agent_id}))
        self._server: MetricsServer | None = None

    def start(self) -> str:
        self._server = MetricsServer(self.endpoint, self.registry, self_cost=self.self_cost).start()
        return self._server.url + "metrics"

    @property
    def url(self) -> str | None:
        return self._server.url + "metrics" if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- hooks (agent thread) ------------------------------------------------------------ #

    @timed_update
    def on_round(self, round_: int, method: str, costs: AgentRoundCosts) -> None:
        labels = (self.run, self.agent_id, method)
        for phase in PHASES:
            seconds = float(getattr(costs, f"{phase}_s"))
            self.phase_total.labels(*labels, phase).inc(max(0.0, seconds))
            self.last_phase.labels(*labels, phase).set(seconds)
        self.rounds.labels(*labels).inc()
        self.flops_total.labels(*labels).inc(costs.train_flops)
        self.skipped.labels(*labels).inc(costs.skipped_batches)
        self.last_round.labels(*labels).set(round_)
        self.last_round_s.labels(*labels).set(costs.round_s)
        self.last_flops.labels(*labels).set(costs.train_flops)
        self.last_samples.labels(*labels).set(costs.samples)
        self.last_rss.labels(*labels).set(costs.peak_rss_bytes)
        self.last_bytes.labels(*labels, "up").set(costs.wire_bytes_up)
        self.last_bytes.labels(*labels, "down").set(costs.wire_bytes_down)

    @timed_update
    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.run, self.agent_id, reason).inc()

    @timed_update
    def on_state(self, state: str) -> None:
        for name in STATES:
            self.state.labels(self.run, self.agent_id, name).set(1.0 if name == state else 0.0)


class _ConnectionCollector(Collector):
    """The MQTT connection, read at scrape time (the transport's counters are locked)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, transport = self.metrics, self.metrics.transport
        base = [m.run, m.agent_id]
        connected = GaugeMetricFamily("edgesplit_edge_connected", "1 while connected to the broker.", labels=["run", "agent"])
        connected.add_metric(base, float(getattr(transport, "connected", True)))
        yield connected
        reconnects = CounterMetricFamily("edgesplit_edge_reconnects", "Connections to the broker after the first.",
                                         labels=["run", "agent"])
        reconnects.add_metric(base, max(0, transport.connect_count - 1))
        yield reconnects
        stats = transport.stats.snapshot()
        for kind in ("wire", "payload"):
            family = CounterMetricFamily(f"edgesplit_edge_{kind}_bytes", f"{kind.capitalize()} bytes this agent's connection "
                                         "carried, up (sent) or down (received).", labels=["run", "agent", "direction"])
            family.add_metric([*base, "up"], stats[f"{kind}_bytes_out"])
            family.add_metric([*base, "down"], stats[f"{kind}_bytes_in"])
            yield family
