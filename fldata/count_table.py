"""Class-count tables (the ``table`` scheme's CSV): one row per agent, one column per class."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Final

import numpy as np

# Header cells that mark a leading agent-label column in a count table.
_AGENT_COLUMN_NAMES: Final[frozenset[str]] = frozenset({"", "agent", "client", "agent_index", "client_id", "id", "k"})


def read_count_table(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a class-count CSV into an ``int64`` array ``(num_agents, num_classes)``.

    One row per agent, one column per class, non-negative integers. Blank lines
    and lines starting with ``#`` are skipped. A first row that is not all
    integers is a header (e.g. class names); if its first cell is empty or one
    of ``agent``, ``client``, ``agent_index``, ``client_id``, ``id``, ``k``, the
    first column holds agent labels and is ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"count table {path} not found")
    with path.open(newline="") as f:
        rows = [
            (line_no, [cell.strip() for cell in row])
            for line_no, row in enumerate(csv.reader(f), start=1)
            if row and any(cell.strip() for cell in row) and not row[0].lstrip().startswith("#")
        ]
    if not rows:
        raise ValueError(f"count table {path} is empty")
    skip_first_column = False
    if not all(_is_int(cell) for cell in rows[0][1]):
        skip_first_column = rows[0][1][0].lower() in _AGENT_COLUMN_NAMES
        rows = rows[1:]
        if not rows:
            raise ValueError(f"count table {path} has a header but no rows")
    table: list[list[int]] = []
    for line_no, cells in rows:
        if skip_first_column:
            cells = cells[1:]
        if not all(_is_int(cell) for cell in cells):
            raise ValueError(f"{path}:{line_no}: expected integer class counts, got {cells}")
        values = [int(cell) for cell in cells]
        if any(v < 0 for v in values):
            raise ValueError(f"{path}:{line_no}: class counts must be >= 0, got {values}")
        if table and len(values) != len(table[0]):
            raise ValueError(f"{path}:{line_no}: expected {len(table[0])} columns, got {len(values)}")
        table.append(values)
    if not table[0]:
        raise ValueError(f"count table {path} has no class columns")
    return np.asarray(table, dtype=np.int64)


def _is_int(cell: str) -> bool:
    try:
        int(cell)
    except ValueError:
        return False
    return True
