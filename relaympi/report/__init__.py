"""The paper's tables (and plots) from a set of run files: `python -m relaympi.report results/`.

    python -m relaympi.report [DIR_OR_FILE ...] [--format FORMAT] [--out OUTDIR]

Reads every *.h5 under the given directories (recursively) through relaympi.results and prints the
accuracy, scaling, robustness, learning-rate and quadratics tables that the runs allow, then the
cost tables (per accuracy-table family and hardware: time and bytes per step, samples/s, wall time
to a target accuracy; see relaympi/report/cost.py). Unfinished, failed or unreadable files are
listed under "Problems" (each file is read in a worker process, given RELAYMPI_READ_TIMEOUT
seconds, default 30: a file too damaged to read in that time is one such problem). FORMAT: text
(default), markdown, csv, latex, or html (the page --out writes). Exit status: 0 with at least one
finished run, 1 when there is none, 2 on a usage error (a path that is missing or holds no run file
is one). `python -m benchmarks.report` is the same command.

Modules, from the run files up: summary (one run file as a RunSummary, the report's settings),
cells (the seeds of one configuration and the rows of a table), tables (the paper's tables),
cost (time and bytes per step, wall time to a target accuracy), format (text, markdown, CSV and
LaTeX), plots (PNG figures of the tables), html (the whole report as one self-contained page,
OUTDIR/index.html with --out), cli (the command line).
"""

from relaympi.report.cli import find_run_files, load_runs, main

__all__ = ["find_run_files", "load_runs", "main"]
