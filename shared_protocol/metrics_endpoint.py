"""Where a metrics endpoint (Prometheus ``/metrics``, the server's status page) listens,
and what it needs before it may listen there.

This module is what the configs validate with; it never imports ``prometheus_client``
(the HTTP side, :mod:`shared_protocol.metrics_http`, is imported only when metrics are on).

A loopback address (``127.0.0.1``, ``[::1]``, ``localhost``) is served as it is. Any
other address would show the run (agents, their hosts' costs, accuracies) to whoever can
reach the port, so it is refused unless the endpoint has a password (HTTP basic auth)
and a TLS certificate: ``edgesplit keys init`` generates both (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

__all__ = ["MetricsAddress", "MetricsEndpointConfig", "MetricsEndpointError", "DEFAULT_METRICS_PORT"]

#: The port ``edgesplit local --metrics`` and the docs use for the server (agents take the next ones).
DEFAULT_METRICS_PORT = 9464


class MetricsEndpointError(RuntimeError):
    """The endpoint could not be started (port in use, unreadable certificate or password)."""


@dataclass(frozen=True)
class MetricsAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, key: str = "metrics_address") -> "MetricsAddress":
        """``HOST:PORT`` (``[V6]:PORT`` for IPv6); port 0 picks a free one."""
        host, sep, port = text.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"{key} must be HOST:PORT (e.g. 127.0.0.1:{DEFAULT_METRICS_PORT}), got {text!r}")
        return cls(host, int(port))

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class MetricsEndpointConfig:
    """The endpoint as a config describes it; ``table`` names the config table in errors."""

    address: MetricsAddress
    username: str = "edgesplit"
    password_file: str | None = field(default=None)
    cert_file: str | None = None
    key_file: str | None = None
    table: str = "server"

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(f"[{self.table}] metrics_cert_file and metrics_key_file go together (TLS for the metrics endpoint)")
        if self.address.loopback:
            return
        missing = [k for k, v in (("metrics_password_file", self.password_file), ("metrics_cert_file", self.cert_file),
                                  ("metrics_key_file", self.key_file)) if not v]
        if missing:
            raise ValueError(
                f"[{self.table}] metrics_address {self.address} is not a loopback address: the metrics"
                f"{' and the status page' if self.table == 'server' else ''} would be readable by anyone who can reach "
                f"it. Set [{self.table}] {', '.join(missing)} (basic auth and TLS; `edgesplit keys init` writes a password "
                f"file and a certificate, see docs/deploy.md 'Watching a run'), or bind to 127.0.0.1:{self.address.port}"
            )

    def require_client_library(self) -> None:
        """Before importing the HTTP side: a clear error where prometheus-client is missing."""
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            raise ValueError(f"[{self.table}] metrics_address is set but the prometheus-client package is not installed: "
                             "pip install 'edgesplit[metrics]' (or pip install prometheus-client), or unset metrics_address")

    @property
    def scheme(self) -> str:
        return "https" if self.cert_file else "http"

    @classmethod
    def of(cls, table: str, address: str | None, username: str, password_file: str | None, cert_file: str | None,
           key_file: str | None) -> "MetricsEndpointConfig | None":
        """From a config's ``metrics_*`` keys; None when ``address`` is unset (metrics off)."""
        if not address:
            return None
        return cls(MetricsAddress.parse(address, f"[{table}] metrics_address"), username, password_file, cert_file, key_file, table)
