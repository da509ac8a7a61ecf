"""One job per file (issue 28): no Python module in the packages is over 400 lines.

A module that grows past the limit is split along its seams (see how
shared_protocol/transport.py became transport_interface, mqtt_* and
memory_transport), not given an exception here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cloud_server", "edge_agent", "shared_protocol", "fldata", "models")
MAX_LINES = 400

# Files still over the limit, each to be split: cloud_server/server_step.py (its split moves
# names its test monkeypatches) and cloud_server/robust.py (the direction check is being added
# to it on branch robust-dir). Every entry must still exist and still be over the limit, so an
# entry goes as soon as its file is split.
KNOWN_OVER_LIMIT: frozenset[str] = frozenset({
    "cloud_server/server_step.py",
    "cloud_server/robust.py",
})


def line_count(path: Path) -> int:
    """Lines as ``wc -l`` counts them (a last line without a newline counts too)."""
    return len(path.read_text().splitlines())


def modules_over(limit: int, root: Path, packages: tuple[str, ...]) -> dict[str, int]:
    return {
        str(source.relative_to(root)): n
        for package in packages
        for source in sorted((root / package).rglob("*.py"))
        if (n := line_count(source)) > limit
    }


def test_no_module_is_over_the_limit() -> None:
    over = modules_over(MAX_LINES, ROOT, PACKAGES)
    unexpected = {path: n for path, n in over.items() if path not in KNOWN_OVER_LIMIT}
    assert unexpected == {}, f"modules over {MAX_LINES} lines: split them along their seams"


@pytest.mark.parametrize("path", sorted(KNOWN_OVER_LIMIT))
def test_each_known_exception_is_still_needed(path: str) -> None:
    source = ROOT / path
    assert source.is_file(), f"{path} is gone: remove it from KNOWN_OVER_LIMIT"
    assert line_count(source) > MAX_LINES, f"{path} is within {MAX_LINES} lines now: remove it from KNOWN_OVER_LIMIT"


def test_the_check_sees_a_module_over_the_limit(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "small.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "sub" / "big.py").write_text("x = 1\n" * MAX_LINES + "y = 2")  # no newline at the end
    assert modules_over(MAX_LINES, tmp_path, ("pkg",)) == {"pkg/sub/big.py": MAX_LINES + 1}
