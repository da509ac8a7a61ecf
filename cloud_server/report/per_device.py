"""Per-device figures: what one agent's device sends, receives and holds per round, read
against a stated device (:class:`~cloud_server.device_target.DeviceTarget`: its link's speed
and its memory). Built from report.json's own fields, so ``cloud-server report`` can read a
finished run against another device.

Per agent (means over the rounds it took part in): wire bytes up and down, training's and
evaluation's apart and together (``rounds[i].device_bytes``, as the server's connection saw
them); the seconds they take on the link each way, and the slowest round's; the training
upload per image of the agent's data (``num_samples`` of its hello), which scales with the
data for methods that upload per image (feature maps, activations), not for a model upload;
the agent's highest per-round peak RSS against the device's memory, with a warning and the
setting that lowers it above :data:`~cloud_server.device_target.MEMORY_SHARE` of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..device_target import MEMORY_SHARE, DeviceTarget

__all__ = ["per_device_section", "memory_hint", "BYTE_FIELDS", "AGENT_FIELDS"]

#: The byte means of an agent's entry: (field, where in a round's ``device_bytes[agent]``).
BYTE_FIELDS = {
    "train_up_wire": ("train", "up_wire"), "train_down_wire": ("train", "down_wire"),
    "eval_up_wire": ("evaluation", "up_wire"), "eval_down_wire": ("evaluation", "down_wire"),
}
#: Every field of an agent's entry: (kind, nullable).
AGENT_FIELDS = {
    "rounds": ("int", False), **{k: ("number", False) for k in BYTE_FIELDS},
    "up_wire": ("number", False), "down_wire": ("number", False),
    "up_link_s": ("number", False), "down_link_s": ("number", False),
    "max_up_link_s": ("number", False), "max_down_link_s": ("number", False),
    "train_up_wire_per_image": ("number", True), "compute_s": ("number", True), "round_s": ("number", True),
    "peak_rss_bytes": ("int", True),
    "memory_bytes": ("int", True), "memory_share": ("number", True), "memory_warning": ("str", True),
}


def memory_hint(settings: Mapping[str, Any]) -> str:
    """The setting that lowers an agent's peak, given its ``[memory]`` settings (its hello's)."""
    micro = settings.get("micro_batch_samples") or 0
    if not micro:
        return ("run the agent with --low-memory (edge-agent run / edgesplit local), or set [memory] "
                "micro_batch_samples (e.g. --set memory.micro_batch_samples=16)")
    smaller = max(2, int(micro) // 2)
    extra = "" if settings.get("checkpoint_blocks") else " or [memory] checkpoint_blocks = true"
    return (f"lower [memory] micro_batch_samples (now {micro}; e.g. --set memory.micro_batch_samples={smaller})"
            f"{extra}, or a smaller edge model")


def _agent_entry(agent: str, rounds: list[Mapping[str, Any]], info: Mapping[str, Any] | None,
                 target: DeviceTarget) -> dict[str, Any]:
    n = len(rounds)
    entry: dict[str, Any] = {"rounds": n}
    for key, (kind, wire) in BYTE_FIELDS.items():
        entry[key] = sum(r.get("device_bytes", {}).get(agent, {}).get(kind, {}).get(wire, 0) for r in rounds) / n
    entry["up_wire"] = entry["train_up_wire"] + entry["eval_up_wire"]
    entry["down_wire"] = entry["train_down_wire"] + entry["eval_down_wire"]
    entry["up_link_s"], entry["down_link_s"] = target.link_s(entry["up_wire"]), target.link_s(entry["down_wire"])
    per_round = [r.get("device_bytes", {}).get(agent, {}) for r in rounds]
    entry["max_up_link_s"] = max(target.link_s(b.get("train", {}).get("up_wire", 0) + b.get("evaluation", {}).get("up_wire", 0))
                                 for b in per_round)
    entry["max_down_link_s"] = max(target.link_s(b.get("train", {}).get("down_wire", 0)
                                                 + b.get("evaluation", {}).get("down_wire", 0)) for b in per_round)
    images = (info or {}).get("num_samples") or 0
    entry["train_up_wire_per_image"] = entry["train_up_wire"] / images if images else None
    # The agent's own seconds per round it trained in: its compute, and the whole round on the device
    # (compute, encoding, network and waiting for the server).
    costs = [r["per_agent"][agent] for r in rounds if agent in r["per_agent"]]
    entry["compute_s"] = sum(c.get("compute_s", 0.0) for c in costs) / len(costs) if costs else None
    entry["round_s"] = sum(c.get("round_s", 0.0) for c in costs) / len(costs) if costs else None
    peaks = [r["per_agent"][agent]["peak_rss_bytes"] for r in rounds if agent in r["per_agent"]]
    entry["peak_rss_bytes"] = max(peaks) if peaks else None
    memory = target.memory_bytes or (info or {}).get("memory_bytes") or None
    entry["memory_bytes"] = memory
    entry["memory_share"] = entry["peak_rss_bytes"] / memory if memory and entry["peak_rss_bytes"] is not None else None
    entry["memory_warning"] = None
    if entry["memory_share"] is not None and entry["memory_share"] > MEMORY_SHARE:
        entry["memory_warning"] = (
            f"agent {agent}: peak RSS {entry['peak_rss_bytes'] / 1e6:,.0f} MB is {entry['memory_share']:.0%} of the "
            f"device's {memory / 1e6:,.0f} MB (warned above {MEMORY_SHARE:.0%}); to lower it, "
            + memory_hint((info or {}).get("memory") or {}))
    return entry


def per_device_section(report: Mapping[str, Any], target: DeviceTarget | None = None) -> dict[str, Any] | None:
    """report.json's ``per_device`` (None while no agent has taken part in a round); ``target``
    defaults to the one the run's config names."""
    target = target or DeviceTarget.of_config(report.get("config") or {})
    by_agent: dict[str, list[Mapping[str, Any]]] = {}
    for r in report["rounds"]:
        for agent in sorted(set(r.get("device_bytes") or {}) | set(r["per_agent"])):
            by_agent.setdefault(agent, []).append(r)
    if not by_agent:
        return None
    infos = report.get("agents") or {}
    agents = {agent: _agent_entry(agent, rounds, infos.get(agent), target) for agent, rounds in sorted(by_agent.items())}
    return {
        "link_mbit": float(target.link_mbit),
        "device_memory_bytes": target.memory_bytes,  # None: each agent's own memory
        "memory_share_warned": MEMORY_SHARE,
        "agents": agents,
        "warnings": [e["memory_warning"] for e in agents.values() if e["memory_warning"]],
    }
