"""The report as one self-contained HTML page (``index.html`` in --out's directory): the summary,
every table with its caption, notes, membership changes (runs that lost workers) and plots, and
the problems list.

Everything is in the one file: the plots as base64 PNG data URIs, the style sheet inline, no
script and nothing fetched (its Content-Security-Policy forbids it), so the page can be mailed,
archived or opened from any folder.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from relaympi.report.format import Problem
from relaympi.report.tables import Table

PAGE_NAME = "index.html"
PAGE_TITLE = "relaympi report"
# no request leaves the page: images from data: URIs, style from the page itself
_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 84rem; padding: 0 1rem; color: #1b1b1b; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.2rem; margin-top: 2.5rem; border-bottom: 1px solid #ccc; }
.summary { color: #444; }
nav ol { columns: 2; font-size: 0.9rem; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
/* a table wider than the window scrolls on its own, not the page, and keeps its first column (the
   row's algorithm) in place, so every cell stays next to the row it belongs to */
.scroll { overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top;
         white-space: nowrap; background: #fff; }
th { background: #f2f2f2; }
tbody tr:nth-child(even) td { background: #fafafa; }
.scroll th:first-child, .scroll td:first-child { position: sticky; left: 0;
                                                 box-shadow: inset -1px 0 #999; }
td.diverged { color: #888; }
.caption { font-size: 0.85rem; color: #333; max-width: 60rem; }
.notes { font-size: 0.85rem; color: #8a4b00; }
h3 { font-size: 0.95rem; margin-bottom: 0.2rem; }
.membership { font-size: 0.85rem; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.8rem; color: #666; }
.problems td { white-space: normal; overflow-wrap: anywhere; }
.problems td:first-child { font-family: ui-monospace, monospace; }
"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _cell(text: str) -> str:
    kind = ' class="diverged"' if text.startswith("diverged") else ""
    return f"<td{kind}>{escape(text)}</td>"


def _table(table: Table, plots: Sequence[Path]) -> list[str]:
    out = [
        f'<section id="{escape(table.name)}">',
        f"<h2>{escape(table.title)}</h2>",
        '<div class="scroll">',
        "<table>",
        "<thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in table.header) + "</tr></thead>",
        "<tbody>",
        *["<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in table.rows],
        "</tbody>",
        "</table>",
        "</div>",
        f'<p class="caption">{escape(table.caption)}</p>',
    ]
    if table.notes:
        out += ['<ul class="notes">', *[f"<li>{escape(n)}</li>" for n in table.notes], "</ul>"]
    if table.changes:  # the plots mark them too: a dotted vertical line at each change's epoch
        out += [
            f"<h3>Membership changes ({len(table.changes)})</h3>",
            '<ul class="membership">',
            *[f"<li>{escape(change)}</li>" for change in table.changes],
            "</ul>",
        ]
    for path in plots:
        out += [
            "<figure>",
            f'<img src="{_data_uri(path)}" alt="{escape(path.stem)}">',
            f"<figcaption>{escape(path.name)}</figcaption>",
            "</figure>",
        ]
    out.append("</section>")
    return out


def _problems(problems: Sequence[Problem]) -> list[str]:
    if not problems:
        return []
    return [
        '<section id="problems">',
        f"<h2>Problems ({len(problems)} file(s) not in the tables)</h2>",
        '<table class="problems">',
        "<thead><tr><th>File</th><th>Problem</th></tr></thead>",
        "<tbody>",
        *[
            f"<tr><td>{escape(str(path))}</td><td>{escape(reason)}</td></tr>"
            for path, reason in problems
        ],
        "</tbody>",
        "</table>",
        "</section>",
    ]


def html_page(
    tables: Sequence[Table],
    problems: Sequence[Problem],
    summary: str,
    plots: Mapping[str, Sequence[Path]] | None = None,
) -> str:
    """The page: ``summary`` (the report's first line), a contents list, every table with its
    ``plots`` (table name -> PNG files, inlined), and the problems."""
    plots = plots or {}
    contents = [f'<li><a href="#{escape(t.name)}">{escape(t.title)}</a></li>' for t in tables]
    if problems:
        contents.append(f'<li><a href="#problems">Problems ({len(problems)})</a></li>')
    body = [
        f"<h1>{PAGE_TITLE}</h1>",
        f'<p class="summary">{escape(summary)}</p>',
        *(["<nav><ol>", *contents, "</ol></nav>"] if contents else []),
    ]
    for table in tables:
        body += _table(table, plots.get(table.name, ()))
    body += _problems(problems)
    head = [
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>{PAGE_TITLE}</title>",
        f"<style>{_STYLE}</style>",
    ]
    lines = ["<!DOCTYPE html>", '<html lang="en">', "<head>", *head, "</head>", "<body>"]
    return "\n".join([*lines, *body, "</body>", "</html>"]) + "\n"


def write_page(
    tables: Sequence[Table],
    problems: Sequence[Problem],
    summary: str,
    out_dir: Path,
    plots: Mapping[str, Sequence[Path]] | None = None,
) -> Path:
    """html_page written to ``out_dir``/index.html."""
    path = out_dir / PAGE_NAME
    path.write_text(html_page(tables, problems, summary, plots), encoding="utf-8")
    return path
