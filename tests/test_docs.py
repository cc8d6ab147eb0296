"""Guards the documentation: README.md, CHANGELOG.md and every page under docs/.

* every relative link (``[text](target)``, images and reference definitions included, outside
  code blocks and code spans) names a file or directory inside the repository;
* every ``#anchor`` into a markdown file (or into the same page) names one of its headings, by
  GitHub's slug rules (lower case, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped,
  ``-1``, ``-2`` for repeated headings);
* no page points outside the repository (``../shared``, ``/work/shared``, ``ARCHITECTURE.md``):
  the repository's documentation stands on its own;
* README.md stays a front door: at most 250 lines, with the two set-up commands.

The link extractor and the checker are tested on small inputs first, so a broken link is known to
fail the suite rather than slip past a checker that finds nothing.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250
SETUP_COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")
OUTSIDE_REFERENCES = ("../shared", "/work/shared", "ARCHITECTURE.md")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A code span may wrap onto the next line, never across a blank one.
_CODE_SPAN = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)*?(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(
    r"!?\[(?P<text>[^\]]*)\]\(\s*(?P<target><[^>\n]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(?P<target><[^>\n]*>|\S+)", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(?P<text>.*?)(?:[ \t]+#+)?[ \t]*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The pages this module guards, in a stable order."""
    files = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def _outside_fences(markdown: str) -> list[tuple[int, str]]:
    """(index, line) of every line that is not part of a fenced code block."""
    kept: list[tuple[int, str]] = []
    fence: str | None = None
    for index, line in enumerate(markdown.split("\n")):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
        else:
            kept.append((index, line))
    return kept


def prose(markdown: str) -> str:
    """The text with fenced code blocks and code spans blanked out; line numbers are kept."""
    lines = [""] * len(markdown.split("\n"))
    for index, line in _outside_fences(markdown):
        lines[index] = line
    text = "\n".join(lines)
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


@dataclass(frozen=True)
class Link:
    target: str
    line: int


def links(markdown: str) -> list[Link]:
    """Every link target in ``markdown`` outside code, with its 1-based line number."""
    text = prose(markdown)
    found: list[Link] = []
    for match in [*_INLINE_LINK.finditer(text), *_REFERENCE_DEF.finditer(text)]:
        target = match.group("target").strip()
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        found.append(Link(target, text.count("\n", 0, match.start()) + 1))
    return sorted(found, key=lambda link: link.line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of every heading outside code blocks, repeated headings numbered as GitHub does."""
    seen: Counter[str] = Counter()
    result: set[str] = set()
    for _, line in _outside_fences(markdown):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group("text"))
        result.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return result


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of ``page``, one line per broken link."""
    markdown = page.read_text(encoding="utf-8")
    problems: list[str] = []
    where = page.relative_to(root)
    for link in links(markdown):
        if not link.target or _SCHEME.match(link.target) or link.target.startswith("//"):
            continue  # an external address (http:, mailto:), not this repository's business
        path_part, _, anchor = link.target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            target = page
        elif path_part.startswith("/"):
            target = root / path_part.lstrip("/")
        else:
            target = page.parent / path_part
        normal = Path(os.path.normpath(target))
        if normal != root and root not in normal.parents:
            problems.append(f"{where}:{link.line}: {link.target} leaves the repository")
            continue
        if not normal.exists():
            problems.append(f"{where}:{link.line}: {link.target}: no such file or directory")
            continue
        is_page = normal.is_file() and normal.suffix == ".md"
        if anchor and is_page and unquote(anchor) not in anchors(normal.read_text(encoding="utf-8")):
            problems.append(f"{where}:{link.line}: {link.target}: no heading with anchor #{anchor}")
    return problems


# -- the checker itself ---------------------------------------------------------------------------


def test_links_are_found_in_prose_and_not_in_code() -> None:
    sample = (
        "See [the design](docs/design.md#2-topology) and ![a plot](../x.png \"title\").\n"
        "A [wrapped\nlink](a/b.md) and `[not a link](inside/code.md)`, `a span\n"
        "wrapped [not a link](wrapped/code.md)` too.\n"
        "```bash\n"
        "echo [not a link](fenced.md)\n"
        "```\n"
        "[ref]: <docs/with space.md>\n"
        "Outside: [web](https://example.org) and [here](#top).\n"
    )
    assert [(link.target, link.line) for link in links(sample)] == [
        ("docs/design.md#2-topology", 1),
        ("../x.png", 1),
        ("a/b.md", 2),
        ("docs/with space.md", 8),
        ("https://example.org", 9),
        ("#top", 9),
    ]


def test_slugs_follow_githubs_rules() -> None:
    assert slug("8. Failure model") == "8-failure-model"
    assert slug("Sharing the tier across nodes") == "sharing-the-tier-across-nodes"
    assert slug("LMCache's two CPU transports, side by side") == "lmcaches-two-cpu-transports-side-by-side"
    assert slug("L1 is a window (`serving/l1_streaming.py`)") == "l1-is-a-window-servingl1_streamingpy"
    assert slug("See [Security](security.md)") == "see-security"
    text = "# Top\n## Notes\n```\n# not a heading\n```\n## Notes\n### Why? #\n"
    assert anchors(text) == {"top", "notes", "notes-1", "why"}


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n"
        "[fine](other.md#a-section) [fine too](other.md) [self](#page) [dir](../docs/)\n"
        "[gone](missing.md)\n"
        "[bad anchor](other.md#no-such-section)\n"
        "[bad self anchor](#nowhere)\n"
        "[outside](../../elsewhere.md)\n",
        encoding="utf-8",
    )
    assert broken_links(page, tmp_path) == [
        "docs/page.md:3: missing.md: no such file or directory",
        "docs/page.md:4: other.md#no-such-section: no heading with anchor #no-such-section",
        "docs/page.md:5: #nowhere: no heading with anchor #nowhere",
        "docs/page.md:6: ../../elsewhere.md leaves the repository",
    ]


# -- the repository's pages -----------------------------------------------------------------------

PAGES = doc_files()


def test_the_guarded_pages_are_there() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CHANGELOG.md"} <= names
    assert any(name.startswith("docs/") for name in names)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_points_outside_the_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert [ref for ref in OUTSIDE_REFERENCES if ref in text] == []


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in SETUP_COMMANDS:
        assert command in text, f"README.md lacks the set-up command {command!r}"
