"""Server steps of each method, registered by name (``cloud_server/methods/<name>.py``)."""

from __future__ import annotations

import importlib
import pkgutil

from .base import RoundOutcome, ServerContext, ServerMethod, register_server_method, registered_server_methods



def available_methods() -> tuple[str, ...]:
    """Every method module in this package (found on disk; adding a method edits no list)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"))


KNOWN_METHODS = available_methods()


def get_server_method(name: str) -> type[ServerMethod]:
    module = f"{__name__}.{name.replace('-', '_')}"
    if name not in registered_server_methods():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    methods = registered_server_methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; available: {sorted(KNOWN_METHODS)}")
    return methods[name]


__all__ = ["RoundOutcome", "ServerContext", "ServerMethod", "get_server_method", "register_server_method", "KNOWN_METHODS"]
