"""``edge-agent doctor``: check that this device can run an agent, and say what is wrong.

Each check returns a :class:`Check` with a status, what was found, and -- when
something is wrong -- what to do about it, in plain words. Checks run in order
and later ones are skipped when what they need failed (no broker check without a
readable config). Nothing here imports torch or onnxruntime at module level:
the doctor must run in an environment where they are missing, to say so.

Checks: Python version; the training backend (torch, or onnxruntime-training
for ``--backend ort``) and the agent's other dependencies; the config file;
credentials (password file, CA, client certificate); broker reachability (DNS,
TCP); TLS (handshake, certificate chain and host name, plain port mistaken for
TLS and the reverse); MQTT login (username/password); the data directory and
dataset; the state directory.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import ssl
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .config import MemoryConfig

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
MIN_PYTHON = (3, 10)
DEFAULT_CONFIG = "/etc/edgesplit/agent.toml"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class DoctorOptions:
    config_path: str = DEFAULT_CONFIG
    backend: str | None = None  # None: the config's backend
    timeout_s: float = 5.0
    load_data: bool = True  # load the dataset (slow for big ones) or only look at the files
    python_version: tuple[int, int, int] = field(default_factory=lambda: tuple(sys.version_info[:3]))  # type: ignore[assignment]
    importer: Callable[[str], object] = importlib.import_module
    meminfo: Callable[[], dict[str, int]] = lambda: meminfo_bytes()  # noqa: E731  (tests give a device's figures)
    data_root: str | None = None  # as edge-agent run's --data-root
    state_dir: str | None = None  # as edge-agent run's --state-dir


# --------------------------------------------------------------------------- #
# individual checks
# --------------------------------------------------------------------------- #


def check_python(version: tuple[int, ...]) -> Check:
    text = ".".join(str(v) for v in version)
    if tuple(version[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", FAIL, f"Python {text} is too old; EdgeSplit needs Python {need} or newer",
                     f"install python{need} or newer (Raspberry Pi OS 12 / Debian 12 / Ubuntu 22.04 ship it) and rerun deploy/edge/install.sh")
    return Check("python", OK, f"Python {text} ({sys.executable})")


def _version_of(module: object) -> str:
    return str(getattr(module, "__version__", "?"))


def check_backend(backend: str, importer: Callable[[str], object]) -> Check:
    if backend == "torch":
        try:
            torch = importer("torch")
        except ImportError as exc:
            return Check("backend", FAIL, f"the torch backend is selected but torch cannot be imported ({exc})",
                         "install it with deploy/edge/install.sh (or: pip install 'edgesplit[edge]'), "
                         "or run the torch-free backend: edge-agent run --backend ort")
        except OSError as exc:  # a wheel for the wrong CPU fails while loading its shared libraries
            return Check("backend", FAIL, f"torch is installed but does not load on this CPU ({exc})",
                         "reinstall the CPU wheel for this architecture with deploy/edge/install.sh --reinstall-torch")
        try:
            t = torch.zeros(2, 2)  # type: ignore[attr-defined]
            float((t @ t).sum())
        except (RuntimeError, AttributeError) as exc:
            return Check("backend", FAIL, f"torch {_version_of(torch)} imports but cannot compute ({exc})",
                         "reinstall the CPU wheel for this architecture with deploy/edge/install.sh --reinstall-torch")
        return Check("backend", OK, f"torch {_version_of(torch)} works")
    if backend == "ort":
        try:
            ort = importer("onnxruntime")
            importer("edge_agent.backends.ort").import_training_api()  # type: ignore[attr-defined]
        except ImportError as exc:
            return Check("backend", FAIL, f"the ort backend is selected but onnxruntime-training cannot be imported ({exc})",
                         "install it with: pip install 'edgesplit[edge-lite]' (x86_64 only: there is no Linux aarch64 "
                         "build of onnxruntime-training, so on a Pi use --backend torch)")
        return Check("backend", OK, f"onnxruntime-training {_version_of(ort)} (no torch needed)")
    return Check("backend", FAIL, f"unknown backend {backend!r}", "use --backend torch or --backend ort")


def check_dependencies(importer: Callable[[str], object]) -> Check:
    missing = []
    for module in ("numpy", "zstandard", "paho.mqtt.client"):
        try:
            importer(module)
        except ImportError:
            missing.append(module.split(".")[0])
    if missing:
        return Check("dependencies", FAIL, f"missing Python packages: {', '.join(missing)}",
                     "reinstall the agent: pip install 'edgesplit[edge]' (or [edge-lite])")
    return Check("dependencies", OK, "numpy, zstandard, paho-mqtt present")


def _readable_file(path: str, what: str, name: str, fix: str) -> Check | None:
    p = Path(os.path.expanduser(path))
    if not p.exists():
        return Check(name, FAIL, f"{what} {p} does not exist", fix)
    if not p.is_file():
        return Check(name, FAIL, f"{what} {p} is not a file", fix)
    if not os.access(p, os.R_OK):
        return Check(name, FAIL, f"{what} {p} is not readable by user {_user()}",
                     f"make it readable by the agent's user: sudo chown {_user()} {p} && sudo chmod 600 {p}")
    return None


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def check_credentials(raw_agent: dict) -> tuple[Check, str | None]:
    """(check, password) -- the password file, CA and client certificate named by the config."""
    notes: list[str] = []
    password: str | None = None
    password_file = raw_agent.get("password_file")
    if password_file:
        bad = _readable_file(password_file, "password_file", "credentials",
                             f"copy secrets/<agent>.password from the server (edgesplit keys init) to {password_file}")
        if bad:
            return bad, None
        password = Path(os.path.expanduser(password_file)).read_text().strip()
        if not password:
            return Check("credentials", FAIL, f"password_file {password_file} is empty",
                         "copy the agent's password file from the server (secrets/<agent>.password)"), None
        mode = Path(os.path.expanduser(password_file)).stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            notes.append(f"{password_file} is readable by other users (chmod 600 it)")
        notes.append(f"password from {password_file}")
    elif raw_agent.get("password"):
        password = str(raw_agent["password"])
        notes.append("password written in the config itself (prefer password_file)")
    if raw_agent.get("username") and password is None:
        return Check("credentials", FAIL, f"username {raw_agent['username']!r} is set but no password_file",
                     "add password_file = \"/etc/edgesplit/agent.password\" to [agent]"), None
    for key, what in (("ca_file", "CA certificate"), ("cert_file", "client certificate"), ("key_file", "client key")):
        path = raw_agent.get(key)
        if not path:
            continue
        bad = _readable_file(path, f"{key} ({what})", "credentials", f"copy {what} to {path} (ca.crt from edgesplit keys init)")
        if bad:
            return bad, password
        if key == "ca_file":
            try:
                ssl.create_default_context(cafile=os.path.expanduser(path))
            except ssl.SSLError as exc:
                return Check("credentials", FAIL, f"ca_file {path} is not a PEM certificate ({exc.reason or exc})",
                             "copy ca.crt (PEM) from the server's keys directory"), password
        notes.append(f"{key} {path}")
    if not notes:
        return Check("credentials", OK, "no credentials configured (anonymous broker)"), password
    status = WARN if any("readable by other" in n or "prefer password_file" in n for n in notes) else OK
    return Check("credentials", status, "; ".join(notes)), password


def meminfo_bytes(path: str = "/proc/meminfo") -> dict[str, int]:
    """``MemTotal`` and ``MemAvailable`` (bytes) from ``path``; {} where there is no such file (not Linux)."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


def check_memory(backend: str, memory: "MemoryConfig", meminfo: dict[str, int]) -> Check:
    """Whether the agent's measured peak (edge_agent.memory.MEASURED_PEAK_MB) fits what the device has free."""
    from .memory import MEASURED_PEAK_MB, PEAK_FROM_LONG_RUN, memory_mode

    if "MemAvailable" not in meminfo:
        return Check("memory", SKIP, "cannot read /proc/meminfo")
    available_mb = meminfo["MemAvailable"] / 1e6
    total_mb = meminfo.get("MemTotal", 0) / 1e6
    mode = memory_mode(memory)
    key = (backend, mode if mode != "custom" else "default")
    peak = MEASURED_PEAK_MB.get(key)
    if peak is None:
        return Check("memory", SKIP, f"no measured peak for the {backend} backend")
    # The long runs' plateau where they measured the mode: the most any round held, not the first rounds'.
    source = ("the most any round held over bench/footprint.py's long runs" if key in PEAK_FROM_LONG_RUN
              else "bench/footprint.py's first rounds; no long run measured this mode")
    what = f"{available_mb:.0f} MB available of {total_mb:.0f} MB; the {backend} agent peaked at {peak} MB in {mode} mode ({source})"
    if available_mb >= 1.2 * peak:
        return Check("memory", OK, what)
    low = MEASURED_PEAK_MB[(backend, "low-memory")]
    if mode != "low-memory" and available_mb >= 1.2 * low:
        return Check("memory", WARN, what, f"run with --low-memory (peaked at {low} MB; slower training steps, see docs/deploy.md)")
    return Check("memory", WARN, what + (f"; {low} MB with --low-memory" if mode != "low-memory" else ""),
                 "stop other services, add swap, or use a device with more memory"
                 + ("; --backend ort is lighter (x86_64 only)" if backend == "torch" else ""))


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
    from shared_protocol.mqtt_transport import MqttTransport
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


def data_fix(exc: BaseException) -> str:
    """What to do about data that does not load (doctor and ``edge-agent run`` say the same)."""
    from fldata.image_folder import ImageFolderError

    if isinstance(exc, ImageFolderError):
        return "fix the file(s) named above in this device's image folder ([data] root), then run doctor again"
    return "fix [data] in the config (docs/configuration.md)"


def check_data(config: "EdgeConfigLike", load: bool) -> Check:
    from fldata import load_dataset

    d = config.data  # type: ignore[attr-defined]
    if d.dataset in ("imagefolder", "cinic10", "npz"):
        if not d.root:
            return Check("data", FAIL, f"data.dataset = {d.dataset!r} needs data.root (the data directory)",
                         "set root = \"/var/lib/edgesplit/data\" in [data]")
        root = Path(os.path.expanduser(d.root))
        if not root.exists():
            return Check("data", FAIL, f"data directory {root} does not exist",
                         f"create it and put this device's data there (imagefolder: {root}/<class>/<image>.png; "
                         f"npz: {root}/train.npz from `python -m fldata.export`)")
        if not os.access(root, os.R_OK | os.X_OK):
            return Check("data", FAIL, f"data directory {root} is not readable by user {_user()}",
                         f"sudo chown -R {_user()} {root}")
    if not load:
        return Check("data", OK, f"{d.dataset} at {d.root or 'the default location'} (not loaded: --no-load-data)")
    try:
        train = load_dataset(d.dataset, "train", d.root, d.download)
        if d.dataset == "imagefolder" and d.root and (Path(os.path.expanduser(d.root)) / "test").is_dir():
            load_dataset(d.dataset, "test", d.root, d.download)  # the whole folder: a bad test image stops a run too
    except FileNotFoundError as exc:
        return Check("data", FAIL, f"the {d.dataset} training data is not there: {exc}",
                     "put the data in place (docs/deploy.md, 'Data on the device') or fix data.root")
    except (ValueError, OSError, ImportError) as exc:
        return Check("data", FAIL, f"cannot load {d.dataset} data: {exc}", data_fix(exc))
    if len(train) == 0:
        return Check("data", FAIL, f"{d.dataset} at {d.root} has no training samples", "add images")
    counts = train.class_counts()
    mismatch = contract_mismatch(d, tuple(int(x) for x in train.image_shape), int(train.num_classes))
    if mismatch:
        return Check("data", FAIL, f"{d.dataset} at {d.root}: this device's data does not fit the run: {'; '.join(mismatch)} "
                                   f"(the server refuses it at join)",
                     "make the folder fit the run: the same class folders on every device (as `python -m fldata.export "
                     "--format imagefolder` writes them), images of the run's size and channels; if the server's [server] "
                     "settings changed since edgesplit keys init, set the same in_channels / image_size / num_classes in [data]")
    folders = f", {train.num_classes} class folders" if d.dataset == "imagefolder" else ""
    return Check("data", OK, f"{d.dataset}: {len(train)} training images, {int((counts > 0).sum())} classes with images{folders}, "
                             f"shape {train.image_shape}")


def contract_mismatch(d: "DataConfigLike", shape: tuple[int, ...], num_classes: int) -> list[str]:
    """How data of ``shape`` (channels, height, width, as the model sees it) and ``num_classes``
    classes differs from the run's contract in ``[data]`` (in_channels, image_size,
    num_classes; 0 / unset are not checked), in words naming both sides."""
    out = []
    if d.in_channels and shape[0] != d.in_channels:
        out.append(f"its images have {shape[0]} channel(s), the run's in_channels is {d.in_channels}")
    if d.image_size and list(shape[1:]) != list(d.image_size):
        out.append(f"its images are {shape[1]}x{shape[2]} (height x width, as the model sees them), "
                   f"the run's image_size is {d.image_size[0]}x{d.image_size[1]}")
    if d.num_classes and num_classes != d.num_classes:
        what = "class folders" if d.dataset == "imagefolder" else "classes"
        out.append(f"it has {num_classes} {what}, the run's num_classes is {d.num_classes}")
    return out


class DataConfigLike:  # for type hints only (edge_agent.config.DataConfig)
    dataset: str
    in_channels: int
    image_size: list[int] | None
    num_classes: int


def check_state_dir(state_dir: str | None) -> Check:
    if not state_dir:
        return Check("state", WARN, "no state_dir: a restarted agent starts its model from scratch",
                     "set state_dir = \"/var/lib/edgesplit/state\" in [agent]")
    p = Path(os.path.expanduser(state_dir))
    probe = p if p.exists() else next((q for q in p.parents if q.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return Check("state", FAIL, f"state_dir {p} is not writable by user {_user()}", f"sudo install -d -o {_user()} {p}")
    return Check("state", OK, f"state_dir {p} is writable")


# --------------------------------------------------------------------------- #
# the whole run
# --------------------------------------------------------------------------- #


def run_checks(options: DoctorOptions) -> list[Check]:
    from shared_protocol.tomlio import read_toml

    checks = [check_python(options.python_version), check_dependencies(options.importer)]
    try:
        raw = read_toml(options.config_path)
    except FileNotFoundError:
        checks.append(Check("config", FAIL, f"config file {options.config_path} does not exist",
                            "write it (deploy/configs/agent.toml is an example; edgesplit keys init generates one per agent)"))
        checks.append(check_backend(options.backend or "torch", options.importer))
        return checks
    except (ValueError, PermissionError) as exc:
        checks.append(Check("config", FAIL, f"cannot read {options.config_path}: {exc}", "fix the TOML syntax or its permissions"))
        return checks
    from .config import resolve_credential_paths

    # Relative credential paths are relative to the config file, as edge-agent run reads them.
    raw_agent = resolve_credential_paths(dict(raw.get("agent", {})), Path(options.config_path).resolve().parent)
    backend = options.backend or str(raw_agent.get("backend", "torch"))
    checks.append(check_backend(backend, options.importer))
    cred, password = check_credentials(raw_agent)

    from .config import EdgeConfig

    try:
        config_doc = dict(raw)
        agent = {k: v for k, v in raw_agent.items() if k != "password_file"}
        if password is not None:
            agent["password"] = password
        agent["backend"] = backend
        config_doc["agent"] = agent
        config = EdgeConfig.from_dict(config_doc)
        if options.data_root:
            config = replace(config, data=replace(config.data, root=options.data_root))
        if options.state_dir:
            config = replace(config, state_dir=options.state_dir)
    except (ValueError, TypeError) as exc:
        checks.append(Check("config", FAIL, f"{options.config_path} is not a valid agent config: {exc}",
                            "see docs/configuration.md for the [agent] and [data] keys"))
        checks.append(cred)
        return checks
    checks.append(Check("config", OK, f"{options.config_path}: agent {config.agent_id!r} in run {config.run_id!r}, broker {config.broker_url}"))
    checks.append(cred)

    from shared_protocol.mqtt_config import BrokerAddress

    address = BrokerAddress.parse(config.broker_url)
    reach = check_reachable(address.host, address.port, options.timeout_s)
    checks.append(reach)
    if reach.failed:
        checks += [Check("tls", SKIP, "broker not reachable"), Check("login", SKIP, "broker not reachable")]
    else:
        cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None
        tls = check_tls(address.host, address.port, address.tls, config.ca_file, cert, options.timeout_s)
        checks.append(tls)
        if tls.failed or cred.failed:
            checks.append(Check("login", SKIP, "fix TLS / credentials first"))
        else:
            checks.append(check_login(config, options.timeout_s))
    checks.append(check_memory(config.backend, config.memory, options.meminfo()))
    checks.append(check_data(config, options.load_data))
    checks.append(check_state_dir(config.state_dir))
    return checks


def connection_checks(config: "EdgeConfigLike", timeout_s: float = 5.0) -> list[Check]:
    """Doctor's network checks for ``config`` (broker reachable, TLS, login), stopping at the
    first failure: what ``edge-agent run`` prints when it cannot connect, with the fix."""
    from shared_protocol.mqtt_config import BrokerAddress

    address = BrokerAddress.parse(config.broker_url)  # type: ignore[attr-defined]
    reach = check_reachable(address.host, address.port, timeout_s)
    if reach.failed:
        return [reach]
    cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None  # type: ignore[attr-defined]
    tls = check_tls(address.host, address.port, address.tls, config.ca_file, cert, timeout_s)  # type: ignore[attr-defined]
    if tls.failed:
        return [reach, tls]
    return [reach, tls, check_login(config, timeout_s)]


def render(checks: list[Check]) -> str:
    lines = []
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"[{c.status:^4}] {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"{'':7}{'':<{width}}  -> {c.fix}")
    failed = [c.name for c in checks if c.failed]
    lines.append("")
    lines.append(f"{len(failed)} problem(s): {', '.join(failed)}" if failed else "everything needed to run this agent looks right")
    return "\n".join(lines)


def main(options: DoctorOptions) -> int:
    # Every finding is a check line: the transport's own log lines (a refused login, say) would
    # reach stderr through logging's last-resort handler, unformatted, next to the check that says it.
    quiet, null = logging.getLogger("shared_protocol"), logging.NullHandler()
    was = quiet.propagate
    quiet.addHandler(null)  # a handler found: the last resort is not used
    quiet.propagate = False
    try:
        checks = run_checks(options)
    finally:
        quiet.removeHandler(null)
        quiet.propagate = was
    print(render(checks))
    return 1 if any(c.failed for c in checks) else 0
