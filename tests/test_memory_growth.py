"""An agent's per-round peak RSS that grows three rounds in a row is named in the server's
run report (report.json's ``memory_warnings``, summary.md) and log, by the agent's rule."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cloud_server.recorder import RunRecorder
from cloud_server.records import AgentRoundRecord, RoundRecord, RunReport, ServerInfo, memory_growth_warnings
from cloud_server.report import validate_report
from cloud_server.report.markdown import summary_md
from shared_protocol.memory_growth import growing_since

MB = 1_000_000


def _round(number: int, peaks_mb: dict[str, float]) -> RoundRecord:
    return RoundRecord(round=number, status="ok", participants=sorted(peaks_mb), completed=sorted(peaks_mb),
                       per_agent={a: AgentRoundRecord(samples=1, peak_rss_bytes=int(p * MB)) for a, p in peaks_mb.items()})


def test_growth_counts_rises_of_more_than_one_percent_in_a_row() -> None:
    assert growing_since([315, 328, 339, 352]) == 0
    assert growing_since([300, 315, 328, 339, 352]) == 0
    assert growing_since([352, 315, 328, 339, 352]) == 1
    assert growing_since([315, 328, 339]) is None  # two rises
    assert growing_since([315, 328, 339, 341]) is None  # the last rise is under 1 %
    assert growing_since([315, 318, 321, 324]) is None  # under 1 % each: noise, not growth
    assert growing_since([]) is None and growing_since([5]) is None


def test_the_report_names_each_run_of_growth_per_agent() -> None:
    peaks_mb = [315, 328, 339, 352, 367, 378, 389, 390, 390, 390]  # rises for seven rounds, then flat
    rounds = [_round(i + 1, {"pi-zero": p, "laptop": 964}) for i, p in enumerate(peaks_mb)]
    (warning,) = memory_growth_warnings(rounds)
    assert warning["agent"] == "pi-zero" and (warning["first_round"], warning["last_round"]) == (1, 7)
    assert warning["peak_rss_bytes"] == [p * MB for p in peaks_mb[:7]]
    assert warning["message"].startswith("agent pi-zero: peak RSS grew 6 rounds in a row (rounds 1-7: 315 -> 328")
    # A lifetime peak (simulated agents sharing one process) rises by nature: never read as growth.
    shared = [RoundRecord(round=i + 1, status="ok", per_agent={"agent-4": AgentRoundRecord(
        samples=1, peak_rss_bytes=int(p * MB), peak_rss_per_round=False)}) for i, p in enumerate(peaks_mb)]
    assert memory_growth_warnings(shared) == []
    assert RoundRecord.from_json(shared[0].to_json(), "round").per_agent["agent-4"].peak_rss_per_round is False
    flat = [_round(i + 1, {"pi-zero": 340 + (i % 2), "laptop": 964}) for i in range(10)]
    assert memory_growth_warnings(flat) == []
    # Two separate runs of growth, and an agent missing from a round (its series skips it).
    twice = [315, 328, 339, 352, 300, 310, 320, 330, 340]
    rounds = [_round(i + 1, {"pi-zero": p} if i != 6 else {}) for i, p in enumerate(twice)]
    assert [(w["first_round"], w["last_round"]) for w in memory_growth_warnings(rounds)] == [(1, 4), (5, 9)]


def test_the_recorder_logs_it_and_the_summary_shows_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recorder = RunRecorder(tmp_path, total_rounds=5)
    recorder.begin(RunReport(edgesplit_version="test", run_id="grow", method="fedgkt", config={},
                             server=ServerInfo(device="cpu", cpu_model="x", torch="-", hostname="h"),
                             models={"edge": None, "server": None}))
    logged = []
    with caplog.at_level(logging.WARNING, logger="cloud_server"):
        for i, peak in enumerate([315, 328, 339, 352, 367], start=1):
            recorder.add_round(_round(i, {"pi-zero": peak}))
            logged.append(sum("peak RSS grew" in r.getMessage() for r in caplog.records))
    assert logged == [0, 0, 0, 1, 2]  # from the third rise on, each round that extends it
    report = recorder.report.to_json()
    validate_report(report)
    assert [(w["first_round"], w["last_round"]) for w in report["memory_warnings"]] == [(1, 5)]
    assert "**Memory warning**: agent pi-zero: peak RSS grew 4 rounds in a row" in summary_md(report)
