"""The installed package's version, for ``--version`` of ``edgesplit``, ``cloud-server``
and ``edge-agent``."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["DISTRIBUTION", "add_version_flag", "package_version"]

#: The distribution name of pyproject.toml's ``[project]``.
DISTRIBUTION = "edgesplit"


def package_version() -> str:
    """The installed ``edgesplit``'s version; in a checkout that is not installed, the
    version its pyproject.toml states, marked as such; ``"unknown"`` when neither is there."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        version = tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, ValueError, KeyError):
        return "unknown"
    return f"{version} (not installed: {pyproject.parent})"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``PROG VERSION`` and exit."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the version of edgesplit and exit")
