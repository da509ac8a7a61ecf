"""Numbers as the report's text shows them, and the per-round series the CSV and the
plots share.

Units: "MB" is 10**6 bytes and "GFLOPs" is 10**9 floating-point operations
(FLOPs = 2 x MACs, forward + backward), everywhere in the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DASH = "—"
MB = 1e6
GFLOP = 1e9
EDGE_PHASES = ("compute", "encode", "network", "idle")


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.2f}%"


def mb(n: float | None, decimals: int = 2) -> str:
    return DASH if n is None else f"{n / MB:,.{decimals}f}"


def gflops(flops: float | None) -> str:
    """GFLOPs readable from 0.0001 (one small image) to millions (a whole run)."""
    if flops is None:
        return DASH
    g = flops / GFLOP
    if g == 0:
        return "0"
    if g >= 100:
        return f"{g:,.0f}"
    if g >= 1:
        return f"{g:.2f}"
    return f"{g:.3g}"


def seconds(s: float | None) -> str:
    return DASH if s is None else f"{s:.1f}"


def duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def ratio(big: float | None, small: float | None) -> str:
    if big is None or small is None or small <= 0:
        return DASH
    return f"{big / small:.1f}×"


def _cell(value: Any) -> str:
    # A "|" inside a cell (a CPU model string, an agent id) would split the row.
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def figure_cell(value: Any) -> str:
    """One of a method's own figures in a table cell: grouped ints, 4 significant digits."""
    if value is None:
        return DASH
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return describe(value)


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def format_summary_line(round_record: Mapping[str, Any], total_rounds: int) -> str:
    """One status line per round for the console, e.g.

    ``round 3/8  global acc 81.20%  (local 84.00%, edge 56.10%)  up 12.4 MB  down 0.3 MB  2/2 agents  41.2 s``

    ``global``: the deployed model(s) on the run's global test set (the headline); ``local``:
    on the agents' own shards; ``edge``: the models left on the devices where they differ
    (global set). Bytes are what the server's connection carried on the wire for the round.
    """
    acc = round_record.get("accuracy")
    local = round_record.get("local_accuracy")
    edge = round_record.get("edge_accuracy")
    wire = round_record.get("bytes", {})
    extra = [f"local {pct(local)}"] + ([f"edge {pct(edge)}"] if edge is not None else [])
    line = (
        f"round {round_record['round']}/{total_rounds}"
        f"  global acc {pct(acc)}  ({', '.join(extra)})"
        f"  up {mb(wire.get('up_wire', 0), 1)} MB  down {mb(wire.get('down_wire', 0), 1)} MB"
        f"  {len(round_record.get('completed', []))}/{len(round_record.get('participants', []))} agents"
        f"  {seconds(round_record.get('time_s', {}).get('round'))} s"
    )
    if round_record.get("status", "ok") != "ok":
        line += f"  [{round_record['status']}]"
    robustness = round_record.get("robustness") or {}
    notes = []
    if robustness.get("refused"):
        notes.append(f"refused {', '.join(robustness['refused'])}")
    if robustness.get("clipped"):
        notes.append(f"clipped {', '.join(robustness['clipped'])}")
    if robustness.get("skipped_steps"):
        notes.append(f"skipped steps {', '.join(robustness['skipped_steps'])}")
    if robustness.get("quarantine_excluded"):
        notes.append(f"quarantined {', '.join(robustness['quarantine_excluded'])}")
    if notes or round_record.get("warnings"):
        line += f"  [warning: {'; '.join(notes) or round_record['warnings'][0]}]"
    return line


# --------------------------------------------------------------------------- #
# derived series
# --------------------------------------------------------------------------- #


def cumulative_wire_mb(rounds: Sequence[Mapping[str, Any]]) -> np.ndarray:
    per_round = np.array([r["bytes"]["up_wire"] + r["bytes"]["down_wire"] for r in rounds], dtype=np.float64)
    return np.cumsum(per_round) / MB  # (R,)


def series(rounds: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """A per-round value as float64 with NaN where unknown (matplotlib leaves gaps at NaN)."""
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rounds], dtype=np.float64)

