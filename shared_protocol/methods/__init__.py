"""Message types of each method, one module per method, imported by name.

A method's module registers its message types on import; nothing here lists
the methods, so adding one touches no other method's files.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load_method_messages(method: str) -> ModuleType | None:
    """Import ``shared_protocol.methods.<method>`` if it exists (registers its types)."""
    name = method.replace("-", "_")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            return None  # a method with no messages of its own (e.g. weights only)
        raise
