"""The method registry: what each method is made of, declared once by the method.

A method registers a :class:`MethodSpec` in its own message module
(``shared_protocol/methods/<name>.py``, torch-free, so that a torch-free agent and
``edgesplit local --help`` can read it): where its server step and edge step are,
which modules hold its message types, the ``edgesplit local`` flags its launcher
table reads and the non-torch backends that implement its edge step. Every shared
part reads the spec: the coordinator and the agent import the steps it names, the
launcher adds its flags, the benchmarks' ``"*"`` grids and the results renderer list
it. How a benchmark runs a method is the experiment file's (``bench/experiments/``),
not the method's. No shared module names a method; :data:`DEFAULT_METHOD` is the one default.

Methods are found, without a list anywhere:

- built in: every module of :mod:`shared_protocol.methods` is imported, and the
  specs they register are the built-in methods;
- elsewhere: every module named in the ``EDGESPLIT_METHODS`` environment variable
  (comma-separated, importable from ``sys.path``) and every entry point of the
  ``edgesplit.methods`` group is imported the same way, so a method in a package of
  its own is found by every process of a run (they inherit the environment).

A duplicate name is a ``ValueError`` at registration.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = [
    "DEFAULT_METHOD",
    "PLUGINS_ENV",
    "LauncherFlag",
    "MethodSpec",
    "get_method",
    "load_method_messages",
    "method_names",
    "register_method",
    "registered_methods",
]

#: What a server config that names no method runs, and ``edgesplit local``'s default.
DEFAULT_METHOD = "fedgkt"
#: Modules (comma-separated) to import for methods that live outside this repository.
PLUGINS_ENV = "EDGESPLIT_METHODS"
#: The entry-point group an installed package declares its method modules in.
ENTRY_POINT_GROUP = "edgesplit.methods"

_SCALARS: dict[str, type] = {"str": str, "int": int, "float": float}


@dataclass(frozen=True)
class LauncherFlag:
    """One ``edgesplit local`` flag a method's launcher table reads (``options.flags[dest]``).

    Several methods may declare the same flag (``--codec``): the launcher adds it once,
    with every declaring method's help, and their defaults, types and choices must agree.
    """

    name: str  # "--server-model"
    default: Any
    help: str  # what the flag means for this method; the launcher prefixes the method's name
    type: str = "str"  # str | int | float
    choices: tuple[Any, ...] = ()
    minimum: float | None = None  # the smallest value allowed (numbers)

    def __post_init__(self) -> None:
        if not self.name.startswith("--") or len(self.name) < 3:
            raise ValueError(f"a launcher flag is named like --server-model, got {self.name!r}")
        if self.type not in _SCALARS:
            raise ValueError(f"{self.name}: type must be one of {sorted(_SCALARS)}, got {self.type!r}")

    @property
    def dest(self) -> str:
        """The key in ``LocalRunOptions.flags``: ``--server-model`` -> ``server_model``."""
        return self.name[2:].replace("-", "_")

    @property
    def parse(self) -> Callable[[str], Any]:
        return _SCALARS[self.type]

    def check(self, value: Any) -> None:
        """ValueError naming the flag when ``value`` is out of its range or choices."""
        if value is None:
            return
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {' | '.join(map(str, self.choices))}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name} must be >= {self.minimum:g}, got {value!r}")

    def same_as(self, other: LauncherFlag) -> bool:
        """Whether two declarations of a flag are one flag (everything but the help agrees)."""
        return (self.name, self.default, self.type, self.choices, self.minimum) == (
            other.name, other.default, other.type, other.choices, other.minimum)


@dataclass(frozen=True)
class MethodSpec:
    """What a method is made of. Module names are strings: the registry imports nothing of
    a method but the module that declares it, so reading it needs neither torch nor a server."""

    name: str
    summary: str  # one line: ``edgesplit local --help`` and the README's table of methods
    server: str  # the module whose import registers the method's ServerMethod
    edge: str  # the module whose import registers the method's torch EdgeMethod
    config: str = ""  # "module:Class": the frozen dataclass that reads its [<name>] table
    messages: tuple[str, ...] = ()  # modules whose import registers its message types (uploads, downloads)
    flags: tuple[LauncherFlag, ...] = ()  # the `edgesplit local` flags its launcher table reads
    backends: Mapping[str, str] = field(default_factory=dict)  # other edge backend -> "module:Class" of its edge step
    docs: str = ""  # its notes, a path in the repository (docs/methods/<name>.md)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"a method's name is lower-case letters, digits, '-' and '_', got {self.name!r}")
        if not self.server or not self.edge:
            raise ValueError(f"method {self.name!r}: a spec names its server step and its edge step modules")
        if self.config and ":" not in self.config:
            raise ValueError(f"method {self.name!r}: config names 'module:Class', got {self.config!r}")
        seen = set()
        for flag in self.flags:
            if flag.name in seen:
                raise ValueError(f"method {self.name!r} declares {flag.name} twice")
            seen.add(flag.name)
        for backend, target in self.backends.items():
            if ":" not in target:
                raise ValueError(f"method {self.name!r}: backend {backend!r} names 'module:Class', got {target!r}")


_METHODS: dict[str, MethodSpec] = {}
_IMPORTED: set[str] = set()  # modules the registry imported to find methods


def register_method(spec: MethodSpec) -> MethodSpec:
    """Register ``spec`` (at import of the module that declares it); a name taken is a ValueError."""
    held = _METHODS.get(spec.name)
    if held is not None and held != spec:
        raise ValueError(f"method {spec.name!r} is already registered")
    _METHODS[spec.name] = spec
    return spec


def _import(module: str) -> None:
    if module not in _IMPORTED:
        importlib.import_module(module)
        _IMPORTED.add(module)


def _plugin_modules() -> list[str]:
    names = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    from importlib.metadata import entry_points

    names += [ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return names


def _load() -> None:
    """Import the built-in method modules and the plugins named now (each once)."""
    from . import methods as builtin

    for info in pkgutil.iter_modules(builtin.__path__):
        _import(f"{builtin.__name__}.{info.name}")
    for module in _plugin_modules():
        _import(module)


def load_method_messages(method: str) -> tuple[ModuleType, ...]:
    """Import the modules holding ``method``'s message types (registers them); () for a
    method this process does not know (the caller says what is missing)."""
    spec = registered_methods().get(method)
    if spec is None:
        return ()
    return tuple(importlib.import_module(module) for module in spec.messages)


def registered_methods() -> dict[str, MethodSpec]:
    """Every method found (built in and plugins), by name, sorted."""
    _load()
    return {name: _METHODS[name] for name in sorted(_METHODS)}


def method_names() -> tuple[str, ...]:
    return tuple(registered_methods())


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``; an unknown name is a ValueError listing the known ones."""
    methods = registered_methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; available: {sorted(methods)}")
    return methods[name]


def import_part(target: str) -> Any:
    """``"package.module:Name"`` -> that object (``"package.module"`` -> the module)."""
    module, _, attr = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded
