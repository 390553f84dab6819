"""docs/: every top-level page stays a readable length, and every relative link in README.md and
docs/**/*.md resolves to a file and, for ``#anchor``s, to a heading GitHub would give that id."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_PAGE_LINES = 450

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`+[^`]*?`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The id GitHub gives a heading: its rendered text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"[`*]", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading id of a Markdown page, repeated headings numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    ids = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(2))
        ids.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return ids


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not EXTERNAL.match(target)]


def broken(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) does not resolve, or None."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    if not dest.exists():
        return f"{shown} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{shown} has no heading with id #{anchor}"
    return None


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_top_level_page_is_under_the_line_limit(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines < MAX_PAGE_LINES, f"{page.name} has {lines} lines; split it or move detail to docs/notes/"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = [f"{target}: {why}" for target in relative_links(page) if (why := broken(page, target))]
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_slug_matches_github() -> None:
    assert slug('Int8 products: `quantization="w8a8"`') == "int8-products-quantizationw8a8"
    assert slug("Over HTTP (`--base-url`)") == "over-http---base-url"
    assert slug("A tile's shared keys on the bfloat16 dot products") == "a-tiles-shared-keys-on-the-bfloat16-dot-products"
    assert slug("`paged top`") == "paged-top"


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Title\n\n[a](#title-1) [b](#nowhere) [c](missing.md) `[d](x.md)`\n")
    assert [t for t in relative_links(page) if broken(page, t)] == ["#nowhere", "missing.md"]
