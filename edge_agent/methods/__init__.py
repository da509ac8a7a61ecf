"""Edge steps of each method, registered by name (``edge_agent/methods/<name>.py``)."""

from __future__ import annotations

import importlib
import pkgutil

from .base import EdgeMethod, EdgeContext, RoundResult, register_edge_method, registered_edge_methods



def available_methods() -> tuple[str, ...]:
    """Every method module in this package (found on disk; adding a method edits no list)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"))


KNOWN_METHODS = available_methods()


def get_edge_method(name: str) -> type[EdgeMethod]:
    """The edge step for ``name``, importing its module on first use."""
    methods = registered_edge_methods()
    if name not in methods:
        try:
            importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name.replace('-', '_')}":
                raise
        methods = registered_edge_methods()
    if name not in methods:
        raise ValueError(f"this agent has no edge step for method {name!r}; available: {sorted(KNOWN_METHODS)}")
    return methods[name]


__all__ = ["EdgeMethod", "EdgeContext", "RoundResult", "get_edge_method", "register_edge_method", "KNOWN_METHODS"]
