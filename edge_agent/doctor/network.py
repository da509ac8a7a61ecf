"""The doctor's checks of the way to the broker: the host resolves and accepts TCP,
TLS is what the URL says it is (handshake, certificate chain, host name), and the
MQTT login is accepted."""

from __future__ import annotations

import os
import socket
import ssl
import time
import uuid
from dataclasses import replace

from .report import FAIL, OK, WARN, Check


def check_reachable(host: str, port: int, timeout_s: float) -> Check:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return Check("broker", FAIL, f"cannot resolve broker host {host!r} ({exc.strerror})",
                     "check broker_url in the config, DNS, or use the broker's IP address")
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout_s)
                start = time.monotonic()
                s.connect(address)
                rtt_ms = (time.monotonic() - start) * 1000
            return Check("broker", OK, f"{host}:{port} accepts TCP connections ({rtt_ms:.0f} ms)")
        except OSError as exc:
            last = exc
    if isinstance(last, ConnectionRefusedError):
        detail = f"{host}:{port} refused the connection: nothing listens on that port"
        fix = "start the broker (systemctl status mosquitto on the server) or fix the port in broker_url"
    elif isinstance(last, (socket.timeout, TimeoutError)):
        detail = f"{host}:{port} did not answer within {timeout_s:.0f} s"
        fix = "check the network path and firewalls (the broker port must be open to this device)"
    else:
        detail = f"cannot connect to {host}:{port} ({last})"
        fix = "check the network, broker_url and firewalls"
    return Check("broker", FAIL, detail, fix)


def check_tls(host: str, port: int, tls: bool, ca_file: str | None, cert: tuple[str, str] | None, timeout_s: float) -> Check:
    if not tls:
        # Does the port speak TLS although the URL says plain MQTT?
        try:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            with socket.create_connection((host, port), timeout=timeout_s) as raw, ctx.wrap_socket(raw, server_hostname=host):
                return Check("tls", FAIL, f"broker_url says mqtt:// (plain) but {host}:{port} speaks TLS",
                             f"use mqtts://{host}:{port} and set ca_file")
        except (ssl.SSLError, OSError):
            pass
        local = host in ("localhost", "127.0.0.1", "::1")
        return Check("tls", OK if local else WARN,
                     "plain MQTT (no TLS)" + ("" if local else ": the password and all traffic cross the network unencrypted"),
                     "" if local else "use mqtts:// with the broker's TLS listener (docs/security.md)")
    files = (("ca_file", ca_file), ("cert_file", cert[0] if cert else None), ("key_file", cert[1] if cert else None))
    missing = [f"{key} {os.path.expanduser(path)}" for key, path in files if path and not os.path.isfile(os.path.expanduser(path))]
    if missing:
        return Check("tls", FAIL, f"cannot set up TLS: {', '.join(missing)} does not exist",
                     "copy the deployment's ca.crt (from edgesplit keys init) there, or fix the path in [agent] "
                     "(a relative path is relative to the config file)")
    try:
        ctx = ssl.create_default_context(cafile=os.path.expanduser(ca_file) if ca_file else None)
        if cert:
            ctx.load_cert_chain(os.path.expanduser(cert[0]), os.path.expanduser(cert[1]))
    except (ssl.SSLError, OSError) as exc:
        return Check("tls", FAIL, f"cannot load the TLS files ({exc})", "check ca_file, cert_file and key_file")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
            subject = dict(x[0] for x in s.getpeercert().get("subject", ()))
            return Check("tls", OK, f"{s.version()} handshake OK; broker certificate for {subject.get('commonName', '?')} verified")
    except ssl.SSLCertVerificationError as exc:
        if "hostname" in str(exc).lower() or "ip address mismatch" in str(exc).lower():
            return Check("tls", FAIL, f"the broker's certificate is not valid for {host!r} ({exc.verify_message})",
                         f"use the host name the certificate was made for in broker_url, or regenerate it with --host {host}")
        if not ca_file:
            return Check("tls", FAIL, f"certificate verify failed: the broker's certificate is not signed by a CA this device "
                                      f"trusts ({exc.verify_message}), and [agent] sets no ca_file",
                         "set ca_file = \"/etc/edgesplit/ca.crt\" in [agent]: the deployment's ca.crt (from edgesplit keys init)")
        return Check("tls", FAIL, f"certificate verify failed: the broker's certificate is not signed by the CA in ca_file "
                                  f"{ca_file} ({exc.verify_message})",
                     "copy the ca.crt that signed the broker's certificate (from edgesplit keys init) to ca_file")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if reason in ("WRONG_VERSION_NUMBER", "UNEXPECTED_EOF_WHILE_READING", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG") or "EOF" in str(exc):
            return Check("tls", FAIL, f"broker_url says mqtts:// but {host}:{port} does not speak TLS ({reason})",
                         "use the broker's TLS port (8883 by default) or mqtt:// if the broker has no TLS")
        return Check("tls", FAIL, f"TLS handshake with {host}:{port} failed ({reason})",
                     "check that ca_file, and cert_file/key_file if the broker wants client certificates, belong to this deployment")
    except (ConnectionResetError, BrokenPipeError) as exc:
        # TCP works (checked before) but the handshake is cut off: a plain MQTT listener
        # (mosquitto resets on a ClientHello).
        return Check("tls", FAIL, f"broker_url says mqtts:// but {host}:{port} does not speak TLS (connection reset during the handshake: {exc.strerror})",
                     "use the broker's TLS port (8883 by default) or mqtt:// if the broker has no TLS")
    except OSError as exc:
        return Check("tls", FAIL, f"TLS connection to {host}:{port} failed ({exc})", "check the broker and the network")


def check_login(config: "EdgeConfigLike", timeout_s: float) -> Check:
    from shared_protocol.mqtt.transport import MqttTransport
    from shared_protocol.transport_interface import TransportError

    # A client id of its own: the agent's id would kick a running agent off the broker.
    tc = replace(config.transport_config(), client_id=f"{config.agent_id}-doctor-{uuid.uuid4().hex[:6]}",
                 connect_timeout_s=timeout_s, session_expiry_s=0)
    transport = MqttTransport(tc)
    try:
        transport.connect()
    except TransportError as exc:
        text = str(exc)
        if "Bad user name or password" in text:
            return Check("login", FAIL, f"the broker refused username {config.username!r}: wrong user name or password",
                         "copy this agent's password from the server (edgesplit keys init wrote it as bundles/<agent>/agent.password "
                         "and secrets/<agent>.password) to password_file")
        if "Not authorized" in text:  # what mosquitto 2.0 answers to a wrong password, too
            if not config.username:
                return Check("login", FAIL, "the broker does not let anonymous clients connect (Not authorized)",
                             "set username and password_file in [agent] (edgesplit keys init made them)")
            return Check("login", FAIL, f"the broker refused user {config.username!r} (Not authorized): wrong user name or password",
                         "copy this agent's password from the server (edgesplit keys init wrote it as bundles/<agent>/agent.password "
                         "and secrets/<agent>.password) to password_file, "
                         "and check the user is in the broker's password file")
        return Check("login", FAIL, f"MQTT connection failed: {text}", "check broker_url (scheme and port)")
    finally:
        transport.kill()
    who = f"as {config.username}" if config.username else "anonymously"
    return Check("login", OK, f"MQTT v5 login {who} accepted")


class EdgeConfigLike:  # for type hints only (EdgeConfig, without importing it at module level)
    agent_id: str
    username: str | None

    def transport_config(self):  # type: ignore[no-untyped-def]
        ...
