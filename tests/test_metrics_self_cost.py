"""What watching costs, measured by the endpoint itself (shared_protocol/metrics_http.py's
SelfCost): the calling thread's CPU seconds of each request and of each metrics hook, served
as edgesplit_metrics_cpu_seconds_total and edgesplit_metrics_requests_total. Without a
broker: the accumulator by hand, and a real endpoint on a free loopback port."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from shared_protocol.metrics_endpoint import MetricsAddress, MetricsEndpointConfig
from shared_protocol.metrics_http import MetricsServer, Page, SelfCost, timed_update

from metricshelpers import scrape, value


def _burn(seconds: float) -> None:
    """Busy CPU in this thread for about ``seconds`` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_self_cost_counts_this_threads_cpu_not_sleep_nor_other_threads() -> None:
    cost = SelfCost()
    with cost.measuring("update"):
        _burn(0.05)
    with cost.measuring("update"):
        time.sleep(0.2)  # waiting is no CPU
    busy = threading.Thread(target=_burn, args=(0.1,))
    with cost.measuring("serve"):
        busy.start()  # another thread's CPU is not this section's
        busy.join()
    spent = cost.snapshot()["cpu_s"]
    assert 0.05 <= spent["update"] < 0.05 + 0.05
    assert spent["serve"] < 0.05


def test_a_measurement_inside_another_counts_once_and_unknown_parts_are_refused() -> None:
    cost = SelfCost()
    with cost.measuring("update"):
        _burn(0.03)
        with cost.measuring("update"):
            _burn(0.03)
    assert 0.06 <= cost.snapshot()["cpu_s"]["update"] < 0.06 + 0.04  # not 0.09: the inner one is inside the outer
    with pytest.raises(ValueError, match="serve"):
        with cost.measuring("scrape"):
            pass


def test_timed_update_counts_a_hook_as_update() -> None:
    class Hooks:
        def __init__(self) -> None:
            self.self_cost = SelfCost()
            self.calls = 0

        @timed_update
        def on_round(self, seconds: float) -> int:
            self.calls += 1
            _burn(seconds)
            return self.calls

    hooks = Hooks()
    assert hooks.on_round(0.02) == 1 and hooks.on_round(0.02) == 2
    snap = hooks.self_cost.snapshot()
    assert snap["cpu_s"]["update"] >= 0.04 and snap["cpu_s"]["serve"] == 0.0 and snap["requests"] == 0


def test_the_endpoint_serves_its_own_cost_and_counts_every_request() -> None:
    registry = CollectorRegistry()
    cost = SelfCost()
    registry.register(cost.collector({"run": "r", "agent": "agent-0"}))

    def slow_page() -> tuple[bytes, str]:
        _burn(0.05)  # a page that costs CPU to render
        return b"ok", "text/plain"

    pages: dict[str, Page] = {"/slow": slow_page}
    server = MetricsServer(MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)), registry, pages=pages, self_cost=cost).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        for _ in range(3):
            assert urllib.request.urlopen(base + "/slow", timeout=10).read() == b"ok"
        labels = {"run": "r", "agent": "agent-0"}
        # A request's CPU is counted when its connection closes, which may come just after the
        # client has read the page: scrape until all three are in (or the deadline says they never are).
        scrapes, deadline = 0, time.monotonic() + 10
        while True:
            samples = scrape(base + "/metrics")
            scrapes += 1
            served = value(samples, "edgesplit_metrics_cpu_seconds_total", part="serve", **labels)
            if served >= 0.15 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        server.close()
    # Three pages and every scrape (each counted as it starts).
    assert value(samples, "edgesplit_metrics_requests_total", **labels) == 3 + scrapes
    assert served >= 0.15
    assert value(samples, "edgesplit_metrics_cpu_seconds_total", part="update", **labels) == 0.0
