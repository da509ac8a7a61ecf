"""The status page (``/`` on the metrics address): one self-contained HTML page rendered
from a :class:`~cloud_server.metrics.LiveState`. No external assets (it works offline),
no framework: the curves are inline SVG, and a few lines of inline script fetch ``/live``
(the page's changing part) every ``REFRESH_S`` seconds; without script a meta refresh
reloads the whole page. Read-only: the page has no forms and the server takes only GET.
"""

from __future__ import annotations

import math
import time
from html import escape
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .live_state import LiveState, RoundPoint

__all__ = ["render_page", "fragment", "REFRESH_S"]

REFRESH_S = 2

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse;font-size:.9em;background:#fff}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right} th{background:#eee} td:first-child,th:first-child{text-align:left}
.on{color:#080;font-weight:600}.off{color:#b00;font-weight:600}.muted{color:#777}
.charts{display:flex;flex-wrap:wrap;gap:1.5em} svg{background:#fff;border:1px solid #ccc}
.kv span{margin-right:1.5em}
"""

_SCRIPT = """
(function(){
  var n = 0;
  function tick(){
    fetch('live', {cache: 'no-store'}).then(function(r){ if (!r.ok) throw r.status; return r.text(); })
      .then(function(t){ document.getElementById('live').innerHTML = t; n += 1; document.body.dataset.refreshes = n; })
      .catch(function(){ document.body.dataset.stale = '1'; });
  }
  setInterval(tick, %d);
})();
"""


def _fmt_s(value: Any) -> str:
    return f"{float(value):.1f}" if isinstance(value, (int, float)) else "—"


def _fmt_bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "—"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def _fmt_flops(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "—"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)}"


def _agents_table(state: "LiveState") -> str:
    head = ("agent", "online", "status", "round", "last round", "compute s", "encode s", "network s", "idle s", "idle share",
            "train FLOPs", "peak RSS", "up (wire)", "rejections")
    rows = []
    for agent, view in state.agents.items():
        c = view.costs
        idle, round_s = c.get("idle_s"), c.get("round_s")
        share = idle / (idle + round_s) if isinstance(idle, (int, float)) and isinstance(round_s, (int, float)) and idle + round_s > 0 else None
        online = "dropped" if view.dropped else ("online" if view.online else "offline")
        cells = [
            escape(agent), f'<span class="{"on" if online == "online" else "off"}">{online}</span>', escape(view.status or "—"),
            str(view.round or "—"), str(view.last_round or "—"), _fmt_s(c.get("compute_s")), _fmt_s(c.get("encode_s")),
            _fmt_s(c.get("network_s")), _fmt_s(idle), "—" if share is None else f"{share:.0%}", _fmt_flops(c.get("train_flops")),
            _fmt_bytes(c.get("peak_rss_bytes")), _fmt_bytes(c.get("wire_bytes_up")), str(view.rejections),
        ]
        rows.append(f'<tr data-agent="{escape(agent)}">' + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    if not rows:
        rows.append(f'<tr><td colspan="{len(head)}" class="muted">no agent has joined yet</td></tr>')
    return ('<table id="agents"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _chart(points: list[tuple[float, float]], title: str, x_label: str, width: int = 420, height: int = 240) -> str:
    """An inline SVG line chart of accuracy (0-1, y) against ``x``."""
    left, right, top, bottom = 44, 12, 24, 36
    w, h = width - left - right, height - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{escape(title)}">',
             f'<text x="{left}" y="16" font-size="13">{escape(title)}</text>']
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + h * (1 - frac)
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{frac:.0%}</text>')
    parts.append(f'<text x="{left + w / 2:.1f}" y="{height - 6}" font-size="11" text-anchor="middle">{escape(x_label)}</text>')
    if not points:
        parts.append(f'<text x="{left + w / 2:.1f}" y="{top + h / 2:.1f}" font-size="12" text-anchor="middle" fill="#777">'
                     "no evaluated round yet</text></svg>")
        return "".join(parts)
    xs = [x for x, _ in points]
    x0, x1 = min(0.0, min(xs)), max(xs)
    span = (x1 - x0) or 1.0

    def px(x: float) -> float:
        return left + w * (x - x0) / span

    for tick in (x0, x0 + span / 2, x1):
        label = f"{tick:.0f}" if span >= 4 else f"{tick:.2g}"
        parts.append(f'<text x="{px(tick):.1f}" y="{top + h + 14}" font-size="10" text-anchor="middle">{label}</text>')
    coords = [(px(x), top + h * (1 - max(0.0, min(1.0, y)))) for x, y in points]
    parts.append('<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="'
                 + " ".join(f"{x:.1f},{y:.1f}" for x, y in coords) + '"/>')
    parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#1f77b4"/>' for x, y in coords)
    parts.append("</svg>")
    return "".join(parts)


def _curves(history: "tuple[RoundPoint, ...]") -> str:
    evaluated = [p for p in history if p.accuracy is not None and math.isfinite(p.accuracy)]
    by_round = [(float(p.round), float(p.accuracy)) for p in evaluated]  # type: ignore[arg-type]
    by_bytes = [(p.cumulative_wire_bytes / 1e6, float(p.accuracy)) for p in evaluated]  # type: ignore[arg-type]
    return ('<div class="charts">' + _chart(by_round, "global accuracy vs round", "round")
            + _chart(by_bytes, "global accuracy vs training bytes on the wire", "cumulative MB (wire)") + "</div>")


def fragment(state: "LiveState") -> str:
    """The part of the page that changes: served alone at ``/live`` for the refresh script."""
    current = state.round_in_progress or state.completed_round
    progress = ""
    if state.open_rounds:
        rnd = state.open_rounds[0]
        left = "" if rnd.deadline_left_s is None else f", deadline in {max(0.0, rnd.deadline_left_s):.0f} s"
        waiting = f"; waiting for {escape(', '.join(rnd.waiting_for))}" if rnd.waiting_for else ""
        progress = (f'<span id="progress">{rnd.done} of {rnd.participants} agents done, open {rnd.open_s:.0f} s{left}'
                    f"{waiting}</span>")
    elif state.status != "running":
        progress = '<span id="progress">no round open</span>'
    if state.server_phase:
        progress += f'<span id="server-phase">server: {escape(state.server_phase)}</span>'
    if state.status not in ("running", "starting"):
        until = "" if state.serving_until is None else \
            f"; this page stays up until {time.strftime('%H:%M:%S', time.localtime(state.serving_until))}"
        progress += (f'<span id="ended">the run has ended ({escape(state.status)}){until}: its '
                     '<a href="summary.md">summary.md</a> and <a href="report.json">report.json</a></span>')
    last = state.history[-1] if state.history else None
    acc = "—" if last is None or last.accuracy is None else f"{last.accuracy:.2%} (round {last.round})"
    rejected = sum(state.rejected.values())
    updated = time.strftime("%H:%M:%S", time.localtime(state.updated_at))
    return (
        '<p class="kv">'
        f'<span>status <b id="status">{escape(state.status)}</b></span>'
        f'<span>round <b id="round">{current}</b> of {state.planned_rounds}</span>'
        f"<span>{progress}</span>"
        f'<span>last accuracy <b id="accuracy">{acc}</b></span>'
        f'<span>rejected messages <b>{rejected}</b></span>'
        f'<span class="muted">updated {updated}</span></p>'
        "<h2>Agents</h2>" + _agents_table(state)
        + "<h2>Accuracy</h2>" + _curves(state.history)
    )


def render_page(state: "LiveState") -> str:
    title = f"EdgeSplit run {state.run}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title>"
        f'<noscript><meta http-equiv="refresh" content="{REFRESH_S * 2}"></noscript>'
        f"<style>{_STYLE}</style></head><body data-refreshes=\"0\">"
        f'<h1>{escape(title)}: <span id="method">{escape(state.method)}</span> '
        f'<span class="muted">({escape(state.schedule)})</span></h1>'
        f'<div id="live">{fragment(state)}</div>'
        '<p class="muted">Read-only. Prometheus metrics at <a href="metrics">/metrics</a>, this page as JSON at '
        '<a href="status.json">/status.json</a>.</p>'
        f"<script>{_SCRIPT % (REFRESH_S * 1000)}</script></body></html>\n"
    )
