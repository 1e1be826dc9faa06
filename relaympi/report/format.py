"""Render report tables as text, Markdown, CSV or LaTeX."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path

from relaympi.report.tables import Table

FORMATS = ("text", "markdown", "csv", "latex")
Problem = tuple[Path, str]


def _text_table(table: Table) -> str:
    widths = [
        max(len(row[i]) for row in [table.header, *table.rows]) for i in range(len(table.header))
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) for cell, width in zip(cells, widths, strict=True)
        ).rstrip()

    out = [table.title, "=" * len(table.title), line(table.header), line(["-" * w for w in widths])]
    out += [line(row) for row in table.rows]
    out += ["", table.caption, *table.notes]
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_table(table: Table) -> str:
    out = [f"### {table.title}", ""]
    out.append("| " + " | ".join(_md_escape(h) for h in table.header) + " |")
    out.append("|" + "|".join("---" for _ in table.header) + "|")
    out += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in table.rows]
    out += ["", f"*{table.caption}*", *[f"*{note}*" for note in table.notes]]
    return "\n".join(out)


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "\N{DAGGER}": r"\textsuperscript{\dag}",  # LOST_MARK: a cell over the workers that finished
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(c, c) for c in text)


def _latex_cell(text: str) -> str:
    text = latex_escape(text)
    if text.startswith("alpha="):
        return f"$\\alpha={text[len('alpha=') :]}$"
    if text.startswith("diverged"):
        return f"{{\\color{{gray}}{text}}}"
    return text


def latex_table(table: Table) -> str:
    columns = "l l " + " ".join("l" for _ in table.header[2:])
    out = [
        "% " + table.title,
        "\\begin{table}",
        f"\\caption{{{latex_escape(table.title)}. {latex_escape(table.caption)}"
        + "".join(f" {latex_escape(n)}" for n in table.notes)
        + "}",
        f"\\label{{tab:{table.name}}}",
        "\\centering",
        f"\\begin{{tabular}}{{{columns}}}",
        "\\toprule",
        " & ".join(_latex_cell(h) for h in table.header) + " \\\\",
        "\\midrule",
        *[" & ".join(_latex_cell(c) for c in row) + " \\\\" for row in table.rows],
        "\\bottomrule",
        "\\end{tabular}",
        "\\end{table}",
    ]
    return "\n".join(out)


def _csv_value(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return ""
    return "" if value is None else value


def table_csv(table: Table) -> str:
    """The table's long-form records: one line per cell, with mean/min/max/seed counts and lr."""
    fields: list[str] = []
    for record in table.records:
        fields += [k for k in record if k not in fields]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for record in table.records:
        writer.writerow({k: _csv_value(v) for k, v in record.items()})
    return buffer.getvalue()


def render_problems(problems: Sequence[Problem], fmt: str) -> str:
    if not problems:
        return ""
    title = f"Problems ({len(problems)} file(s) not in the tables)"
    if fmt == "markdown":
        return "\n".join([f"### {title}", "", *[f"- `{p}`: {reason}" for p, reason in problems]])
    if fmt == "latex":
        return "\n".join([f"% {title}", *[f"% {p}: {reason}" for p, reason in problems]])
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["path", "problem"])
        writer.writerows([str(p), reason] for p, reason in problems)
        return "# problems\n" + buffer.getvalue()
    return "\n".join([title, "=" * len(title), *[f"  {p}: {reason}" for p, reason in problems]])


def render(tables: Sequence[Table], problems: Sequence[Problem], fmt: str, summary: str) -> str:
    """The whole report in one format."""
    if fmt == "csv":
        parts = [f"# {t.name}: {t.title}\n{table_csv(t).rstrip()}" for t in tables]
    elif fmt == "markdown":
        parts = [_markdown_table(t) for t in tables]
    elif fmt == "latex":
        parts = [latex_table(t) for t in tables]
    else:
        parts = [_text_table(t) for t in tables]
    comment = {"csv": "# ", "latex": "% "}.get(fmt, "")
    blocks = [comment + summary, *parts]
    problem_block = render_problems(problems, fmt)
    if problem_block:
        blocks.append(problem_block)
    return "\n\n".join(blocks) + "\n"
