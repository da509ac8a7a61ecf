"""A method's own round figures (``record["method"]``, ServerMethod.round_report) in the
run report: validated as a dict, and shown in summary.md whatever the method."""

from __future__ import annotations

import copy

import pytest

from cloud_server.report import ReportError, validate_report
from cloud_server.report.markdown import summary_md

from test_report import make_report


def _with_figures() -> dict:
    report = make_report()
    report["rounds"][0]["method"] = {
        "threshold": 0.95, "agents_used": 2, "fedkd_bytes": 61234.7, "note": "warm-up", "flag": True, "missing": None,
        "ranks": {"conv1.weight": {"matrix": "16x144", "down": 5, "up_min": 4}, "fc.weight": {"matrix": "10x64", "down": 0}},
    }
    # Round 2 failed its quorum and has no figures; round 3 adds a key and a dict of scalars.
    report["rounds"][2]["method"] = {
        "threshold": 0.98, "agents_used": 2, "fedkd_bytes": 70000.0, "sync_bytes": 43368,
        "ranks": {"conv1.weight": {"matrix": "16x144", "down": 7, "up_min": 6, "up_max": 8}},
        "per_layer_share": {"conv1.weight": 0.25, "fc.weight": 0.125},
        "deep": {"a": {"b": {"c": 1}}},  # not a table: stays in report.json only
        "series": [1, 2, 3],
    }
    return report


def test_method_figures_are_shown_for_any_method() -> None:
    report = _with_figures()
    validate_report(report)
    text = summary_md(report)
    assert "## Method figures per round" in text
    # Scalars of every round that has figures, the union of their keys, in first-seen order.
    assert "| Round | threshold | agents_used | fedkd_bytes | note | flag | missing | sync_bytes |" in text
    assert "| 1 | 0.95 | 2 | 61,235 | warm-up | True | — | — |" in text
    assert "| 3 | 0.98 | 2 | 70,000 | — | — | — | 43,368 |" in text
    assert "\n| 2 | " not in text.split("## Method figures per round")[1].split("## Agents")[0]
    # The last round's dicts: of dicts of scalars (rows x columns), of scalars (key, value).
    assert "`ranks` in round 3:" in text
    assert "| ranks | matrix | down | up_min | up_max |" in text and "| conv1.weight | 16x144 | 7 | 6 | 8 |" in text
    assert "fc.weight | 10x64" not in text  # round 1's ranks are not the last round's
    assert "| per_layer_share | value |" in text and "| fc.weight | 0.125 |" in text
    assert "`deep`" not in text and "series" not in text


def test_reports_without_method_figures_render_as_before() -> None:
    plain = make_report()
    text = summary_md(plain)
    assert "Method figures" not in text
    empty = copy.deepcopy(plain)
    empty["rounds"][0]["method"] = {}
    validate_report(empty)
    assert summary_md(empty) == text


def test_method_figures_must_be_a_dict() -> None:
    report = make_report()
    report["rounds"][0]["method"] = [0.95, 0.98]
    with pytest.raises(ReportError, match=r"rounds\[0\] \(round 1\)\.method: expected a dict"):
        validate_report(report)
