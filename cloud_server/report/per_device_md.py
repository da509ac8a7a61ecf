"""The per-device figures (report.json's ``per_device``, :mod:`.per_device`) as people read
them: summary.md's "Per device" table, the console's closing lines, and the cells of the
comparison of several runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .formatting import DASH, mb, table

__all__ = ["per_device_md", "per_device_lines", "comparison_cells", "COMPARISON_HEADER"]

COMPARISON_HEADER = ["MB up / device / round", "Up s / round at link", "Peak RSS MB (max agent)"]


def _target_text(section: Mapping[str, Any]) -> str:
    memory = section.get("device_memory_bytes")
    return (f"{section['link_mbit']:g} Mbit/s each way (--link-mbit, [server] link_mbit); memory: "
            + (f"a {memory / 1e6:,.0f} MB device (--device-memory, [server] device_memory)" if memory
               else "each agent's own, as its hello reported it (--device-memory states a device's)"))


def _share(entry: Mapping[str, Any]) -> str:
    share = entry.get("memory_share")
    return DASH if share is None else f"{share:.0%}" + (" (warning)" if entry.get("memory_warning") else "")


def _per_image(entry: Mapping[str, Any]) -> str:
    value = entry.get("train_up_wire_per_image")
    return DASH if value is None else f"{value / 1e3:,.2f}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def per_device_md(report: Mapping[str, Any]) -> list[str]:
    """summary.md's "Per device" section; empty while the report has none."""
    section = report.get("per_device")
    if not isinstance(section, dict) or not section.get("agents"):
        return []
    rows = []
    for agent, e in section["agents"].items():
        rows.append([agent, e["rounds"], mb(e["train_up_wire"]), mb(e["eval_up_wire"]), mb(e["up_wire"]),
                     mb(e["train_down_wire"]), mb(e["eval_down_wire"]), mb(e["down_wire"]),
                     f"{e['up_link_s']:.1f}", f"{e['down_link_s']:.1f}", f"{e['max_up_link_s']:.1f}",
                     _per_image(e), _seconds(e.get("compute_s")), _seconds(e.get("round_s")), mb(e.get("peak_rss_bytes"), 0),
                     _share(e)])
    header = ["Agent", "Rounds", "Train MB up", "Eval MB up", "MB up", "Train MB down", "Eval MB down", "MB down",
              "Up s", "Down s", "Slowest up s", "Train kB up / image", "Compute s", "Round s", "Peak RSS MB", "Of memory"]
    lines = ["## Per device", "", *table(header, rows, right_from=1), "",
             "Per round: the mean over the rounds each agent took part in, every message it sent (up) or was sent "
             "(down) as the server's connection saw it on the wire, training's and evaluation's apart and together. "
             f"Seconds on the link: wire bytes x 8 / the link's rate, at {_target_text(section)}. Slowest up s: the "
             "agent's slowest round. Train kB up / image: the training upload per image of the agent's data, which "
             "scales with a device's data where the method uploads per image (feature maps, activations), not where "
             "it uploads a model. Compute s: the agent's own compute per round on this machine (training, and "
             "extracting where the method uploads maps); Round s: its whole round, waiting for the server included. "
             "Peak RSS: the agent's highest per-round peak.", ""]
    lines += [f"- **Memory warning**: {w}" for w in section.get("warnings") or []]
    return lines + ([""] if section.get("warnings") else [])


def per_device_lines(report: Mapping[str, Any]) -> list[str]:
    """The console's per-device lines at the end of a run: the busiest agent's bytes per round
    and their seconds on the link, the highest peak memory, then every memory warning."""
    section = report.get("per_device")
    if not isinstance(section, dict) or not section.get("agents"):
        return []
    entries = section["agents"]
    up = max(entries, key=lambda a: entries[a]["up_wire"])
    down = max(entries, key=lambda a: entries[a]["down_wire"])
    e, d = entries[up], entries[down]
    lines = [f"per device, per round at {section['link_mbit']:g} Mbit/s: up {mb(e['up_wire'])} MB "
             f"(training {mb(e['train_up_wire'])} + evaluation {mb(e['eval_up_wire'])}) = {e['up_link_s']:.1f} s "
             f"({up}, the most of any agent); down {mb(d['down_wire'])} MB (training {mb(d['train_down_wire'])} + "
             f"evaluation {mb(d['eval_down_wire'])}) = {d['down_link_s']:.1f} s ({down})"]
    peaks = {a: x for a, x in entries.items() if x.get("peak_rss_bytes") is not None}
    if peaks:
        top = max(peaks, key=lambda a: peaks[a]["peak_rss_bytes"])
        p = peaks[top]
        of = "" if p.get("memory_share") is None else f", {p['memory_share']:.0%} of {mb(p['memory_bytes'], 0)} MB"
        lines.append(f"per device, peak RSS: {mb(p['peak_rss_bytes'], 0)} MB ({top}{of})")
    lines += [f"warning: {w}" for w in section.get("warnings") or []]
    return lines


def comparison_cells(report: Mapping[str, Any]) -> list[str]:
    """The cells of :data:`COMPARISON_HEADER` for one run (the busiest agent's figures)."""
    section = report.get("per_device")
    if not isinstance(section, dict) or not section.get("agents"):
        return [DASH] * len(COMPARISON_HEADER)
    entries = list(section["agents"].values())
    busiest = max(entries, key=lambda e: e["up_wire"])
    peaks = [e["peak_rss_bytes"] for e in entries if e.get("peak_rss_bytes") is not None]
    warned = " (warning)" if section.get("warnings") else ""
    return [mb(busiest["up_wire"]), f"{busiest['up_link_s']:.1f} at {section['link_mbit']:g} Mbit/s",
            (mb(max(peaks), 0) if peaks else DASH) + warned]
