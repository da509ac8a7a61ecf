"""Message types of each method, one module per method, and each method's registry entry.

A method's module registers its message types and its :class:`~shared_protocol.registry.MethodSpec`
on import; :mod:`shared_protocol.registry` imports every module here to find the built-in
methods, so nothing lists them and adding one touches no other method's files.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..registry import registered_methods


def load_method_messages(method: str) -> tuple[ModuleType, ...]:
    """Import the modules holding ``method``'s message types (registers them); () for a
    method this process does not know (the caller says what is missing)."""
    spec = registered_methods().get(method)
    if spec is None:
        return ()
    return tuple(importlib.import_module(module) for module in spec.messages)
