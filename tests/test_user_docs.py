"""The user's guides (README, the configuration, deployment, protocol, run report and privacy pages)
quote no measured figure in their prose, which would go stale when a bench is re-measured: figures
live in blocks rendered from the results JSONs, or behind links to the results page, and those
links must lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ("README.md", "docs/configuration.md", "docs/deploy.md", "docs/protocol.md", "docs/report.md", "docs/privacy.md")
#: Blocks rendered from code or from the results JSONs (their renderers' tests keep them current).
GENERATED = (("<!-- The methods' tables:", "<!-- end of the methods' tables -->"),
             ("<!-- The methods: rendered", "<!-- end of the methods -->"),
             ("<!-- defences: rendered", "<!-- end of the defences -->"))
#: A percentage, a size in decimal megabytes, a time in milliseconds, a speed-up.
MEASURED = re.compile(r"\d+(?:\.\d+)?\s?(?:%|MB\b|ms\b|x faster)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(page: str) -> str:
    """The page without fenced code (example output) and without blocks rendered from code."""
    page = re.sub(r"^```.*?^```", "", page, flags=re.M | re.S)
    for begin, end in GENERATED:
        page = re.sub(re.escape(begin) + ".*?" + re.escape(end), "", page, flags=re.S)
    return page


def _anchors(page: str) -> set[str]:
    """GitHub's anchors of the page's headings."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", _without_code(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _without_code(page: str) -> str:
    return re.sub(r"^```.*?^```", "", page, flags=re.M | re.S)


def test_the_figure_pattern_finds_measured_figures() -> None:
    found = MEASURED.findall("peaks at 587 MB, 78.8% accurate, 980 ms a step, 1.36x faster; 64 MiB and 8883")
    assert found == ["587 MB", "78.8%", "980 ms", "1.36x faster"]
    assert _prose("text\n```\n71.3%\n```\nmore") == "text\n\nmore"
    assert _prose("a <!-- defences: rendered x -->\n| 71.8 % |\n<!-- end of the defences --> b") == "a  b"


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guide_quotes_no_measured_figure(guide: str) -> None:
    assert MEASURED.findall(_prose((ROOT / guide).read_text())) == []


def test_anchors_are_githubs() -> None:
    assert _anchors("## `cloud-server run --config server.toml`\n### 4. Check, start, watch\n"
                    "## The agent's memory (issue 16)\n## torch.compile on this CPU (issue 15)\n") == {
        "cloud-server-run---config-servertoml", "4-check-start-watch", "the-agents-memory-issue-16",
        "torchcompile-on-this-cpu-issue-15"}


@pytest.mark.parametrize("guide", GUIDES)
def test_every_link_of_the_guide_leads_to_a_file_and_heading(guide: str) -> None:
    page_path = ROOT / guide
    broken = []
    for target in LINK.findall(_without_code(page_path.read_text())):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (page_path.parent / path).resolve() if path else page_path
        if not file.exists():
            broken.append(target)
        elif anchor and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert broken == []


def test_the_pages_linking_to_the_guides_find_their_headings() -> None:
    """Other docs, README and the programs' messages link to headings of the guides."""
    anchors = {Path(guide).stem: _anchors((ROOT / guide).read_text()) for guide in GUIDES if guide.startswith("docs/")}
    anchors["results"] = _anchors((ROOT / "docs" / "results.md").read_text())  # generated: a section left off breaks links
    sources = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *(ROOT / "shared_protocol").rglob("*.py"),
               *(ROOT / "edge_agent").rglob("*.py"), *(ROOT / "cloud_server").rglob("*.py")]
    broken = []
    for source in sources:
        for name, anchor in re.findall(r"\b(" + "|".join(anchors) + r")\.md#([\w\-]+)", source.read_text()):
            if anchor not in anchors[name]:
                broken.append(f"{source.relative_to(ROOT)}: {name}.md#{anchor}")
    assert broken == []


def _section(page: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = page.index(heading + "\n") + len(heading) + 1
    following = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), page[start:], flags=re.M)]
    return page[start:start + following[0]] if following else page[start:]


def test_the_readmes_demo_section_stays_under_120_words() -> None:
    assert _section("# a\n## b\none two\n### c\nthree\n## d\nfour", "## b").split() == ["one", "two", "###", "c", "three"]
    demo = _section((ROOT / "README.md").read_text(), "## What `make demo` does")
    assert 40 < len(demo.split()) < 120, "README's `make demo` section: keep it short, link to the details"
