"""The documentation reads where it is read: the Home page lists every page of the site's nav, and
the built site links its pages as files, so it works opened from disk (file://) as well as served
(a folder link such as `running/` shows a directory listing there, not the page)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

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


def test_the_release_named_is_the_latest_in_changes() -> None:
    """README.md and the Home page name the latest release: the first dated heading of
    docs/changes.md."""
    latest = re.search(r"^## (\d{4}-\d{2}-\d{2})", (DOCS / "changes.md").read_text("utf-8"), re.M)
    assert latest is not None
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    assert re.findall(r"this release \((\d{4}-\d{2}-\d{2})\)", readme) == [latest.group(1)]
    assert re.findall(r"the latest: (\d{4}-\d{2}-\d{2})", home) == [latest.group(1)]


def test_the_site_links_pages_as_files() -> None:
    settings = dict(
        line.split(":", 1)
        for line in MKDOCS.read_text(encoding="utf-8").splitlines()
        if ":" in line
    )
    assert settings.get("use_directory_urls", "").split("#")[0].strip() == "false"


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links += [value for name, value in attrs if name == "href" and value]


@pytest.mark.slow
def test_the_built_site_has_no_folder_links(tmp_path: Path) -> None:
    """Every link between the built pages names an HTML file that the build wrote."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("the docs extra is not installed (bash scripts/setup.sh installs it)")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 404.html is a server's page for a missing address: its links are absolute, on purpose
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert {p.name for p in pages} >= {
        Path(page).with_suffix(".html").name for page in _nav_pages()
    }
    bad: list[str] = []
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for link in parser.links:
            if re.match(r"[a-z]+:", link) or link.startswith("#"):
                continue  # another site, or a place on this page
            path = link.split("#")[0].split("?")[0]
            if path.endswith("/") or path in (".", "..") or not (page.parent / path).is_file():
                bad.append(f"{page.relative_to(site)}: {link}")
    assert not bad, bad[:20]
