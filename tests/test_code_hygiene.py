"""Comments and docstrings cite no issue numbers: an issue is closed and renumbered long
before the code it shaped is read; the comment says why in words instead, and points to the
results file or doc that holds the evidence.

Only comments (tokenize's COMMENT tokens, less tool directives such as ``# noqa``) and
docstrings (a module's, class's or function's first statement) are read: string literals that
render text, hex colours in CSS and format specs such as ``{flags:#04x}`` are code, not prose.

Measured figures (accuracies, timings, megabytes quoted as evidence) belong to the results JSONs
too, but no check of them is precise enough to keep: the same shapes are computed sizes
(``(64, 64, 32, 32)`` fp32 is a fixed number of bytes), papers' printed figures, example output
and configuration defaults. They are left to review.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from fedhelpers import ROOT

#: The Python trees whose comments and docstrings are read: the packages, the benchmarks, the tests.
TREES = ("shared_protocol", "models", "fldata", "edge_agent", "cloud_server", "deploy", "bench", "tests")

#: The word issue (or issues), an optional hash and a number (the first number is enough to flag it).
ISSUE_WORD = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
#: A hash and digits standing alone, bare or in brackets. Not a URL's fragment (``page#N``),
#: an HTML entity (``&#39;``), a colour or format spec after ``:``/``=``/a quote (``color:#222``,
#: ``{x:#04x}``), nor hex (``#12ab``).
ISSUE_HASH = re.compile(r"(?<![\w&/#:=\"'])#\d+(?![\w])")
#: Comments that are directives to a tool, not prose.
DIRECTIVE = re.compile(r"#\s*(noqa|type:|pragma|pylint:|fmt:|isort:|mypy:)")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment (leading ``#`` marks stripped) and docstring line of ``source``."""
    texts: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not DIRECTIVE.match(tok.string):
            texts.append((tok.start[0], tok.string.lstrip("#:").strip()))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                texts.extend((doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines()))
    return texts


def issue_references(source: str) -> list[tuple[int, str]]:
    """(line, the reference) of every issue number cited in ``source``'s comments and docstrings."""
    found = []
    for line, text in prose(source):
        for match in (*ISSUE_WORD.finditer(text), *ISSUE_HASH.finditer(text)):
            found.append((line, match.group(0)))
    return sorted(found)


def _python_files() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if "golden" not in p.parts)


def test_no_comment_or_docstring_cites_an_issue_number() -> None:
    files = _python_files()
    assert len(files) > 100  # the trees were found
    cited = [f"{path.relative_to(ROOT)}:{line}: {ref!r}" for path in files for line, ref in issue_references(path.read_text())]
    assert cited == [], "say why in words and point to the results file or doc instead:\n" + "\n".join(cited)


PLANTED = '''"""A module (issue 26 asked for it)."""
x = 1  # the fix of #41
def f() -> None:
    """Issue #12's case."""
# See issues 9 and 12.
'''

INNOCENT = '''"""Styles: body{color:#222} and fill="#777"; flags {flags:#04x}; see docs/a.md#12-b and page#3."""
COLOUR = "#222"  # noqa: E501
LABEL = "issue 7 of the magazine"
y = 2  # type: ignore[assignment]
def g() -> None:
    """The issue's target; tissue 4 is not an issue number either; &#39; is an entity; #ab12 is hex."""
# the 3rd issue of a series, an issue-free line
'''


def test_the_check_finds_planted_issue_numbers() -> None:
    found = issue_references(PLANTED)
    assert sorted({line for line, _ in found}) == [1, 2, 4, 5]
    assert {"issue 26", "#41", "Issue #12", "issues 9"} <= {ref for _, ref in found}


def test_the_check_passes_colours_urls_directives_and_string_literals() -> None:
    assert issue_references(INNOCENT) == []


@pytest.mark.parametrize("planted", ["# (issue 3)", "# cf. #3", '"""ISSUE 3"""', "# issues #3, #4"])
def test_a_planted_file_fails_the_tree_check(tmp_path: Path, planted: str) -> None:
    path = tmp_path / "planted.py"
    path.write_text(f"{planted}\nx = 1\n")
    assert issue_references(path.read_text()) != []
