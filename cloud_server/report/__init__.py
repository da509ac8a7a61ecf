"""Run reports: ``report.json``, ``rounds.csv``, PNG plots and ``summary.md``.

The recorder (:mod:`cloud_server.recorder`) builds the report from typed records
(:mod:`cloud_server.records`) and calls :func:`write_report` after every round;
``cloud-server report RUN_DIR`` calls :func:`render_run_dir`, which reloads
``report.json`` and rewrites the rest. The modules:

- :mod:`.schema`: :func:`validate_report`, the schema of a report read back from disk;
- :mod:`.markdown`: ``summary.md`` and the comparison of several runs;
- :mod:`.plots`: the PNG plots (matplotlib, imported only when drawing);
- :mod:`.files`: writing, reading, ``rounds.csv``;
- :mod:`.formatting`: units and table cells shared by the others.

Units: "MB" is 10**6 bytes and "GFLOPs" is 10**9 floating-point operations
(FLOPs = 2 x MACs, forward + backward), everywhere in the report.
"""

from .files import CSV_COLUMNS, REPORT_FILES, compare_runs, load_report, render_run_dir, write_report
from .formatting import format_summary_line
from .schema import ReportError, validate_report

__all__ = [
    "REPORT_FILES",
    "CSV_COLUMNS",
    "ReportError",
    "validate_report",
    "write_report",
    "load_report",
    "render_run_dir",
    "format_summary_line",
    "compare_runs",
]
