"""The HTTP side of a metrics endpoint: ``/metrics`` in Prometheus' text format from a
``prometheus_client`` registry, plus whatever read-only pages the owner adds (the
server's status page). Imported only when metrics are on.

One small threaded ``http.server``: GET and HEAD only, a socket timeout on every
request, basic auth (constant-time comparison) when a password is configured, TLS when
a certificate is. Serving never touches the caller's state: pages are functions that
read snapshots their owner publishes.

What watching costs is measured, not guessed: :class:`SelfCost` adds up the CPU seconds
(``time.thread_time``, the calling thread's own) of every request, in the request's
thread from accept to the last byte written, and of the owner's metric updates (its hooks,
:func:`timed_update`), and the endpoint serves them as
``edgesplit_metrics_cpu_seconds_total{part="serve"|"update"}`` with
``edgesplit_metrics_requests_total``. Their sum is the CPU the metrics take from the
process; it bounds the time they can add to a round (bench/micro/test_metrics_overhead.py).
"""

from __future__ import annotations

import base64
import functools
import hmac
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics_endpoint import MetricsEndpointConfig, MetricsEndpointError
from .tomlio import read_secret

__all__ = ["MetricsServer", "Page", "SelfCost", "timed_update"]

log = logging.getLogger("edgesplit.metrics")

#: A page: () -> (body, content type).
Page = Callable[[], tuple[bytes, str]]


class SelfCost:
    """CPU seconds the metrics code spent, by part: ``serve`` (requests) and ``update`` (the
    owner's hooks). Thread CPU time, so other threads' and processes' work never counts; a
    measurement inside another of the same thread counts once (the outer one)."""

    PARTS = ("serve", "update")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cpu_s = dict.fromkeys(self.PARTS, 0.0)
        self._requests = 0
        self._local = threading.local()

    @contextmanager
    def measuring(self, part: str) -> Iterator[None]:
        if part not in self._cpu_s:
            raise ValueError(f"SelfCost part must be one of {self.PARTS}, got {part!r}")
        if getattr(self._local, "inside", False):
            yield
            return
        self._local.inside = True
        started = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - started
            self._local.inside = False
            with self._lock:
                self._cpu_s[part] += spent

    def count_request(self) -> None:
        with self._lock:
            self._requests += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"cpu_s": dict(self._cpu_s), "requests": self._requests}

    def collector(self, labels: Mapping[str, str]) -> Collector:
        """The two series, with the owner's labels (run, and method or agent)."""
        return _SelfCostCollector(self, dict(labels))


class _SelfCostCollector(Collector):
    def __init__(self, cost: SelfCost, labels: dict[str, str]) -> None:
        self.cost, self.labels = cost, labels

    def collect(self) -> Iterator[Metric]:
        snap = self.cost.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        cpu = CounterMetricFamily("edgesplit_metrics_cpu_seconds", "CPU seconds this process spent on its metrics: part serve "
                                  "(HTTP requests, in their threads) or update (metric updates in the hooks).",
                                  labels=[*names, "part"])
        for part, seconds in snap["cpu_s"].items():
            cpu.add_metric([*values, part], seconds)
        yield cpu
        requests = CounterMetricFamily("edgesplit_metrics_requests", "HTTP requests this endpoint served (any page, any "
                                       "status).", labels=names)
        requests.add_metric(values, snap["requests"])
        yield requests


F = TypeVar("F", bound=Callable[..., Any])


def timed_update(method: F) -> F:
    """A metrics hook whose CPU time counts as ``update`` in its owner's ``self_cost``."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.self_cost.measuring("update"):
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


class MetricsServer:
    REQUEST_TIMEOUT_S = 10.0

    def __init__(self, config: MetricsEndpointConfig, registry: CollectorRegistry, pages: dict[str, Page] | None = None,
                 self_cost: SelfCost | None = None) -> None:
        self.config = config
        self.registry = registry
        self.self_cost = self_cost if self_cost is not None else SelfCost()
        self.pages: dict[str, Page] = {"/metrics": self._metrics, **(pages or {})}
        self._password = read_secret(config.password_file) if config.password_file else None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _metrics(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the metrics endpoint is not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.config.address.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.config.scheme}://{host}:{self.port}/"

    def start(self) -> "MetricsServer":
        handler = _handler(self)
        address = (self.config.address.host, self.config.address.port)
        try:
            server_class = type("MetricsHTTPServer", (_QuietServer,), {"address_family": _family(address[0]),
                                                                       "self_cost": self.self_cost})
            httpd = server_class(address, handler)
        except OSError as exc:
            raise MetricsEndpointError(
                f"cannot serve metrics on {self.config.address}: {exc.strerror or exc}; pick another address with "
                f"--metrics or [{self.config.table}] metrics_address"
            ) from None
        httpd.daemon_threads = True
        if self.config.cert_file:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                context.load_cert_chain(self.config.cert_file, self.config.key_file)
            except (OSError, ssl.SSLError) as exc:
                httpd.server_close()
                raise MetricsEndpointError(
                    f"cannot load [{self.config.table}] metrics_cert_file {self.config.cert_file} / metrics_key_file "
                    f"{self.config.key_file}: {exc}"
                ) from None
            # The handshake runs in the request's thread, under its timeout (Handler.setup): done
            # at accept, one client that never speaks TLS would stall the accept loop.
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics on %smetrics%s", self.url, " (status page at /)" if "/" in self.pages else "")
        return self

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def authorised(self, header: str | None) -> bool:
        if self._password is None:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        return hmac.compare_digest(user.encode(), self.config.username.encode()) & hmac.compare_digest(
            password.encode(), self._password.encode())


class _QuietServer(ThreadingHTTPServer):
    self_cost: SelfCost

    def process_request(self, request: Any, client_address: Any) -> None:
        # Starting the request's thread is the accept thread's work for the request.
        with self.self_cost.measuring("serve"):
            super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # The whole request in its own thread: the TLS handshake, parsing, the page, the write, the close.
        self.self_cost.count_request()
        with self.self_cost.measuring("serve"):
            super().process_request_thread(request, client_address)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that drops the connection or fails the TLS handshake is the client's problem.
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = server.REQUEST_TIMEOUT_S  # a client that stalls mid-request is dropped
        server_version = "edgesplit-metrics"

        def setup(self) -> None:
            self.request.settimeout(self.timeout)
            if isinstance(self.request, ssl.SSLSocket):
                self.request.do_handshake()
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._serve(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            if not server.authorised(self.headers.get("Authorization")):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="edgesplit"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            page = server.pages.get(self.path.split("?", 1)[0])
            if page is None:
                self.send_error(404, "not found", f"pages: {', '.join(sorted(server.pages))}")
                return
            content, content_type = page()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(content)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if body:
                self.wfile.write(content)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("%s %s", self.address_string(), format % args)

    return Handler
