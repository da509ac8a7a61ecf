"""The HTTP side of a metrics endpoint: ``/metrics`` in Prometheus' text format from a
``prometheus_client`` registry, plus whatever read-only pages the owner adds (the
server's status page). Imported only when metrics are on.

One small threaded ``http.server``: GET and HEAD only, a socket timeout on every
request, basic auth (constant-time comparison) when a password is configured, TLS when
a certificate is. Serving never touches the caller's state: pages are functions that
read snapshots their owner publishes.
"""

from __future__ import annotations

import base64
import hmac
import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .metrics_endpoint import MetricsEndpointConfig, MetricsEndpointError
from .tomlio import read_secret

__all__ = ["MetricsServer", "Page"]

log = logging.getLogger("edgesplit.metrics")

#: A page: () -> (body, content type).
Page = Callable[[], tuple[bytes, str]]


class MetricsServer:
    REQUEST_TIMEOUT_S = 10.0

    def __init__(self, config: MetricsEndpointConfig, registry: CollectorRegistry, pages: dict[str, Page] | None = None) -> None:
        self.config = config
        self.registry = registry
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
            server_class = type("MetricsHTTPServer", (_QuietServer,), {"address_family": _family(address[0])})
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
