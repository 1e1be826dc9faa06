"""Render report tables as text, Markdown, CSV or LaTeX.

Every string of a table may come from a run file (config values, provenance such as the CPU
model, file names): each format shows it as data. Line-based formats get it on one line (no
control character survives: relaympi.results.text), LaTeX gets it escaped, and a CSV cell that a
spreadsheet would take for a formula starts with a single quote."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path

from relaympi.report.tables import Table
from relaympi.results.text import one_line

FORMATS = ("text", "markdown", "csv", "latex")
Problem = tuple[Path, str]


def _one_line_table(table: Table) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(title, header, rows, caption and notes) of ``table``, each string on one line."""
    return (
        one_line(table.title),
        [one_line(h) for h in table.header],
        [[one_line(c) for c in row] for row in table.rows],
        [one_line(t) for t in (table.caption, *table.notes)],
    )


def _text_table(table: Table) -> str:
    title, header, rows, words = _one_line_table(table)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) for cell, width in zip(cells, widths, strict=True)
        ).rstrip()

    out = [title, "=" * len(title), line(header), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    out += ["", *words]
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_table(table: Table) -> str:
    title, header, rows, (caption, *notes) = _one_line_table(table)
    out = [f"### {title}", ""]
    out.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    out += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    out += ["", f"*{caption}*", *[f"*{note}*" for note in notes]]
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
    """``text`` as LaTeX shows it literally, on one line (a line break could end a comment).

    Args:
        text: any string of a table.

    Returns:
        The string with LaTeX's special characters escaped and control characters as spaces.
    """
    return "".join(_LATEX_SPECIAL.get(c, c) for c in one_line(text))


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
        "% " + one_line(table.title),
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


# what makes a spreadsheet read a cell as a formula (or, after a tab or CR, as the next one's)
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(text: str) -> str:
    """A string as a CSV cell that a spreadsheet shows as text: on one line (Python's csv module
    leaves a lone carriage return unquoted, which would start a row of the string's own), with a
    leading single quote where it would start a formula.

    Args:
        text: any string of a table (numbers are written as numbers, never passed here).

    Returns:
        ``text`` with control characters as spaces, after a ``'`` where it starts with ``=``,
        ``+``, ``-``, ``@``, a tab or a carriage return, also after leading spaces.
    """
    line = one_line(text)
    if text.startswith(_FORMULA_STARTS) or line.lstrip().startswith(_FORMULA_STARTS):
        return "'" + line
    return line


def _csv_value(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return ""
    if isinstance(value, str):
        return csv_text(value)
    return "" if value is None else value


def table_csv(table: Table) -> str:
    """The table's long-form records: one line per cell, with mean/min/max/seed counts and lr."""
    fields: list[str] = []
    for record in table.records:
        fields += [k for k in record if k not in fields]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writerow({k: csv_text(k) for k in fields})
    for record in table.records:
        writer.writerow({k: _csv_value(v) for k, v in record.items()})
    return buffer.getvalue()


def render_problems(problems: Sequence[Problem], fmt: str) -> str:
    if not problems:
        return ""
    title = f"Problems ({len(problems)} file(s) not in the tables)"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["path", "problem"])
        writer.writerows([csv_text(str(p)), csv_text(reason)] for p, reason in problems)
        return "# problems\n" + buffer.getvalue()
    lines = [f"{one_line(str(p))}: {one_line(reason)}" for p, reason in problems]
    if fmt == "markdown":
        lines = [f"`{one_line(str(p))}`: {one_line(reason)}" for p, reason in problems]
        return "\n".join([f"### {title}", "", *[f"- {line}" for line in lines]])
    if fmt == "latex":
        return "\n".join([f"% {title}", *[f"% {line}" for line in lines]])
    return "\n".join([title, "=" * len(title), *[f"  {line}" for line in lines]])


def render(tables: Sequence[Table], problems: Sequence[Problem], fmt: str, summary: str) -> str:
    """The whole report in one format."""
    if fmt == "csv":
        parts = [f"# {t.name}: {one_line(t.title)}\n{table_csv(t).rstrip()}" for t in tables]
    elif fmt == "markdown":
        parts = [_markdown_table(t) for t in tables]
    elif fmt == "latex":
        parts = [latex_table(t) for t in tables]
    else:
        parts = [_text_table(t) for t in tables]
    comment = {"csv": "# ", "latex": "% "}.get(fmt, "")
    blocks = [comment + one_line(summary), *parts]
    problem_block = render_problems(problems, fmt)
    if problem_block:
        blocks.append(problem_block)
    return "\n\n".join(blocks) + "\n"
