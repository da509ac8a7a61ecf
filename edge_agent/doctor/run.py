"""The doctor's run: :func:`run_checks` runs the checks in order (later ones skipped when what
they need failed), :func:`connection_checks` the network ones alone for ``edge-agent run``,
and :func:`main` prints them."""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from .data import check_data
from .device import (
    check_backend,
    check_credentials,
    check_dependencies,
    check_memory,
    check_python,
    check_state_dir,
    meminfo_bytes,
)
from .network import EdgeConfigLike, check_login, check_reachable, check_tls
from .report import FAIL, OK, SKIP, Check, render

__all__ = ["DEFAULT_CONFIG", "DoctorOptions", "connection_checks", "main", "run_checks"]

DEFAULT_CONFIG = "/etc/edgesplit/agent.toml"


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
    from ..config import resolve_credential_paths

    # Relative credential paths are relative to the config file, as edge-agent run reads them.
    raw_agent = resolve_credential_paths(dict(raw.get("agent", {})), Path(options.config_path).resolve().parent)
    backend = options.backend or str(raw_agent.get("backend", "torch"))
    checks.append(check_backend(backend, options.importer))
    cred, password = check_credentials(raw_agent)

    from ..config import EdgeConfig

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

    from shared_protocol.mqtt.config import BrokerAddress

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
    from shared_protocol.mqtt.config import BrokerAddress

    address = BrokerAddress.parse(config.broker_url)  # type: ignore[attr-defined]
    reach = check_reachable(address.host, address.port, timeout_s)
    if reach.failed:
        return [reach]
    cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None  # type: ignore[attr-defined]
    tls = check_tls(address.host, address.port, address.tls, config.ca_file, cert, timeout_s)  # type: ignore[attr-defined]
    if tls.failed:
        return [reach, tls]
    return [reach, tls, check_login(config, timeout_s)]


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
