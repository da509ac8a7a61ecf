"""A server from its config: ``ServerConfig`` -> the method's server step -> the coordinator.

The one place that wires these together, for ``cloud-server run``, the
launcher's config check, the benchmarks and the tests, so that a change to how
a method is built (its context, its device) is made once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import ServerConfig

if TYPE_CHECKING:
    from shared_protocol.transport import Transport

    from .coordinator import Coordinator
    from .methods.base import ServerMethod

__all__ = ["build_server", "build_server_method", "resolve_device"]


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` where CUDA is available, else ``cpu``; a CUDA device on a machine
    without CUDA is a ValueError (rather than a crash at the first tensor)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    return name


def build_server_method(config: ServerConfig, device: str | None = None, progress: bool = False) -> "ServerMethod":
    """The server step of ``config.method``, configured by ``config.method_config``
    (the method's config class refuses unknown keys and bad values with ValueError)."""
    from .methods import get_server_method

    ctx = config.method_context(resolve_device(device or config.device), progress=progress)
    return get_server_method(config.method)(ctx, config.method_config)


def build_server(
    config: ServerConfig, transport: "Transport | None" = None, device: str | None = None, progress: bool = False
) -> "Coordinator":
    """The coordinator running ``config``'s method over ``transport`` (default: MQTT to
    ``config.broker_url``), the method on ``device`` (default: ``config.device``)."""
    from shared_protocol.transport import MqttTransport

    from .coordinator import Coordinator

    method = build_server_method(config, device, progress)
    return Coordinator(config, method, transport if transport is not None else MqttTransport(config.transport_config()))
