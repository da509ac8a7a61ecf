"""The edge agent, by its public names: :class:`EdgeAgent` and its exit codes and errors
(:mod:`.core`), and this agent's data as its config describes it (:mod:`.data`)."""

from __future__ import annotations

from .core import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_REFUSED,
    SERVER_ID,
    EdgeAgent,
    RequestTimeoutError,
    RoundInterruptedError,
    RoundRestartedError,
)
from .data import agent_data_spec, load_agent_data, shards_as_configured

__all__ = [
    "EXIT_CONFIG", "EXIT_OK", "EXIT_REFUSED", "SERVER_ID", "EdgeAgent", "RequestTimeoutError", "RoundInterruptedError",
    "RoundRestartedError", "agent_data_spec", "load_agent_data", "shards_as_configured",
]
