"""The report's HTML page (--out DIR writes DIR/index.html): one self-contained file with every
table, plot and problem, loaded in a real headless browser where Chromium is installed."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from relaympi import report
from relaympi.report.html import PAGE_NAME
from tests import run_factories as rf

EVALS = 6
PNG = b"\x89PNG\r\n\x1a\n"


class _Page(HTMLParser):
    """The page's tags and attributes, and the text of its tables' cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.cells: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def all(self, tag: str) -> list[dict[str, str | None]]:
        return [attrs for name, attrs in self.tags if name == tag]


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A report with --out: two algorithms at two alphas on 4 and 8 workers (accuracy, scaling and
    cost tables with their plots), a label that needs escaping, and two files with problems."""
    root = tmp_path_factory.mktemp("html")
    runs = root / "runs"
    for algo, topology in (("relay", "double-binary-trees"), ("d2", "edge-list:/tmp/a<b>&c.txt")):
        for alpha in (1.0, 0.1):
            for n in (4, 8):
                rf.write_classification_run(
                    runs / f"{algo}_{alpha}_{n}.h5",
                    np.linspace(0.2, 0.7, EVALS)[:, None] * np.ones((1, n)),
                    algo=algo,
                    topology=topology,
                    alpha=alpha,
                    costs={"time_s": np.arange(EVALS) * 1.5},
                )
    rf.write_empty_file(runs / "empty.h5")
    rf.write_not_hdf5(runs / "notes.h5")
    out = root / "report"
    assert report.main([str(runs), "--out", str(out)]) == 0
    return out, (out / PAGE_NAME).read_text(encoding="utf-8")


def test_the_page_holds_every_table_plot_and_problem(written: tuple[Path, str]) -> None:
    out, text = written
    page = _parse(text)
    tables = sorted(out.glob("*.csv"))
    plots = sorted(out.glob("*.png"))
    assert len(tables) >= 5 and len(plots) >= 5
    assert len(page.all("table")) == len(tables) + 1  # and the problems
    sections = {attrs["id"] for attrs in page.all("section")}
    assert sections == {p.stem for p in tables} | {"problems"}
    images = page.all("img")
    assert len(images) == len(plots)
    inlined = [base64.b64decode(str(img["src"]).split(",", 1)[1]) for img in images]
    assert {data for data in inlined} == {p.read_bytes() for p in plots}
    assert all(data.startswith(PNG) for data in inlined)
    assert "edge-list:/tmp/a<b>&c.txt" in page.cells  # escaped in the page, itself in the DOM
    assert "empty file (0 bytes)" in page.cells
    assert any(cell.startswith("not an HDF5 file") for cell in page.cells)


def test_the_page_needs_nothing_outside_itself(written: tuple[Path, str]) -> None:
    _, text = written
    page = _parse(text)
    assert not page.all("script") and not page.all("iframe")
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            value = attrs.get(name)
            if value is not None:
                assert value.startswith(("data:", "#")), (tag, name, value[:80])
    assert not [a for a in page.all("link") if a.get("rel") != "icon"]
    (policy,) = [m for m in page.all("meta") if m.get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in str(policy["content"])
    assert "url(" not in text and "@import" not in text


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium to load the page in (Debian: apt-get install chromium)")


def _browse(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        _chromium(),
        "--headless",
        "--disable-gpu",
        "--no-sandbox",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
        page.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_browser_loads_the_page_without_errors(written: tuple[Path, str], tmp_path) -> None:
    out, _ = written
    page = out / PAGE_NAME
    dom = _browse(page, tmp_path, "--dump-dom")
    # Chromium logs every console message (errors, uncaught exceptions, blocked loads) as CONSOLE
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    loaded = _parse(dom.stdout)
    assert len(loaded.all("table")) == len(list(out.glob("*.csv"))) + 1
    assert len(loaded.all("img")) == len(list(out.glob("*.png")))
    assert all(str(img["src"]).startswith("data:image/png;base64,") for img in loaded.all("img"))
    assert "edge-list:/tmp/a<b>&c.txt" in loaded.cells

    shot = tmp_path / "page.png"
    _browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,4000")
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.shape == (4000, 1280)
    # the page drew something: text, table rules and plots, not a blank or an error page
    assert (pixels < 128).mean() > 0.005


# Measures the page as laid out: the page's own width, and for each table whether it fits its box,
# else whether its first column stays in place when the table is scrolled to its right end.
_MEASURE = """<script>
var out = {page: document.documentElement.scrollWidth, window: window.innerWidth, tables: []};
document.querySelectorAll("table").forEach(function (table) {
  var box = table.parentElement, first = table.querySelector("tbody td");
  var row = {name: table.closest("section").id, fits: box.scrollWidth <= box.clientWidth};
  if (!row.fits) {
    box.scrollLeft = box.scrollWidth;
    var moved = first.getBoundingClientRect().left - box.getBoundingClientRect().left;
    row.pinned = Math.abs(moved) < 1;
  }
  out.tables.push(row);
});
var pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


@pytest.mark.slow
def test_every_table_fits_a_1400_pixel_window(written: tuple[Path, str], tmp_path) -> None:
    """No sideways scrolling of the page: a table wider than the window scrolls inside its own box,
    and its first column (the row's algorithm) stays in place. The copy measured here drops the
    page's Content-Security-Policy, which forbids the measuring script, and nothing else."""
    _, text = written
    measured = tmp_path / "measured.html"
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text)
    measured.write_text(page.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = _browse(measured, tmp_path, "--window-size=1400,900", "--dump-dom").stdout
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom)
    assert found, dom[-2000:]
    layout = json.loads(html.unescape(found.group(1)))
    assert layout["window"] == 1400 and layout["page"] <= layout["window"], layout
    wide = [t for t in layout["tables"] if not t["fits"]]
    assert wide, "the cost tables of this report are wider than the window: the case to check"
    assert all(t["pinned"] for t in wide), wide
