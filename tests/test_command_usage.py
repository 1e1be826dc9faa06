"""Every command line answers misuse as the trainer does: one line on stderr, exit 2, a "did you
mean" where a real name is close, and the command that shows the usage (never the usage itself).
Parsed in this process: each case is a parser, not a program start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jobs import grid
from relaympi import report
from relaympi.report.html import PAGE_NAME
from relaympi.results import cli as results_cli
from relaympi.studies.quadratics import __main__ as quadratics
from tests import run_factories as rf

REPORT = "python -m relaympi.report"
RESULTS = "python -m relaympi.results"
STUDIES = "python -m relaympi.studies.quadratics"
GRID = "python -m jobs.grid"


def _refusal(main: Callable[[list[str]], int], argv: list[str], capsys) -> str:
    """The one line ``main(argv)`` prints before it exits 2 (asserted), without its newline."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert "usage:" not in captured.err
    return captured.err.rstrip("\n").replace("'", "")  # quoted choices before Python 3.12.8


# (main, argv, the line's start after "error: ", the guess or None, the command its hint names)
@pytest.mark.parametrize(
    "main, argv, start, guess, prog",
    [
        (report.main, ["--formt", "csv"], "unrecognized arguments: --formt", "--format", REPORT),
        (
            report.main,
            ["--format", "latx"],
            "argument --format: invalid choice: latx",
            "latex",
            REPORT,
        ),
        (
            results_cli.main,
            ["stauts", "a.h5"],
            "argument command: invalid choice: stauts",
            "status",
            RESULTS,
        ),
        (
            results_cli.main,
            ["status", "a.h5", "--zzz"],
            "unrecognized arguments: --zzz",
            None,  # nothing close: no guess
            RESULTS,
        ),
        (
            results_cli.main,
            ["show", "a.h5", "--target-acuracy", "0.8"],
            "unrecognized arguments: --target-acuracy 0.8",
            "--target-accuracy",  # a subcommand's flag
            RESULTS,
        ),
        (
            results_cli.main,
            ["show", "a.h5", "--targt", "0.8"],
            "unrecognized arguments: --targt 0.8",
            "--target-accuracy",  # close to its start, as argparse takes an abbreviation
            RESULTS,
        ),
        (quadratics.main, ["fig3"], "argument study: invalid choice: fig3", "fig2", STUDIES),
        (quadratics.main, ["fig2", "--quik"], "unrecognized arguments: --quik", "--quick", STUDIES),
        (grid.main, ["lst"], "argument command: invalid choice: lst", "list", GRID),
        (
            grid.main,
            ["list", "sweep_alpah"],
            "argument sweep: invalid choice: sweep_alpah",
            "sweep_alpha",
            f"{GRID} list",  # the subcommand's parser refused: its usage is the one to see
        ),
        (
            grid.main,
            ["plan", "sweep_alpha", "--dryrun"],
            "unrecognized arguments: --dryrun",
            "--dry-run",
            GRID,
        ),
    ],
    ids=[
        "report-flag",
        "report-format",
        "results-command",
        "results-no-guess",
        "results-show-flag",
        "results-show-flag-start",
        "study",
        "study-flag",
        "grid-command",
        "grid-sweep",
        "grid-flag",
    ],
)
def test_a_mistyped_name_is_one_line_with_a_guess(main, argv, start, guess, prog, capsys) -> None:
    line = _refusal(main, argv, capsys)
    assert line.startswith(f"error: {start}"), line
    hint = "" if guess is None else f"; did you mean {guess}?"
    assert line.endswith(f"{hint} (see `{prog} --help`)"), line


def test_a_missing_path_and_an_empty_folder_are_both_usage_errors(tmp_path: Path, capsys) -> None:
    missing = _refusal(report.main, [str(tmp_path / "nope")], capsys)
    assert (
        missing == f"error: no such file or directory: {tmp_path / 'nope'} (see `{REPORT} --help`)"
    )
    empty = _refusal(report.main, [str(tmp_path)], capsys)
    assert empty == f"error: no run files (*.h5) under {tmp_path} (see `{REPORT} --help`)"


def test_format_html_prints_the_page_out_writes(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    for seed in (0, 1):
        rf.write_classification_run(
            runs / f"relay_{seed}.h5",
            np.linspace(0.2, 0.7, 6)[:, None] * np.ones((1, 4)),
            seed=seed,
        )
    out = tmp_path / "report"
    assert report.main([str(runs), "--out", str(out), "--no-plots"]) == 0
    written = (out / PAGE_NAME).read_text(encoding="utf-8")
    capsys.readouterr()
    assert report.main([str(runs), "--format", "html", "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert printed == written
    assert printed.startswith("<!DOCTYPE html>") and "<table>" in printed
