"""The console line while the server works long on a round (cloud_server/phase_ticker.py)."""

from __future__ import annotations

import time

import pytest

from cloud_server.config import ServerConfig
from cloud_server.phase_ticker import PhaseTicker
from cloud_server.rounds import HookClock


def test_a_line_while_the_server_works_long_and_none_after() -> None:
    clock, lines = HookClock(), []
    ticker = PhaseTicker(clock, 6, 0.05, lines.append).start()
    try:
        with clock.timing(3, "complete"):
            deadline = time.monotonic() + 10
            while len(lines) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert len(lines) >= 2
        assert all(line.startswith("round 3/6: server working on the round's uploads") and line.endswith("s so far")
                   for line in lines)
        with clock.timing(3, "end_round"):  # the scoring phase inside it names itself, and the outer one comes back
            with clock.phase(3, "scoring"):
                assert clock.current()[:2] == (3, "scoring")
            assert clock.current()[:2] == (3, "end_round")
        assert clock.current() is None
        printed = len(lines)
        time.sleep(0.3)
        assert len(lines) == printed  # between works: silent
    finally:
        ticker.stop()
    assert clock.take(3).keys() == {"complete", "end_round"}  # a phase is not a timed hook


def test_short_work_and_interval_zero_print_nothing() -> None:
    clock, lines = HookClock(), []
    ticker = PhaseTicker(clock, 2, 5.0, lines.append).start()
    with clock.timing(1, "complete"):
        time.sleep(0.2)
    ticker.stop()
    off = PhaseTicker(clock, 2, 0.0, lines.append).start()
    assert off._thread is None
    off.stop()
    assert lines == []
    with pytest.raises(ValueError, match="progress_interval_s"):
        ServerConfig(progress_interval_s=-1)
