"""Helpers for the live-view tests: scraping a /metrics page with prometheus_client's text
parser, and a federation over a real broker whose round 1 the test holds open."""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from edge_agent.agent import EdgeAgent
from shared_protocol.transport import MqttTransport

from fedhelpers import agent_config, make_server, server_config

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """Every sample of a /metrics page, keyed by (sample name, labels)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample named ``name`` whose labels include ``labels``."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class HeldFederation:
    """A server and two agents in threads over a real broker, every endpoint on a free
    loopback port. The agents share a compute lock the test holds at first: they block in
    their welcome, so round 1 stays open (with both agents as participants) until the test
    has looked at it, whatever the machine's speed."""

    def __init__(self, tmp_path: Path, broker_url: str, run_id: str) -> None:
        cfg = replace(server_config(tmp_path, run_id=run_id, rounds=2), broker_url=broker_url, metrics_address="127.0.0.1:0")
        self.server = make_server(cfg, MqttTransport(replace(cfg.transport_config(), connect_timeout_s=10)))
        self.lock = threading.Lock()
        self.lock.acquire()
        self.agents = [EdgeAgent(replace(agent_config(run_id, i, 2, broker_url=broker_url), metrics_address="127.0.0.1:0"),
                                 compute_lock=self.lock) for i in range(2)]
        self.result: dict = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def start(self) -> "HeldFederation":
        def serve() -> None:
            try:
                self.result.update(self.server.run())
            except BaseException as exc:  # re-raised by join()
                self.errors.append(exc)

        self.threads = [threading.Thread(target=serve, daemon=True)]
        self.threads += [threading.Thread(target=a.run, daemon=True) for a in self.agents]
        for t in self.threads:
            t.start()
        wait_for(lambda: self.server.metrics.url is not None and all(a.metrics.url for a in self.agents), 60, "the endpoints")
        return self

    def release(self) -> None:
        self.lock.release()

    def join(self, timeout_s: float = 400) -> dict:
        self.threads[0].join(timeout_s)
        assert not self.threads[0].is_alive(), "server did not finish in time"
        if self.errors:
            raise self.errors[0]
        return self.result

    def close(self) -> None:
        if self.lock.locked():
            self.lock.release()
        for a in self.agents:
            a.stop()
        for t in self.threads[1:]:
            t.join(30)
        self.server.close_metrics()
        for a in self.agents:
            a.close_metrics()
