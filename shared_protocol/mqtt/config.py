"""Where and how the MQTT transport connects: the broker address, the transport's
configuration, the TLS context, and the chunk size that fits the broker's packet limit."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from .chunk_format import DEFAULT_CHUNK_SIZE_BYTES
from ..transport_interface import TransportError

# What a PUBLISH carries besides a chunk's blob bytes: the chunk header with a 64-byte transfer
# id and the SHA-256 (125 bytes), a topic and a reply topic of up to 400 bytes each, and the MQTT
# fixed header, topic length, packet id and empty properties (10). A chunk size that leaves this
# much room under the broker's Maximum Packet Size always fits.
CHUNK_HEADROOM_BYTES = 1024
MIN_CHUNK_SIZE_BYTES = 1024


def tls_context(config: "TransportConfig") -> ssl.SSLContext:
    """The TLS context for ``mqtts://``: the system's CAs or ``ca_file``, and the client
    certificate if given. A file that is missing or not what it should be is a
    :class:`TransportError` naming the key and the file (ssl's own error names neither)."""
    files = (("ca_file", config.ca_file), ("cert_file", config.cert_file), ("key_file", config.key_file))
    missing = [f"{key} {path}" for key, path in files if path and not os.path.isfile(path)]
    if missing:
        raise TransportError(f"cannot set up TLS: {', '.join(missing)} does not exist (the deployment's ca.crt from "
                             f"edgesplit keys init belongs at ca_file)")
    try:
        context = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file and config.key_file:
            context.load_cert_chain(config.cert_file, config.key_file)
    except (ssl.SSLError, OSError) as exc:
        named = ", ".join(f"{key} {path}" for key, path in files if path) or "the system's CA certificates"
        raise TransportError(f"cannot set up TLS from {named}: {exc} (is each file the PEM file it should be?)") from exc
    return context


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool
    username: str | None = None  # from a mqtt://user:pass@host URL
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> "BrokerAddress":
        """``mqtt://host:port`` (plain) or ``mqtts://host:port`` (TLS), optionally with
        ``user:password@`` before the host (percent-encoded)."""
        parsed = urlparse(url if "://" in url else f"mqtt://{url}")
        if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"broker URL {redact_url(url)!r}: scheme must be mqtt:// or mqtts://")
        tls = parsed.scheme in ("mqtts", "ssl")
        if not parsed.hostname:
            raise ValueError(f"broker URL {redact_url(url)!r} has no host")
        try:
            port = parsed.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {redact_url(url)!r} has an invalid port") from None
        username = unquote(parsed.username) if parsed.username is not None else None
        password = unquote(parsed.password) if parsed.password is not None else None
        return cls(parsed.hostname, port, tls, username, password)

    def url(self) -> str:
        """The URL without credentials (what logs and reports show)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def redact_url(url: str) -> str:
    """``url`` with the password of a ``user:password@`` part replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url
    creds, host = netloc.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    shown = f"{user}:***" if ":" in creds else user
    return f"{scheme}{sep}{shown}@{host}{slash}{path}"


@dataclass(frozen=True)
class TransportConfig:
    broker_url: str = "mqtt://127.0.0.1:1883"
    client_id: str = ""
    username: str | None = None  # or user:password@ in broker_url
    password: str | None = field(default=None, repr=False)  # never logged
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    keepalive_s: int = 30
    session_expiry_s: int = 3600
    connect_timeout_s: float = 30.0
    # Blob bytes per PUBLISH. None: 512 KiB, or less when the broker's CONNACK announces a
    # Maximum Packet Size that needs it; an explicit size that does not fit fails at connect.
    chunk_size_bytes: int | None = None
    max_inflight_chunks: int = 16
    publish_timeout_s: float = 600.0
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    max_transfer_bytes: int = 256 * 1024 * 1024
    max_reassembly_bytes: int = 1024 * 1024 * 1024
    # Senders the receiver states no expectation for (Transport.expect_sender). None: they may
    # send up to max_transfer_bytes; a server sets a small bound (a hello is a few KiB).
    max_unexpected_transfer_bytes: int | None = None
    max_unexpected_total_bytes: int = 16 * 1024 * 1024  # all such senders together (with a bound set)
    max_invalid_transfers: int = 20  # from one such sender, then it is ignored for ignore_invalid_s
    ignore_invalid_s: float = 600.0
    transfer_timeout_s: float = 300.0
    resend_after_s: float = 15.0
    resend_cache_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        address = BrokerAddress.parse(self.broker_url)
        if address.username is not None and self.username is not None and address.username != self.username:
            raise ValueError(
                f"broker URL names user {address.username!r} but username is {self.username!r}: give it once"
            )
        if address.password is not None and self.password is not None and address.password != self.password:
            raise ValueError("broker URL carries a password and password / password_file gives another: give it once")
        if self.chunk_size_bytes is not None and self.chunk_size_bytes < MIN_CHUNK_SIZE_BYTES:
            raise ValueError(f"chunk_size_bytes must be >= {MIN_CHUNK_SIZE_BYTES}, got {self.chunk_size_bytes}")
        if self.max_inflight_chunks < 1:
            raise ValueError("max_inflight_chunks must be >= 1")
        if self.keepalive_s < 1 or self.publish_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("keepalive_s, publish_timeout_s and connect_timeout_s must be positive")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.max_unexpected_transfer_bytes is not None and not (
            0 < self.max_unexpected_transfer_bytes <= self.max_unexpected_total_bytes
        ):
            raise ValueError(
                f"need 0 < max_unexpected_transfer_bytes ({self.max_unexpected_transfer_bytes}) <= "
                f"max_unexpected_total_bytes ({self.max_unexpected_total_bytes})"
            )
        if self.max_invalid_transfers < 1 or self.ignore_invalid_s < 0:
            raise ValueError("max_invalid_transfers must be >= 1 and ignore_invalid_s >= 0")

    @property
    def credentials(self) -> tuple[str | None, str | None]:
        """(username, password): the explicit ones, else those in the broker URL."""
        address = BrokerAddress.parse(self.broker_url)
        username = self.username if self.username is not None else address.username
        password = self.password if self.password is not None else address.password
        return username, password


def chunk_size_for(packet_limit_bytes: int | None, explicit: int | None) -> int:
    """The chunk size to use under a broker's Maximum Packet Size (None: it announced none).

    An explicit size must leave :data:`CHUNK_HEADROOM_BYTES` under the limit (ValueError naming
    both sizes otherwise); the default is 512 KiB, or the most that leaves that room.
    """
    if packet_limit_bytes is None:
        return explicit or DEFAULT_CHUNK_SIZE_BYTES
    fits = packet_limit_bytes - CHUNK_HEADROOM_BYTES
    if explicit is not None:
        if explicit > fits:
            raise ValueError(
                f"chunk_size_bytes {explicit} does not fit the broker's Maximum Packet Size of {packet_limit_bytes} "
                f"bytes (announced in its CONNACK): a chunk needs up to {explicit + CHUNK_HEADROOM_BYTES} bytes "
                f"with its headers; set chunk_size_bytes to at most {fits}, or leave it unset to adapt"
            )
        return explicit
    if fits < MIN_CHUNK_SIZE_BYTES:
        raise ValueError(
            f"the broker's Maximum Packet Size of {packet_limit_bytes} bytes leaves no room for a "
            f"{MIN_CHUNK_SIZE_BYTES}-byte chunk and its {CHUNK_HEADROOM_BYTES} bytes of headers"
        )
    return min(DEFAULT_CHUNK_SIZE_BYTES, fits)
