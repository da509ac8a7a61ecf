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

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared_protocol.registry import LauncherFlag, get_method, registered_methods

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "LocalRunOptions",
    "MissingLauncherTableError",
    "Setting",
    "apply_settings",
    "get_launcher_table",
    "launcher_flags",
    "launcher_table",
    "parse_setting",
]

#: Tables of the files ``edgesplit local`` writes, besides the method's own (named after it).
SERVER_TABLE = "server"
AGENT_TABLES = ("agent", "data")


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
    ``[agent]`` and ``[data]``; a setting for any other table is refused here,
    and an unknown key by the config class that reads the file.
    """
    documents = list(documents)
    known = (SERVER_TABLE, method, *AGENT_TABLES)
    for setting in settings:
        if setting.table not in known:
            raise ValueError(f"--set {setting}: no table [{setting.table}] in this run's configs; tables: {', '.join(known)}")
        for doc in documents:
            if setting.table in doc:
                doc[setting.table][setting.key] = setting.value
