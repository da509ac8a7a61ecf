"""The run report as typed records: what ``report.json`` holds.

Every record is a dataclass with the one JSON (de)serialiser of
:mod:`shared_protocol.records`; :class:`~cloud_server.recorder.RunRecorder` is
the one place that builds them. ``cloud_server/report/schema.py`` checks a
``report.json`` read back from disk (collecting every problem, for people), and
the markdown, CSV and plots read the JSON form.

Units: bytes, seconds (``_s``), FLOPs (2 x MACs, forward + backward).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from shared_protocol.memory_growth import PEAK_GROWTH_ROUNDS, growth_message, rising_run_start
from shared_protocol.messages import Hello
from shared_protocol.records import (
    AgentRoundCosts,
    JsonRecord,
    RecordError,
    bounded,
    fraction,
    non_negative,
    optional_section,
)

__all__ = [
    "RUN_STATUSES",
    "ROUND_STATUSES",
    "ServerInfo",
    "AgentInfo",
    "ByteCounts",
    "AgentBytes",
    "RoundTimes",
    "AgentRoundRecord",
    "ServerDeviceRecord",
    "RoundEvaluation",
    "RoundRecord",
    "RunTotals",
    "RunReport",
    "memory_growth_warnings",
    "now_iso",
]

RUN_STATUSES = frozenset({"running", "finished", "stopped_target", "aborted", "no_agents"})
ROUND_STATUSES = frozenset({"ok", "failed_quorum"})


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class ServerInfo(JsonRecord):
    """The host the server ran on (``report.server``)."""

    device: str
    cpu_model: str
    torch: str
    hostname: str


@dataclass(frozen=True)
class AgentInfo(JsonRecord):
    """An agent as its last Hello described it (``report.agents[id]``)."""

    cpu_model: str
    arch: str
    cores: int = non_negative(0)
    memory_bytes: int = non_negative(0)
    backend: str = ""
    num_samples: int = non_negative(0)
    class_counts: list[int] = field(default_factory=list)
    memory: dict = field(default_factory=dict, metadata={"added_later": True})  # the agent's [memory] settings ({} from an agent that sent none)
    fault: str = field(default="", metadata={"added_later": True})  # a fault on purpose ([agent] fault), "": honest

    @classmethod
    def from_hello(cls, hello: Hello) -> "AgentInfo":
        return cls(cpu_model=hello.cpu_model, arch=hello.arch, cores=hello.cores, memory_bytes=hello.memory_bytes,
                   backend=hello.backend, num_samples=hello.num_samples, class_counts=list(hello.class_counts),
                   memory=dict(hello.memory), fault=hello.fault)


@dataclass
class ByteCounts(JsonRecord):
    """Bytes as the server's connection saw them: payload (frames before chunking) and
    wire (MQTT packets), each way. Mutable: the recorder adds every message as it passes."""

    up_payload: int = non_negative(0)
    up_wire: int = non_negative(0)
    down_payload: int = non_negative(0)
    down_wire: int = non_negative(0)

    def add(self, direction: str, payload: int, wire: int) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        setattr(self, f"{direction}_payload", getattr(self, f"{direction}_payload") + payload)
        setattr(self, f"{direction}_wire", getattr(self, f"{direction}_wire") + wire)

    @classmethod
    def sum(cls, counts: Iterable["ByteCounts"]) -> "ByteCounts":
        total = cls()
        for c in counts:
            total.add("up", c.up_payload, c.up_wire)
            total.add("down", c.down_payload, c.down_wire)
        return total


@dataclass(frozen=True)
class AgentBytes(JsonRecord):
    """One agent's messages in a round as the server's connection saw them
    (``rounds[i].device_bytes[id]``): up, those it sent; down, those sent to it (broadcasts
    in the round included); training's and evaluation's apart."""

    train: ByteCounts = field(default_factory=ByteCounts)
    evaluation: ByteCounts = field(default_factory=ByteCounts)


@dataclass(frozen=True)
class RoundTimes(JsonRecord):
    """A round's seconds: wall time, the server's training, and the edge phases (mean
    over the agents that finished the round)."""

    round: float = non_negative(0.0)
    server_train: float = non_negative(0.0)
    edge_compute: float = non_negative(0.0)
    edge_encode: float = non_negative(0.0)
    edge_network: float = non_negative(0.0)
    edge_idle: float = non_negative(0.0)


@dataclass(frozen=True)
class AgentRoundRecord(AgentRoundCosts):
    """One agent's round in the report (``per_agent[id]``): the training costs it sent, and,
    when the round was evaluated, the global accuracy of the model on the device (its edge
    model where that differs from the deployed one, else its deployed model); the rest of its
    evaluation is in the round's ``evaluation.per_agent``."""

    edge_accuracy: float | None = fraction()

    @classmethod
    def of(cls, costs: AgentRoundCosts, edge_accuracy: float | None) -> "AgentRoundRecord":
        return cls(**asdict(costs), edge_accuracy=edge_accuracy)


@dataclass(frozen=True)
class ServerDeviceRecord(JsonRecord):
    """What the server's device did in a round (``rounds[i].server``, from
    :class:`~cloud_server.device_meter.DeviceMeter`)."""

    device: str
    device_name: str
    train_s: float = non_negative(0.0)  # the server's own training in the round
    peak_memory_bytes: int | None = non_negative(None)  # None: not a GPU
    gpu_utilization_percent: float | None = bounded(None, 0, 100)  # None: see gpu_utilization_unavailable
    gpu_utilization_max_percent: float | None = bounded(None, 0, 100)
    gpu_utilization_samples: int = non_negative(0)
    gpu_utilization_unavailable: str | None = None  # why there is no utilisation figure


#: The label of a method's deployed model: its figures are the round's ``accuracy`` and ``local_accuracy``.
HEADLINE = "model"


@dataclass(frozen=True)
class RoundEvaluation(JsonRecord):
    """How a round was evaluated (``report.rounds[i].evaluation``; cloud_server/evaluation.py).

    ``accuracy[label]``: global accuracy of the label's models on the run's global test set
    (``report.eval_set``), the mean over agents where each agent has its own model;
    ``local_accuracy[label]``: the label's models on the agents' own test shards,
    sample-weighted. Label ``"model"`` is the method's deployed model (the round's
    ``accuracy`` / ``local_accuracy``); ``labels`` says what every label is. Costs here are
    evaluation's only: the server's scoring seconds, the agents' evaluation FLOPs and
    seconds, and the evaluation messages' bytes (requests, reports, test activations)."""

    accuracy: dict[str, float] = field(default_factory=dict)
    local_accuracy: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    per_agent: dict[str, Any] = field(default_factory=dict)  # agent -> {"accuracy", "local_accuracy": {label: acc}, "local_samples"}
    missing: list[str] = field(default_factory=list)  # agents asked whose evaluation report did not come
    server_eval_s: float = non_negative(0.0)
    edge_eval_flops: int = non_negative(0)
    edge_eval_s: float = non_negative(0.0)  # mean over the agents that answered
    bytes: ByteCounts = field(default_factory=ByteCounts)
    figures: dict[str, Any] = optional_section(default_factory=dict)  # the method's own evaluation figures
    # Models the server scored on the global set, and those it did not score again because a
    # model with the same weights had been scored that round (EvalModel.identity).
    models_scored: int = non_negative(0, added_later=True)
    models_reused: int = non_negative(0, added_later=True)


@dataclass(frozen=True)
class RoundRecord(JsonRecord):
    """One closed round (``report.rounds[i]``)."""

    round: int = field(metadata={"min": 1})
    status: str  # one of ROUND_STATUSES
    participants: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # The method's deployed model(s) on the run's global test set (the headline; the mean over
    # agents where each has its own model); None: the round was not evaluated.
    accuracy: float | None = fraction()
    # The deployed model(s) on the agents' own test shards, sample-weighted.
    local_accuracy: float | None = bounded(None, 0, 1, added_later=True)
    # The models left on the devices where they differ from the deployed one (FedGKT's
    # ResNet-8s): global and local accuracy, as above; None where there are none.
    edge_accuracy: float | None = fraction()
    edge_local_accuracy: float | None = bounded(None, 0, 1, added_later=True)
    server_loss: float | None = None
    samples: int = non_negative(0)
    # Every message of the round as the server's connection saw it (uploads in, round
    # starts and answers out), attributed by the round it names.
    bytes: ByteCounts = field(default_factory=ByteCounts)
    edge_train_flops: int = non_negative(0)
    server_train_flops: int | None = optional_section()  # counted where the server's training is (centralized)
    time_s: RoundTimes = field(default_factory=RoundTimes)
    per_agent: dict[str, AgentRoundRecord] = field(default_factory=dict)
    # Per agent, the bytes of its own messages (AgentBytes); empty in reports from before them.
    device_bytes: dict[str, AgentBytes] = optional_section(default_factory=dict)
    # The server's device in the round (cloud_server/device_meter.py); None in reports from before it.
    server: ServerDeviceRecord | None = optional_section()
    # The seconds the server spent in the method's hooks (round_config, on_upload / answer,
    # complete, evaluation, end_round), timed by the coordinator around each call.
    server_hooks_s: dict[str, float] = optional_section(default_factory=dict)
    excluded: dict[str, str] = optional_section(default_factory=dict)  # agent -> why its upload was not used
    method: dict[str, Any] = optional_section(default_factory=dict)  # the method's own figures (round_report)
    evaluation: RoundEvaluation | None = optional_section()  # None: not evaluated
    # Robustness to a bad device (cloud_server/robust/): per agent, the uploads refused as
    # implausible by reason ({"count", "detail"}: the first figure and threshold), clipped
    # updates, server steps skipped on its data; the aggregation rule when not the mean;
    # quarantine. Empty: nothing happened.
    robustness: dict[str, Any] = optional_section(default_factory=dict)
    # Differential privacy (cloud_server/privacy.py): what was clipped and noised, ε so far; {}: DP off.
    privacy: dict[str, Any] = optional_section(default_factory=dict)
    # What an "ok" round's reader must know: refusals, clips, skipped steps, a rule's fallback.
    warnings: list[str] = optional_section(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.status not in ROUND_STATUSES:
            raise RecordError(f"round status must be one of {sorted(ROUND_STATUSES)}, got {self.status!r}")


@dataclass(frozen=True)
class RunTotals(JsonRecord):
    """Sums over the rounds and the run's counters (``report.totals``); built by :meth:`of`."""

    rounds_completed: int = non_negative(0)
    best_accuracy: float | None = fraction()
    final_accuracy: float | None = fraction()
    final_local_accuracy: float | None = bounded(None, 0, 1, added_later=True)
    final_edge_accuracy: float | None = fraction()
    up_payload: int = non_negative(0)
    up_wire: int = non_negative(0)
    down_payload: int = non_negative(0)
    down_wire: int = non_negative(0)
    wire_total: int = non_negative(0)
    edge_train_flops: int = non_negative(0)
    server_train_flops: int | None = optional_section()
    wall_time_s: float = non_negative(0.0)
    rejected_messages: int = non_negative(0)
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    # Chunks refused below the message layer (they never became messages), by code.
    rejected_chunks: int = non_negative(0, added_later=True)
    rejected_chunks_by_reason: dict[str, int] = field(default_factory=dict, metadata={"added_later": True})
    # Bytes outside any round (registration, status, stale messages).
    outside_rounds: ByteCounts = field(default_factory=ByteCounts, metadata={"added_later": True})
    # Evaluation's bytes and agent FLOPs over the run (the columns above are training's).
    eval_bytes: ByteCounts = field(default_factory=ByteCounts, metadata={"added_later": True})
    edge_eval_flops: int = non_negative(0, added_later=True)
    server_connection: dict[str, Any] | None = optional_section()  # everything the server's connection carried

    @classmethod
    def of(
        cls,
        rounds: Sequence[RoundRecord],
        *,
        wall_time_s: float,
        rejected: Mapping[str, int],
        rejected_chunks: Mapping[str, int],
        outside_rounds: ByteCounts,
        server_connection: dict[str, Any] | None,
    ) -> "RunTotals":
        accs = [r.accuracy for r in rounds if r.accuracy is not None]
        edge_accs = [r.edge_accuracy for r in rounds if r.edge_accuracy is not None]
        local_accs = [r.local_accuracy for r in rounds if r.local_accuracy is not None]
        wire = ByteCounts.sum(r.bytes for r in rounds)
        evaluated = [r.evaluation for r in rounds if r.evaluation is not None]
        server_flops = [r.server_train_flops for r in rounds if r.server_train_flops is not None]
        return cls(
            rounds_completed=sum(1 for r in rounds if r.status == "ok"),
            best_accuracy=max(accs) if accs else None,
            final_accuracy=accs[-1] if accs else None,
            final_local_accuracy=local_accs[-1] if local_accs else None,
            final_edge_accuracy=edge_accs[-1] if edge_accs else None,
            **asdict(wire),
            wire_total=wire.up_wire + wire.down_wire,
            edge_train_flops=sum(r.edge_train_flops for r in rounds),
            server_train_flops=sum(server_flops) if server_flops else None,
            wall_time_s=wall_time_s,
            rejected_messages=sum(rejected.values()),
            rejected_by_reason=dict(rejected),
            rejected_chunks=sum(rejected_chunks.values()),
            rejected_chunks_by_reason=dict(rejected_chunks),
            outside_rounds=ByteCounts(**asdict(outside_rounds)),
            eval_bytes=ByteCounts.sum(e.bytes for e in evaluated),
            edge_eval_flops=sum(e.edge_eval_flops for e in evaluated),
            server_connection=server_connection,
        )


@dataclass(kw_only=True)  # keyword-only: the fields keep report.json's order
class RunReport(JsonRecord):
    """The whole run (``report.json``). Mutable: the recorder appends rounds and sets the
    status and totals as the run goes."""

    edgesplit_version: str
    run_id: str
    method: str
    config: dict[str, Any]  # the resolved server config, with the method's under "method_config"
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    status: str = "running"  # one of RUN_STATUSES
    server: ServerInfo
    agents: dict[str, AgentInfo] = field(default_factory=dict)
    # Agents the server refused at join ({"agent", "code", "reason"}): not in the allow-list,
    # or data that does not fit the run (code "data_mismatch", naming both shapes).
    refused_agents: list[dict[str, str]] = field(default_factory=list, metadata={"added_later": True})
    # Each time the server resumed this run from its checkpoint: {"after_round": N, "at": ISO time}.
    # totals.wall_time_s adds the processes' times; the time between the last checkpoint and a
    # crash is not in it.
    resumed: list[dict[str, Any]] = field(default_factory=list, metadata={"added_later": True})
    # Agents whose per-round peak RSS grew several rounds in a row (shared_protocol.memory_growth),
    # one entry per such run of rounds: {"agent", "first_round", "last_round", "peak_rss_bytes": [...], "message"}.
    memory_warnings: list[dict[str, Any]] = field(default_factory=list, metadata={"added_later": True})
    models: dict[str, Any]  # "edge" / "server": name, params, train_flops_per_sample (or None)
    rounds: list[RoundRecord] = field(default_factory=list)
    totals: RunTotals = field(default_factory=RunTotals)
    data: dict[str, Any] | None = optional_section()  # what a run without agents trained on (centralized)
    # The global test set every round's accuracy is measured on (cloud_server/evaluation.py):
    # dataset, split, samples, seed, ids_sha256, images_sha256, class_counts; None: no global set.
    eval_set: dict[str, Any] | None = optional_section()
    # Per-device figures read against a stated device (cloud_server/report/per_device.py): per
    # agent, bytes and link seconds per round, peak memory against the device's; None: no agent.
    per_device: dict[str, Any] | None = optional_section()
    # What the server could reconstruct from what it received, added by `edgesplit audit`
    # (cloud_server.audit.audit_run.leakage_section); None: the run was not audited.
    leakage: dict[str, Any] | None = optional_section()
    # Differential privacy's parameters and ε for the run (cloud_server/privacy.py); None: DP off.
    privacy: dict[str, Any] | None = optional_section()
    # The activation defences that were on, with their parameters and ε
    # (cloud_server/activation_privacy.py); None: none was.
    defences: dict[str, Any] | None = optional_section()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.status not in RUN_STATUSES:
            raise RecordError(f"run status must be one of {sorted(RUN_STATUSES)}, got {self.status!r}")


def memory_growth_warnings(rounds: Sequence[RoundRecord]) -> list[dict[str, Any]]:
    """Every run of rounds over which an agent's reported peak RSS grew
    :data:`~shared_protocol.memory_growth.PEAK_GROWTH_ROUNDS` times or more in a row,
    over the rounds it finished, oldest first (the agent logs the same warning)."""
    by_agent: dict[str, list[tuple[int, int]]] = {}
    for record in rounds:
        for agent, costs in record.per_agent.items():
            if costs.peak_rss_per_round:  # a lifetime peak (agents sharing a process) rises by nature
                by_agent.setdefault(agent, []).append((record.round, costs.peak_rss_bytes))
    warnings: list[dict[str, Any]] = []
    for agent, series in sorted(by_agent.items()):
        peaks = [p for _, p in series]
        end = len(series)
        found = []
        while end > 1:  # each maximal run of growth, from the latest back
            start = rising_run_start(peaks[:end])
            if end - 1 - start >= PEAK_GROWTH_ROUNDS:
                run = series[start:end]
                found.append({"agent": agent, "first_round": run[0][0], "last_round": run[-1][0],
                              "peak_rss_bytes": [p for _, p in run],
                              "message": f"agent {agent}: " + growth_message([r for r, _ in run], [p for _, p in run])})
            end = start if start < end - 1 else end - 1
        warnings.extend(reversed(found))
    return warnings
