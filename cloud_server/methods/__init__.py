"""Server steps of each method, registered by name (the module the method's registry
entry names: ``cloud_server/methods/<name>.py`` for the built-in ones)."""

from __future__ import annotations

import importlib

from shared_protocol.registry import method_names, registered_methods

from .base import (AnswersUploads, RoundOutcome, ServerContext, ServerMethod, StreamedUploads, register_server_method,
                   registered_server_methods)


def available_methods() -> tuple[str, ...]:
    """Every registered method (:mod:`shared_protocol.registry`: built in and plugins)."""
    return method_names()


KNOWN_METHODS = available_methods()


def get_server_method(name: str) -> type[ServerMethod]:
    """The server step of ``name``, importing the module its registry entry names on first use."""
    if name not in registered_server_methods():
        spec = registered_methods().get(name)
        if spec is None:
            raise ValueError(f"unknown method {name!r}; available: {sorted(available_methods())}")
        importlib.import_module(spec.server)
    methods = registered_server_methods()
    if name not in methods:
        raise ValueError(f"method {name!r}: importing {registered_methods()[name].server} registered no server step "
                         f"named {name!r} (@register_server_method on a ServerMethod with name = {name!r})")
    return methods[name]


__all__ = ["AnswersUploads", "KNOWN_METHODS", "RoundOutcome", "ServerContext", "ServerMethod", "StreamedUploads",
           "available_methods", "get_server_method", "register_server_method"]
