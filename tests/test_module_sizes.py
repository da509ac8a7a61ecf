"""One job per file (issue 28): no Python module in the packages is over 400 lines.

A module that grows past the limit is split along its seams (see how
shared_protocol/transport.py became transport_interface, mqtt_* and
memory_transport, or cloud_server/robust.py robust_config, robust_rules,
robust_checks, robust_screening and robust_ledger), not given an exception here.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cloud_server", "edge_agent", "shared_protocol", "fldata", "models")
MAX_LINES = 400

# Files still over the limit, each to be split: none. An entry must name a file that exists
# and is still over the limit, so an entry goes as soon as its file is split.
KNOWN_OVER_LIMIT: frozenset[str] = frozenset()


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


def stale_exceptions(known: frozenset[str], limit: int, root: Path) -> dict[str, str]:
    """The entries of ``known`` that are no longer needed, each with why: its file is gone or
    within ``limit`` lines."""
    stale = {}
    for path in sorted(known):
        source = root / path
        if not source.is_file():
            stale[path] = "gone"
        elif line_count(source) <= limit:
            stale[path] = f"within {limit} lines"
    return stale


def test_no_module_is_over_the_limit() -> None:
    over = modules_over(MAX_LINES, ROOT, PACKAGES)
    unexpected = {path: n for path, n in over.items() if path not in KNOWN_OVER_LIMIT}
    assert unexpected == {}, f"modules over {MAX_LINES} lines: split them along their seams"


def test_each_known_exception_is_still_needed() -> None:
    assert stale_exceptions(KNOWN_OVER_LIMIT, MAX_LINES, ROOT) == {}, "remove these from KNOWN_OVER_LIMIT"


def test_the_check_sees_a_module_over_the_limit(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "small.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "sub" / "big.py").write_text("x = 1\n" * MAX_LINES + "y = 2")  # no newline at the end
    assert modules_over(MAX_LINES, tmp_path, ("pkg",)) == {"pkg/sub/big.py": MAX_LINES + 1}


def test_the_check_sees_a_stale_exception(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "split.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    known = frozenset({"pkg/split.py", "pkg/big.py", "pkg/gone.py"})
    assert stale_exceptions(known, MAX_LINES, tmp_path) == {"pkg/gone.py": "gone", "pkg/split.py": f"within {MAX_LINES} lines"}
