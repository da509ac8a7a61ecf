"""Figures quoted outside docs/results.md match the bench JSON they name: a re-measured bench
that changes a figure fails here until the prose says the new one (docs/results.md itself is
checked by the renderer's tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_the_readme_quotes_no_measured_figure_outside_its_generated_table() -> None:
    # Figures live in generated text (the table of methods, docs/results.md), where a re-measured
    # bench changes them; README's prose points there instead of quoting them.
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- The methods: rendered", "<!-- end of the methods -->"
    prose = readme[:readme.index(begin)] + readme[readme.index(end):]
    percent = r"\d+(?:\.\d+)?\s?%"
    assert re.findall(percent, "the server model reaches 78.9% / 73.4 % global") == ["78.9%", "73.4 %"]
    assert re.findall(percent, prose) == []


def _text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def _signed(points: float) -> str:
    """A difference in points as the docs write it: +1.0, −8.4 (a true minus sign)."""
    return f"{round(points, 1) + 0.0:+.1f}".replace("-", "−")


def _row(text: str, first_cell: str, columns: int) -> list[str]:
    """The cells of the one table row of ``text`` with ``columns`` cells, the first ``first_cell``."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]
    rows = [cells for cells in rows if len(cells) == columns]
    assert len(rows) == 1, f"one row of {columns} cells starting with {first_cell!r} expected, found {len(rows)}"
    return rows[0]


def _near(quoted: str, value: float) -> bool:
    """A figure quoted to one decimal is ``value`` rounded (either way at an exact half)."""
    return abs(float(quoted.rstrip("%")) - value) <= 0.05 + 1e-9


def _table_after(page: str, header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header line is ``header``."""
    lines = page.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


