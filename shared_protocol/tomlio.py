"""Reading TOML (stdlib ``tomllib``) and writing the small flat TOML files the
launcher and key tools generate (tables of scalars and lists)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(doc: dict[str, dict[str, Any]], header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()] + ([""] if header else [])
    for table, values in doc.items():
        lines.append(f"[{table}]")
        lines.extend(f"{k} = {_value(v)}" for k, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def write_toml(path: str | Path, doc: dict[str, dict[str, Any]], header: str = "") -> None:
    Path(path).write_text(dumps_toml(doc, header))


def read_secret(path: str) -> str:
    """A password from a file (configs reference secrets by path; they never hold them)."""
    try:
        return open(os.path.expanduser(path)).read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read password_file {path}: {exc.strerror}") from None
