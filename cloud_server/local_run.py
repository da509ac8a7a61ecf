"""What ``edgesplit local`` writes into a run's configs, and the ``--set`` overrides.

Each method owns its table: ``cloud_server/methods/<name>.py`` defines
``launcher_table(options: LocalRunOptions) -> dict``, which maps the launcher's
flags onto the keys of that method's config table. The launcher looks the
function up by the method's name, so adding a method edits no shared file; a
method without one is an error naming what to add, never another method's
table (a silent fallback once gave every new method FedGKT's keys).

``--set TABLE.KEY=VALUE`` then changes any key of the generated files; the
config dataclasses that read them refuse an unknown key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "launcher_table",
    "parse_setting",
]

#: Tables of the files ``edgesplit local`` writes, besides the method's own (named after it).
SERVER_TABLE = "server"
AGENT_TABLES = ("agent", "data")


@dataclass(frozen=True)
class LocalRunOptions:
    """The launcher's flags a method's table may use (typed; no argparse namespace)."""

    method: str
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    train_samples: int = 4000  # the agents' seeded subset of the training set (0 = all)
    test_samples: int = 1000
    seed: int = 0
    mode: str = "sync"  # fedgkt: sync | async
    kd: str = "bidirectional"  # fedgkt: bidirectional | s2e | none
    server_model: str = "resnet55_server"  # split methods: the server's part
    model: str = "resnet56"  # whole-model methods: the model every agent trains
    server_epochs: int = 1
    edge_epochs: int = 1  # local epochs per round (per turn, split learning)
    codec: str | None = None  # None: the method's own default upload codec

    def __post_init__(self) -> None:
        if self.train_samples < 0 or self.test_samples < 0:
            raise ValueError("--train-samples and --test-samples must be >= 0")
        if self.server_epochs < 1 or self.edge_epochs < 1:
            raise ValueError("--server-epochs and --edge-epochs must be >= 1")


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
    """The ``launcher_table`` function of ``cloud_server/methods/<method>.py``."""
    from .methods import get_server_method

    cls = get_server_method(method)  # an unknown method: ValueError listing the known ones
    module = sys.modules[cls.__module__]
    table = getattr(module, "launcher_table", None)
    if not callable(table):
        path = Path(module.__file__ or f"cloud_server/methods/{method}.py").name
        raise MissingLauncherTableError(
            f"method {method!r} has no launcher table: define `def launcher_table(options: LocalRunOptions) -> dict` "
            f"in cloud_server/methods/{path}, returning its [{method}] keys from the launcher's flags "
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
    """``"fedgkt.server_epochs=3"`` -> Setting("fedgkt", "server_epochs", 3).

    The value is read as a TOML value (``3``, ``0.5``, ``true``, ``"raw"``,
    ``["a", "b"]``); a bare word that is not one (``fp16-zstd``) is taken as a
    string, so shell users need not quote codec or model names.
    """
    name, sep, raw = text.partition("=")
    table, dot, key = name.strip().partition(".")
    if not sep or not dot or not table or not key or "." in key:
        raise ValueError(f"--set takes TABLE.KEY=VALUE (e.g. fedgkt.server_epochs=3 or server.round_deadline_s=60), got {text!r}")
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
