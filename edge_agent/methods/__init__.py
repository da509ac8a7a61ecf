"""Edge steps of each method, registered by name (the module the method's registry entry
names: ``edge_agent/methods/<name>.py`` for the built-in ones)."""

from __future__ import annotations

import importlib

from shared_protocol.registry import method_names, registered_methods

from .base import EdgeMethod, EdgeContext, RoundResult, register_edge_method, registered_edge_methods


def available_methods() -> tuple[str, ...]:
    """Every registered method (:mod:`shared_protocol.registry`: built in and plugins)."""
    return method_names()


KNOWN_METHODS = available_methods()


def get_edge_method(name: str) -> type[EdgeMethod]:
    """The edge step for ``name``, importing the module its registry entry names on first use."""
    methods = registered_edge_methods()
    if name not in methods:
        spec = registered_methods().get(name)
        if spec is not None:
            importlib.import_module(spec.edge)
        methods = registered_edge_methods()
    if name not in methods:
        raise ValueError(f"this agent has no edge step for method {name!r}; available: {sorted(available_methods())}")
    return methods[name]


__all__ = ["EdgeMethod", "EdgeContext", "RoundResult", "available_methods", "get_edge_method", "register_edge_method",
           "KNOWN_METHODS"]
