"""The report's command line: find the run files, summarize them, print the tables (and write
them with --out). Usage in the package docstring (relaympi/report/__init__.py)."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from relaympi.config import run_file_config_keys
from relaympi.entrypoint import UsageParser
from relaympi.report.cells import RowLabels
from relaympi.report.cost import TARGET_FRACTION, cost_tables
from relaympi.report.format import (
    FORMATS,
    Problem,
    latex_table,
    render,
    render_problems,
    table_csv,
)
from relaympi.report.html import PAGE_NAME, write_page
from relaympi.report.summary import (
    DATASETS,
    ReportSettings,
    RunSummary,
    generated_problems,
    summarize,
)
from relaympi.report.tables import Table, all_tables, untabulated
from relaympi.results import Run, RunFileError
from relaympi.results.bounded import read_memory, read_runs, read_timeout
from relaympi.results.text import console, one_line

PROG = "python -m relaympi.report"


def find_run_files(paths: Iterable[Path]) -> list[Path]:
    """The run files (*.h5) of ``paths``: a file as given, a folder searched to any depth.

    The search keeps its own list of folders to visit, not the call stack (Path.rglob recursed
    once per level: 1,000 nested folders ended it with a RecursionError). A folder reached
    through a symbolic link is not entered (no loops); a folder that cannot be listed is skipped,
    with one warning line where its path is too long to open.

    Args:
        paths: files and folders, as given on the command line.

    Returns:
        The run files found, sorted.
    """
    files: set[Path] = set()
    for path in paths:
        if path.is_file():
            files.add(path)
            continue
        folders = [path]
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(Path(entry.path))
                        elif entry.name.endswith(".h5") and entry.is_file():
                            files.add(Path(entry.path))
            except OSError as error:
                if error.errno == errno.ENAMETOOLONG:
                    print(
                        f"warning: {one_line(str(folder)[:80])}...: path too long to search; "
                        "skipped",
                        file=sys.stderr,
                    )
    return sorted(files)


def _unfinished_reason(run: Run) -> str:
    steps = run.data.get("step")
    epochs = run.data.get("epoch")
    where = ""
    if steps is not None and len(steps):
        where = f", last evaluation at step {int(steps[-1])}"
        if epochs is not None and len(epochs) and np.isfinite(epochs[-1]):
            where += f" (epoch {epochs[-1]:.3g})"
    reason = f"status {run.status}{where}"
    if run.status == "failed" and run.attrs.get("error"):
        reason += f": {str(run.attrs['error']).strip().splitlines()[-1][:200]}"
    return reason


def load_runs(
    files: Sequence[Path], settings: ReportSettings
) -> tuple[list[RunSummary], list[Problem]]:
    """Summaries of finished runs, and (path, reason) for every file left out."""
    runs, _, problems = load_all(files, settings)
    return runs, problems


def load_all(
    files: Sequence[Path], settings: ReportSettings
) -> tuple[list[RunSummary], list[RunSummary], list[Problem]]:
    """(runs for the accuracy tables, runs for the cost tables, problems). A duplicate (same
    configuration and seed) made on other hardware or launch shape stays out of the accuracy
    tables but goes into the cost table of its hardware: its times are a result of their own.

    Each file is read in a worker process with a time limit (relaympi.results.bounded): a file
    too damaged to read in that time is a problem, never a report that does not end."""
    runs: list[RunSummary] = []
    cost_runs: list[RunSummary] = []
    problems: list[tuple[int, Problem]] = []  # with the file's place, to list them in its order
    finished: list[tuple[int, Run]] = []
    for index, (path, run) in enumerate(read_runs(files, datasets=DATASETS)):
        if isinstance(run, RunFileError):
            problems.append((index, (path, run.reason)))
        elif run.status not in ("completed", "diverged"):
            problems.append((index, (path, _unfinished_reason(run))))
        else:
            finished.append((index, run))
    # a quadratics run on a problem file joins the runs that generated that problem
    generated = generated_problems([run for _, run in finished])
    seen: dict[tuple, Path] = {}
    seen_on: set[tuple] = set()
    for index, run in finished:
        path = run.path
        try:
            summary = summarize(run, settings, generated)
        except (ValueError, TypeError, KeyError) as error:
            problems.append((index, (path, f"cannot summarize: {error}")))
            continue
        other_hardware = (summary.identity, summary.hardware) not in seen_on
        if other_hardware:
            seen_on.add((summary.identity, summary.hardware))
            cost_runs.append(summary)
        if summary.identity in seen:
            ignored = (
                "ignored in the accuracy tables, in the cost table of its hardware"
                if other_hardware
                else "ignored"
            )
            problems.append(
                (
                    index,
                    (
                        path,
                        f"duplicate of {seen[summary.identity]} (same configuration"
                        f"{', problem' if summary.problem else ''} and seed); {ignored}"
                        + (
                            "; this run is unstable, so the two may differ beyond rounding"
                            if summary.unstable
                            else ""
                        ),
                    ),
                )
            )
            continue
        seen[summary.identity] = path
        runs.append(summary)
    return runs, cost_runs, [problem for _, problem in sorted(problems, key=lambda p: p[0])]


def write_outputs(
    tables: Sequence[Table],
    problems: Sequence[Problem],
    out_dir: Path,
    plots: bool,
    summary: str = "",
) -> list[Path]:
    """Every table as CSV and LaTeX, the problems, the PNG plots (``plots``) and the whole report
    as one HTML page, index.html (``summary``: its first line), into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, text in ((".csv", table_csv(table)), (".tex", latex_table(table) + "\n")):
            path = out_dir / f"{table.name}{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
    if problems:
        path = out_dir / "problems.txt"
        path.write_text(render_problems(problems, "text") + "\n", encoding="utf-8")
        written.append(path)
    figures: dict[str, list[Path]] = {}
    if plots:
        from relaympi.report.plots import table_plots

        for table in tables:
            figures[table.name] = table_plots(table, out_dir)
            written += figures[table.name]
    written.append(write_page(tables, problems, summary, out_dir, figures))
    return written


def placement_summary(runs: Sequence[RunSummary]) -> str:
    """'; placement: nodes (2 runs), ranks (1 run)': where the runs' topologies put the ranks (rows
    of runs
    that differ in it are told apart as placement=...)."""
    counts = Counter(run.placement for run in runs)
    if not counts:
        return ""
    return "; placement: " + ", ".join(
        f"{name} ({count} run{'s' if count != 1 else ''})" for name, count in sorted(counts.items())
    )


def html_report(
    tables: Sequence[Table],
    problems: Sequence[Problem],
    summary: str,
    out_dir: Path | None,
    plots: bool,
) -> str:
    """The report's HTML page, as --out writes it: read back from ``out_dir`` once written there,
    else written with the rest of --out's files into a temporary directory (its plots are inlined,
    so the page needs none of them afterwards).

    Args:
        tables: the report's tables.
        problems: the files left out, with their reasons.
        summary: the report's first line.
        out_dir: --out's directory, where write_outputs already wrote the page; None: nowhere.
        plots: whether the page shows the tables' plots.

    Returns:
        The page's HTML text.
    """
    if out_dir is not None:
        return (out_dir / PAGE_NAME).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="relaympi-report-") as tmp:
        write_outputs(tables, problems, Path(tmp), plots=plots, summary=summary)
        return (Path(tmp) / PAGE_NAME).read_text(encoding="utf-8")


def _parser(prog: str) -> UsageParser:
    parser = UsageParser(
        prog=prog,
        description="Print the paper's tables from relaympi run files "
        "(*.h5, searched recursively).",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="DIR",
        help="directories (searched recursively) or run files; default: results",
    )
    parser.add_argument(
        "--format",
        choices=(*FORMATS, "html"),
        default="text",
        help="output format (default: text); html: the page --out writes as OUTDIR/index.html",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="OUTDIR",
        help="also write every table as CSV and LaTeX, PNG plots, and the whole report as one "
        "self-contained HTML page (OUTDIR/index.html), into OUTDIR",
    )
    parser.add_argument(
        "--no-plots",
        action="store_true",
        help="with --out or --format html: skip the PNG plots (and the page's)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=1e-6,
        help="quadratics: suboptimality to reach (default: 1e-6)",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        metavar="ACC",
        help="cost tables: the test accuracy (in (0, 1]) whose wall time to reach they show; "
        "default: "
        f"{100 * TARGET_FRACTION:g}%% of all-reduce's accuracy in each table family (of "
        "the best experiment's without all-reduce)",
    )
    parser.add_argument(
        "--last-epochs",
        type=float,
        default=5.0,
        help="accuracy is averaged over the evaluations of the last this many epochs (default: 5)",
    )
    parser.add_argument(
        "--metric",
        choices=("auto", "worst", "mean"),
        default="auto",
        help="worst worker or mean of workers; auto: by task as in the paper (default)",
    )
    parser.add_argument(
        "--split-by",
        action="append",
        default=[],
        metavar="KEY",
        help="a further config key whose values get separate tables (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The report over ``argv`` (default sys.argv[1:]); ``prog`` names the command in its usage."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    paths = args.paths or [Path("results")]
    missing = [p for p in paths if not p.exists()]
    if missing:
        parser.error(f"no such file or directory: {', '.join(map(str, missing))}")
    if not args.target > 0:
        parser.error(f"--target must be positive, got {args.target}")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        parser.error(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
    try:
        read_timeout()
        read_memory()
    except ValueError as error:
        parser.error(str(error))
    if not args.last_epochs > 0:
        parser.error(f"--last-epochs must be positive, got {args.last_epochs}")
    keys = run_file_config_keys()
    unknown = [key for key in args.split_by if key not in keys]
    if unknown:
        parser.error(
            f"--split-by {unknown[0]!r} is not a config key of a run file; choose from "
            f"{', '.join(sorted(keys))}"
        )
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(
            f"--out {args.out} is a file; --out takes a directory for the CSV, LaTeX, PNG and "
            "HTML files"
        )
    settings = ReportSettings(
        last_epochs=args.last_epochs,
        metric=args.metric,
        target=args.target,
        split_by=tuple(args.split_by),
        target_accuracy=args.target_accuracy,
    )

    files = find_run_files(paths)
    if not files:  # as a missing path: nothing to report on, so the paths are the mistake
        parser.error(f"no run files (*.h5) under {', '.join(map(str, paths))}")
    runs, cost_runs, problems = load_all(files, settings)
    diverged = sum(r.status == "diverged" for r in runs)
    labels = RowLabels([*runs, *cost_runs])  # one label per row, in every table and plot
    tables = all_tables(runs, settings, labels)
    left_out = untabulated(runs, tables)
    tables += cost_tables(cost_runs, settings, labels)
    summary = (
        f"{len(files)} run file(s): {len(runs) - diverged} completed, {diverged} diverged, "
        f"{len(problems)} with problems"
        + (f", {len(left_out)} finished but in no table" if left_out else "")
        + placement_summary(runs)
    )
    problems += left_out
    if args.format != "html":
        # run files' strings reach the terminal only as text (no escape sequence of theirs runs)
        sys.stdout.write(console(render(tables, problems, args.format, summary)))
    if args.out is not None:
        try:
            written = write_outputs(
                tables, problems, args.out, plots=not args.no_plots, summary=summary
            )
        except OSError as error:
            parser.error(f"--out {args.out}: cannot write there ({error})")
        print(f"wrote {len(written)} file(s) to {args.out}", file=sys.stderr)
    if args.format == "html":
        sys.stdout.write(html_report(tables, problems, summary, args.out, not args.no_plots))
    if not runs:
        print(
            f"error: none of the {len(files)} run file(s) holds a finished (completed or "
            "diverged) run",
            file=sys.stderr,
        )
        return 1
    return 0
