"""The doctor's checks of the device itself: Python, the training backend and the
other dependencies, the credential files the config names, free memory against the
agent's measured peak, and the state directory. Nothing here imports torch or
onnxruntime at module level (the backend check imports them to see if they load)."""

from __future__ import annotations

import os
import ssl
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .report import FAIL, OK, SKIP, WARN, Check

if TYPE_CHECKING:
    from ..config import MemoryConfig

MIN_PYTHON = (3, 10)


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
    for module in ("numpy", "zstandard", "xxhash", "paho.mqtt.client"):
        try:
            importer(module)
        except ImportError:
            missing.append(module.split(".")[0])
    if missing:
        return Check("dependencies", FAIL, f"missing Python packages: {', '.join(missing)}",
                     "reinstall the agent: pip install 'edgesplit[edge]' (or [edge-lite])")
    return Check("dependencies", OK, "numpy, zstandard, xxhash, paho-mqtt present")


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
    from ..memory import MEASURED_PEAK_MB, PEAK_FROM_LONG_RUN, memory_mode

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
    source = ("the most any round held over bench/micro/test_footprint.py's long runs" if key in PEAK_FROM_LONG_RUN
              else "bench/micro/test_footprint.py's first rounds; no long run measured this mode")
    what = f"{available_mb:.0f} MB available of {total_mb:.0f} MB; the {backend} agent peaked at {peak} MB in {mode} mode ({source})"
    if available_mb >= 1.2 * peak:
        return Check("memory", OK, what)
    low = MEASURED_PEAK_MB[(backend, "low-memory")]
    if mode != "low-memory" and available_mb >= 1.2 * low:
        return Check("memory", WARN, what, f"run with --low-memory (peaked at {low} MB; slower training steps, see docs/deploy.md)")
    return Check("memory", WARN, what + (f"; {low} MB with --low-memory" if mode != "low-memory" else ""),
                 "stop other services, add swap, or use a device with more memory"
                 + ("; --backend ort is lighter (x86_64 only)" if backend == "torch" else ""))


def check_state_dir(state_dir: str | None) -> Check:
    if not state_dir:
        return Check("state", WARN, "no state_dir: a restarted agent starts its model from scratch",
                     "set state_dir = \"/var/lib/edgesplit/state\" in [agent]")
    p = Path(os.path.expanduser(state_dir))
    probe = p if p.exists() else next((q for q in p.parents if q.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return Check("state", FAIL, f"state_dir {p} is not writable by user {_user()}", f"sudo install -d -o {_user()} {p}")
    return Check("state", OK, f"state_dir {p} is writable")
