"""What ``edgesplit local`` writes into a run's configs, and the ``--set`` overrides.

Each method owns its table: its server step's module defines
``launcher_table(options: LocalRunOptions) -> dict``, which maps the launcher's
flags onto the keys of that method's config table, and its registry entry
(:class:`shared_protocol.registry.MethodSpec`) declares the flags that table
reads (``LauncherFlag``), which the launcher adds to ``edgesplit local``. The
launcher looks both up by the method's name, so adding a method edits no shared
file; a method without a table is an error naming what to add, never another
method's table (a silent fallback once gave every new method another's keys).

``--set TABLE.KEY=VALUE`` then changes any key of the generated files; the
config dataclasses that read them refuse an unknown key.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_protocol.local_broker import free_port
from shared_protocol.metrics_endpoint import DEFAULT_METRICS_PORT, MetricsAddress
from shared_protocol.registry import LauncherFlag, get_method, registered_methods
from shared_protocol.tomlio import read_toml, write_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "LocalRunOptions",
    "broker_settings",
    "check_server_config",
    "clear_previous_run",
    "local_options",
    "method_table",
    "metrics_addresses",
    "metrics_banner",
    "write_configs",
    "MissingLauncherTableError",
    "Setting",
    "apply_settings",
    "get_launcher_table",
    "launcher_flags",
    "launcher_table",
    "parse_setting",
]

#: Tables of the files ``edgesplit local`` writes, besides the method's own (named after it):
#: the server's, and each agent's (``[memory]`` is written only when ``--set`` gives a key of it).
SERVER_TABLE = "server"
AGENT_TABLES = ("agent", "data", "memory")


@dataclass(frozen=True)
class LaunchFlag:
    """One ``edgesplit local`` flag as the launcher adds it: the declaration the methods
    share and each declaring method's help."""

    flag: LauncherFlag
    helps: tuple[tuple[str, str], ...]  # (method, what the flag means for it)

    def help_text(self) -> str:
        """``"a, b: what the flag means for both; c: ..."``: methods with the same text together."""
        by_text: dict[str, list[str]] = {}
        for method, text in self.helps:
            by_text.setdefault(text, []).append(method)
        return "; ".join(f"{', '.join(methods)}: {text}" for text, methods in by_text.items())


def launcher_flags() -> list[LaunchFlag]:
    """Every flag the registered methods declare, once each (in the order first declared);
    two methods declaring one flag with other defaults, types or choices is a ValueError."""
    merged: dict[str, tuple[LauncherFlag, list[tuple[str, str]]]] = {}
    for name, spec in registered_methods().items():
        for flag in spec.flags:
            held = merged.get(flag.name)
            if held is None:
                merged[flag.name] = (flag, [(name, flag.help)])
            elif not held[0].same_as(flag):
                raise ValueError(f"{flag.name} is declared by {held[1][0][0]} as {held[0]} and by {name} as {flag}: "
                                 "a flag shared by methods has one default, type and choices")
            else:
                held[1].append((name, flag.help))
    return [LaunchFlag(flag, tuple(helps)) for flag, helps in merged.values()]


@dataclass(frozen=True)
class LocalRunOptions:
    """The launcher's flags a method's table may use (typed; no argparse namespace): the
    run's data and seed, and the methods' own flags (``flags``, by ``LauncherFlag.dest``)."""

    method: str
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    train_samples: int = 4000  # the agents' seeded subset of the training set (0 = all)
    test_samples: int = 1000
    seed: int = 0
    flags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.train_samples < 0 or self.test_samples < 0:
            raise ValueError("--train-samples and --test-samples must be >= 0")
        declared = {f.flag.dest: f.flag for f in launcher_flags()}
        for dest, value in self.flags.items():
            if dest in declared:
                declared[dest].check(value)

    def given(self, dest: str) -> bool:
        """Whether the flag ``dest`` was given (rather than left at the method's default)."""
        return dest in self.flags

    def flag(self, dest: str) -> Any:
        """The value of the flag ``dest`` (``"server_model"`` for ``--server-model``): as given,
        else the default the method declares; a flag the method does not declare is a KeyError."""
        if dest in self.flags:
            return self.flags[dest]
        for flag in get_method(self.method).flags:
            if flag.dest == dest:
                return flag.default
        raise KeyError(f"method {self.method!r} declares no flag --{dest.replace('_', '-')} (MethodSpec.flags)")


@dataclass(frozen=True)
class Setting:
    """One ``--set TABLE.KEY=VALUE``."""

    table: str
    key: str
    value: Any

    def __str__(self) -> str:
        return f"{self.table}.{self.key}"


LauncherTable = Callable[[LocalRunOptions], dict[str, Any]]


class MissingLauncherTableError(ValueError):
    """A method's server module defines no ``launcher_table``."""


def get_launcher_table(method: str) -> LauncherTable:
    """The ``launcher_table`` function of the module of ``method``'s server step."""
    from .methods import get_server_method

    cls = get_server_method(method)  # an unknown method: ValueError listing the known ones
    module = sys.modules[cls.__module__]
    table = getattr(module, "launcher_table", None)
    if not callable(table):
        path = module.__file__ or f"{module.__name__.replace('.', '/')}.py"
        raise MissingLauncherTableError(
            f"method {method!r} has no launcher table: define `def launcher_table(options: LocalRunOptions) -> dict` "
            f"in {path} (its server step's module), returning its [{method}] keys from the launcher's flags "
            "(see docs/adding-a-method.md)"
        )
    return table  # type: ignore[no-any-return]


def launcher_table(options: LocalRunOptions) -> dict[str, Any]:
    """The ``[<method>]`` table ``edgesplit local`` writes for ``options.method``."""
    table = get_launcher_table(options.method)(options)
    if not isinstance(table, dict):
        raise TypeError(f"{options.method}.launcher_table must return a dict, got {type(table).__name__}")
    return table


def parse_setting(text: str) -> Setting:
    """``"mymethod.epochs=3"`` -> Setting("mymethod", "epochs", 3).

    The value is read as a TOML value (``3``, ``0.5``, ``true``, ``"raw"``,
    ``["a", "b"]``); a bare word that is not one (``fp16-zstd``) is taken as a
    string, so shell users need not quote codec or model names.
    """
    name, sep, raw = text.partition("=")
    table, dot, key = name.strip().partition(".")
    if not sep or not dot or not table or not key or "." in key:
        raise ValueError(f"--set takes TABLE.KEY=VALUE (e.g. server.round_deadline_s=60 or <method>.<key>=3), got {text!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if isinstance(value, dict):
        raise ValueError(f"--set {name.strip()}: a value must be a TOML scalar or list, not a table")
    return Setting(table, key, value)


def apply_settings(documents: Iterable[Mapping[str, dict[str, Any]]], settings: Iterable[Setting], method: str) -> None:
    """Set each setting in every document that holds its table (in place).

    The server's file holds ``[server]`` and ``[<method>]``, each agent's
    ``[agent]``, ``[data]`` and ``[memory]`` (added by the first setting of it);
    a setting for any other table is refused here, and an unknown key by the
    config class that reads the file.
    """
    documents = list(documents)
    known = (SERVER_TABLE, method, *AGENT_TABLES)
    for setting in settings:
        if setting.table not in known:
            raise ValueError(f"--set {setting}: no table [{setting.table}] in this run's configs; tables: {', '.join(known)}")
        side = "agent" if setting.table in AGENT_TABLES else SERVER_TABLE
        for doc in documents:
            if side in doc:
                doc.setdefault(setting.table, {})[setting.key] = setting.value


# -- the files: the server's and every agent's config -------------------------------------- #


def local_options(args: argparse.Namespace) -> LocalRunOptions:
    """The flags a method's launcher table may use, typed."""
    flags = {launch.flag.dest: getattr(args, launch.flag.dest) for launch in launcher_flags()
             if getattr(args, launch.flag.dest, None) is not None}  # the flags given; the rest: LocalRunOptions.flag's default
    return LocalRunOptions(method=args.method, dataset=args.dataset, data_root=args.data_root, train_samples=args.train_samples,
                           test_samples=args.test_samples, seed=args.seed, flags=flags)


def method_table(args: argparse.Namespace) -> dict:
    """The ``[<method>]`` table of the generated server.toml: the method's own launcher table."""
    return launcher_table(local_options(args))


def broker_settings(args: argparse.Namespace, broker: str, configs: Path) -> tuple[str, dict]:
    """The broker URL without credentials, and the keys both the server's and the agents'
    configs get: ``username``, ``password_file`` (from ``--username`` / ``--password-file``,
    or a ``user:password@`` in ``--broker``, whose password goes to a 0600 file: configs name
    secrets by path, never hold them) and ``chunk_size_bytes``."""
    from shared_protocol.transport import BrokerAddress

    address = BrokerAddress.parse(broker)
    keys: dict = {}
    username = getattr(args, "username", None)
    password_file = getattr(args, "password_file", None)
    if address.username is not None:
        if username is not None and username != address.username:
            raise ValueError(f"--broker names user {address.username!r} but --username is {username!r}: give the user once")
        username = address.username
        broker = f"{'mqtts' if address.tls else 'mqtt'}://{address.host}:{address.port}"
    if address.password is not None:
        if password_file is not None:
            raise ValueError("give the broker password once: in --broker or with --password-file")
        secret = configs / "broker.password"
        secret.touch(mode=0o600, exist_ok=True)
        secret.chmod(0o600)
        secret.write_text(address.password + "\n")
        password_file = str(secret)
    if password_file is not None:
        if not Path(password_file).is_file():
            raise ValueError(f"--password-file {password_file}: no such file")
        keys["password_file"] = str(Path(password_file).resolve())
    if username is not None:
        keys["username"] = username
    if getattr(args, "chunk_size", None) is not None:
        keys["chunk_size_bytes"] = args.chunk_size
    return broker, keys


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def metrics_addresses(requested: str | None, agents: int) -> tuple[str | None, list[str | None]]:
    """``--metrics``: the server's address (the requested one; the default port is swapped for
    a free one when taken) and one free loopback port per agent; (None, [None, ...]) when off."""
    if requested is None:
        return None, [None] * agents
    address = MetricsAddress.parse(requested, "--metrics")
    if address.port == DEFAULT_METRICS_PORT and not _port_free(address.host, address.port):
        address = MetricsAddress(address.host, free_port(address.host) if ":" not in address.host else 0)
    return str(address), [f"127.0.0.1:{free_port()}" for _ in range(agents)]


def write_configs(args: argparse.Namespace, run_id: str, out: Path, broker: str, agents: int | None = None,
                  configs_dir: Path | None = None) -> tuple[Path, list[Path]]:
    """The server's and every agent's config of a run in ``out``, written to ``configs_dir``
    (default ``out/configs``); a bad ``--set`` or broker flag is a ValueError."""
    configs = configs_dir or out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    broker, broker_keys = broker_settings(args, broker, configs)
    n_agents = args.agents if agents is None else agents
    server_metrics, agent_metrics = metrics_addresses(getattr(args, "metrics", None), n_agents)
    server_doc = {
        "server": {
            "run_id": run_id, "method": args.method, "broker_url": broker, "out_dir": str(out),
            "expected_agents": args.agents, "rounds": args.rounds, "round_deadline_s": args.deadline,
            "min_agents": 1, "min_fraction": 0.5, "eval_every": args.eval_every, "client_fraction": args.client_fraction, "registration_timeout_s": 300.0,
            "dataset": args.dataset, "num_classes": 10 if args.dataset != "cifar100" else 100, "seed": args.seed,
            # The global test set: the seeded test subset the agents' test shares are cut from.
            "eval_samples": args.test_samples, "eval_seed": args.seed,
            **({"eval_root": args.data_root} if args.data_root else {}),
            **broker_keys,
            **({"metrics_address": server_metrics} if server_metrics else {}),
            **({"audit": True} if getattr(args, "audit", False) else {}),
            **{key: getattr(args, key) for key in ("link_mbit", "device_memory") if getattr(args, key, None) is not None},
        },
        args.method: method_table(args),
    }
    agent_docs = [
        {
            "agent": {"agent_id": f"agent-{i}", "run_id": run_id, "broker_url": broker, "state_dir": str(out / "agent-state"), "threads": 1,
                      **broker_keys, **({"metrics_address": agent_metrics[i]} if agent_metrics[i] else {})},
            "data": {
                "dataset": args.dataset, "root": args.data_root, "partition": args.partition, "num_agents": args.agents,
                "agent_index": i, "seed": args.seed, "train_samples": args.train_samples, "test_samples": args.test_samples,
            },
        }
        for i in range(n_agents)
    ]
    for index, fault in getattr(args, "faulty_agent", None) or ():  # a misbehaving device on purpose
        if index < len(agent_docs):
            agent_docs[index]["agent"].update({"fault": fault.kind, **({"fault_scale": fault.scale} if fault.scale is not None else {})})
    apply_settings([server_doc, *agent_docs], [parse_setting(s) for s in getattr(args, "set", None) or ()], args.method)
    header = f"generated by edgesplit local for run {run_id}"
    server_path = configs / "server.toml"
    write_toml(server_path, server_doc, header=header)
    agent_paths = [configs / f"agent-{i}.toml" for i in range(len(agent_docs))]
    for path, doc in zip(agent_paths, agent_docs):
        write_toml(path, doc, header=header)
    return server_path, agent_paths


def check_server_config(path: Path) -> None:
    """Build the server step from the written config, as the server will (on the CPU):
    a bad ``--set`` or launcher table fails here, before any process starts."""
    from .assemble import build_server_method
    from .config import ServerConfig

    build_server_method(ServerConfig.from_dict(read_toml(path)), device="cpu")


def metrics_banner(server_cfg: Path, agent_cfgs: list[Path]) -> str | None:
    """Where ``--metrics`` serves the status page and every process's metrics, from the
    configs as written (``--set`` included); None when the server's metrics are off."""
    server = read_toml(server_cfg)["server"]
    if not server.get("metrics_address"):
        return None

    def url(table: dict) -> str:
        address = MetricsAddress.parse(table["metrics_address"])
        host = "127.0.0.1" if address.host in ("0.0.0.0", "::") else address.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if table.get('metrics_cert_file') else 'http'}://{host}:{address.port}/"

    agents = [read_toml(path)["agent"] for path in agent_cfgs]
    agent_urls = ", ".join(f"{a['agent_id']} {url(a)}metrics" for a in agents if a.get("metrics_address"))
    return (f"edgesplit: status page on {url(server)} (Prometheus metrics at {url(server)}metrics)"
            + (f"; agents' metrics: {agent_urls}" if agent_urls else ""))


_RUN_DIRS = ("agent-state", "checkpoint", "logs", "configs", "broker", "audit")
_RUN_FILES = ("report.json", "rounds.csv", "summary.md", "*.png")


def clear_previous_run(out: Path) -> bool:
    """Remove a previous run's files from ``out`` (True if there was one). `edgesplit local`
    always starts afresh (`cloud-server run --resume` continues a run): an old agent's log or
    plot left beside a new report would be read as this run's. Other files are left alone."""
    if not ((out / "report.json").exists() or (out / "checkpoint").exists()):
        return False
    for name in _RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    for pattern in _RUN_FILES:
        for path in out.glob(pattern):
            path.unlink()
    return True
