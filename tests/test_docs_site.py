"""The documentation reads where it is read: the Home page lists every page of the site's nav."""

from __future__ import annotations

import re

from tests.conftest import ROOT

DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names (docs/-relative), in its order."""
    text = MKDOCS.read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") : text.index("\n\n", text.index("\nnav:"))]
    return re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def test_the_nav_is_every_page() -> None:
    pages = _nav_pages()
    assert "index.md" in pages and len(pages) == len(set(pages))
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_home_page_lists_every_page() -> None:
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", home))
    missing = [page for page in _nav_pages() if page != "index.md" and page not in listed]
    assert not missing, f"docs/index.md's list of pages leaves out {missing}"
