"""The status page in a real browser: headless Chromium (Debian's ``chromium``) opens the
server's page during a 2-agent, 2-round run over a real mosquitto, finds the per-agent
table with every agent and a round number that advances, sees the page's own refresh
script update it, and saves screenshots under the test's tmp dir.

Chromium is driven through its own command line (``--dump-dom``, ``--screenshot``): no
driver, nothing downloaded. ``make test`` installs it with the other system packages
(Makefile ``APT_PACKAGES``); run alone, the test installs it the same way
(deploy/ensure_system_deps.sh, as root) and skips, saying why, only where it cannot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fedhelpers import ROOT
from metricshelpers import HeldFederation, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow]

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = _find_browser()
    if found is None:
        result = subprocess.run(["bash", str(ROOT / "deploy" / "ensure_system_deps.sh"), "chromium"], capture_output=True,
                                text=True, timeout=900)
        found = _find_browser()
        if found is None:
            pytest.skip("needs headless Chromium (Debian package chromium), which could not be installed here: "
                        + (result.stderr or result.stdout).strip()[-400:])
    return found


def browse(chromium: str, tmp_path: Path, url: str, *, screenshot: Path | None = None, wait_ms: int = 5000) -> str:
    """The page's DOM after ``wait_ms`` of (virtual) time: the page's own script has run."""
    args = [chromium, "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--virtual-time-budget={wait_ms}", "--window-size=1280,900"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    if screenshot is not None:
        result = subprocess.run([*args, f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and screenshot.stat().st_size > 0, result.stderr[-2000:]
    result = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return result.stdout


class AgentTable(HTMLParser):
    """The rows of ``<table id="agents">``: agent id -> its cells' text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self._in_table = False
        self._row: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table" and a.get("id") == "agents":
            self._in_table = True
        elif self._in_table and tag == "tr" and a.get("data-agent"):
            self._row = a["data-agent"]
            self.rows[self._row] = []
        elif self._row is not None and tag == "td":
            self.rows[self._row].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self.rows[self._row]:
            self.rows[self._row][-1] += data.strip()


def page_facts(dom: str) -> tuple[int, dict[str, list[str]], int]:
    """(the round shown, the agent table's rows, how often the page's script refreshed it)."""
    shown = re.search(r'id="round">(\d+)<', dom)
    refreshes = re.search(r'<body[^>]*data-refreshes="(\d+)"', dom)
    assert shown is not None and refreshes is not None, dom[:3000]
    table = AgentTable()
    table.feed(dom)
    return int(shown.group(1)), table.rows, int(refreshes.group(1))


def test_status_page_in_headless_chromium_during_a_run(chromium: str, mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fed = HeldFederation(tmp_path, mosquitto.url, "browser").start()
    try:
        page = fed.server.metrics.url

        def status() -> dict:
            with urllib.request.urlopen(page + "status.json", timeout=10) as response:
                return json.loads(response.read())

        # Round 1 is open and held (the agents wait on the lock): the page must show it.
        wait_for(lambda: status()["round_in_progress"] == 1 and len(status()["agents"]) == 2, 120, "round 1 with both agents")
        first = tmp_path / "status-round1.png"
        round_1, rows_1, refreshes_1 = page_facts(browse(chromium, tmp_path, page, screenshot=first))
        assert round_1 == 1
        assert sorted(rows_1) == ["agent-0", "agent-1"]
        assert all(cells[1] == "online" for cells in rows_1.values()), rows_1
        assert refreshes_1 >= 1  # the inline script fetched /live and re-rendered in the browser
        fed.release()
        # Later: round 2 in progress, or the run over (the page then shows the last round).
        wait_for(lambda: status()["completed_round"] >= 1 and (status()["round_in_progress"] >= 2 or status()["status"] != "running"),
                 400, "round 1 to close")
        second = tmp_path / "status-later.png"
        round_2, rows_2, _ = page_facts(browse(chromium, tmp_path, page, screenshot=second))
        fed.join()
        final = tmp_path / "status-final.png"
        round_3, rows_3, _ = page_facts(browse(chromium, tmp_path, page, screenshot=final))
    finally:
        fed.close()
    assert round_1 < round_2 <= round_3 == 2
    assert sorted(rows_2) == sorted(rows_3) == ["agent-0", "agent-1"]
    # After the run every agent's row carries its last round's costs (last round, compute seconds, idle share).
    for cells in rows_3.values():
        assert cells[4] == "2" and float(cells[5]) > 0 and cells[9].endswith("%"), cells
    for shot in (first, second, final):
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_shows_the_servers_phase_while_it_works_and_says_when_the_run_ended(  # type: ignore[no-untyped-def]
        chromium: str, mosquitto, tmp_path: Path) -> None:
    import threading

    fed = HeldFederation(tmp_path, mosquitto.url, "phase")
    method = fed.server.method
    working, go_on = threading.Event(), threading.Event()
    complete = method.complete

    def held_complete(*args, **kwargs):  # type: ignore[no-untyped-def]
        working.set()  # the coordinator's thread is in the method's work on round 1 ...
        go_on.wait(120)  # ... and stays there until the page was looked at
        return complete(*args, **kwargs)

    method.complete = held_complete
    fed.start()
    try:
        page = fed.server.metrics.url
        fed.release()
        wait_for(working.is_set, 300, "the server to work on round 1's uploads")
        shot = tmp_path / "status-server-working.png"
        during = browse(chromium, tmp_path, page, screenshot=shot)
        go_on.set()
        fed.join()
        fed.server.metrics.linger(120)
        after = browse(chromium, tmp_path, page)
    finally:
        go_on.set()
        fed.close()
    phase = re.search(r'id="server-phase">server: ([^<]+)<', during)
    assert phase is not None, during[:3000]
    assert "round 1" in phase.group(1) and "uploads" in phase.group(1)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r'id="ended">the run has ended \(finished\); this page stays up until \d\d:\d\d:\d\d: its '
                     r'<a href="summary.md">summary.md</a> and <a href="report.json">report.json</a><', after), after[:3000]
