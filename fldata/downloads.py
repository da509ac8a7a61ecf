"""What a loader needs beyond numpy and the files at hand: where downloads and caches
go (:func:`default_data_root`), a download that fails quickly and says so
(:class:`DownloadError`), and a clear error for a missing optional package."""

from __future__ import annotations

import importlib.util
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Final, Iterator


def default_data_root() -> Path:
    """Where downloads and caches go: ``$EDGESPLIT_DATA_DIR`` or ``~/.cache/edgesplit/datasets``."""
    env = os.environ.get("EDGESPLIT_DATA_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "edgesplit" / "datasets"


#: Seconds a download may wait for the network before it fails (connect and each read).
DOWNLOAD_TIMEOUT_S: Final[float] = 15.0


@contextmanager
def _network_timeout(seconds: float) -> Iterator[None]:
    """A default socket timeout for torchvision's downloads, which set none of their own:
    without it an offline machine waits on the operating system's TCP timeouts (minutes)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


class DownloadError(OSError):
    """A dataset download was asked for and failed (no network, a timeout, a bad mirror)."""


def _download(what: str, fetch: Callable[[], object]) -> None:
    try:
        with _network_timeout(DOWNLOAD_TIMEOUT_S):
            fetch()
    except (OSError, RuntimeError) as exc:  # urllib's URLError and socket.timeout are OSErrors; torchvision raises RuntimeError
        raise DownloadError(
            f"downloading {what} failed ({exc}); on a machine without a network install the data locally "
            "(Fashion-MNIST: `apt-get install dataset-fashion-mnist`) or point the data root at a copy"
        ) from exc


def _require_module(module: str, purpose: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{purpose} needs the '{module}' package, which is not installed "
            "(pip install 'edgesplit[edge]')"
        )
