"""The paper's tables from run summaries: accuracy, scaling, robustness (one spec each), learning
rate, quadratics."""

# Long module: every table of the report: accuracy, costs and their flags

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np

from relaympi.report.cells import (
    Cell,
    LrChoice,
    RowLabels,
    StepsCell,
    cell_record,
    format_accuracy,
    format_lr,
    format_steps,
    pivot,
)
from relaympi.report.summary import METRIC_TEXT, Curve, ReportSettings, RunSummary
from relaympi.results import CHANCE_FACTOR, unstable_text


@dataclass
class Table:
    """One table: display cells for humans, long-form records for CSV."""

    name: str  # file-name slug
    title: str
    caption: str
    header: list[str]
    rows: list[list[str]]
    records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kind: str = ""  # accuracy | scaling | lr | robustness | quadratics
    metric: str = ""  # what one seed's value in a cell is (the plots' captions)
    # for plots: row label -> {column value -> (mean, min, max)}
    series: dict[str, dict[float, tuple[float, float, float]]] = field(default_factory=dict)
    # for accuracy-over-epochs plots: column value (alpha) -> row label -> the best cell's curves
    curves: dict[Any, dict[str, list[Curve]]] = field(default_factory=dict)
    paths: set[Path] = field(default_factory=set)  # every run file the table's cells hold (any lr)
    # cost tables: series label -> each seed's (time_s, curve), for accuracy over wall-clock time
    time_curves: dict[str, list[tuple[np.ndarray, Curve]]] = field(default_factory=dict)
    target: float | None = None  # cost tables: the target accuracy of time_to_target_s
    # the membership changes (lost workers) of the runs its cells show, one line each
    changes: list[str] = field(default_factory=list)

    def hold(self, cells: dict[tuple, dict[Any, LrChoice]]) -> None:
        self.paths.update(
            r.path
            for cols in cells.values()
            for c in cols.values()
            for cell in c.by_lr.values()
            for r in cell.runs
        )


def _num(value: float | None) -> str:
    return "default" if value is None else f"{value:g}"


def _family_title(parts: Iterable[tuple[str, Any]]) -> str:
    return ", ".join(f"{k}={v}" if k else str(v) for k, v in parts if v is not None)


def _slug(*parts: Any) -> str:
    text = "_".join(str(p) for p in parts if p is not None and p != "")
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


def _metric_text(metric_names: set[str | None], last_epochs: float) -> str:
    names = sorted(n for n in metric_names if n)
    return "; ".join(METRIC_TEXT[n].format(w=last_epochs) for n in names if n in METRIC_TEXT)


def _metric_caption(metric_names: set[str | None], last_epochs: float) -> str:
    text = _metric_text(metric_names, last_epochs)
    return f"Metric: {text}. " if text else ""


# -------------------------------------------------------------------- the accuracy-like tables


@dataclass(frozen=True)
class Dimension:
    """A RunSummary field that tables are grouped by or spread across in columns."""

    name: str  # the RunSummary attribute
    # its piece of a table's title, (key, value); value None: left out
    part: Callable[[Any], tuple[str, Any]]
    slug: Callable[[Any], str]  # its piece of a table's file name ("": left out)
    label: Callable[[Any], str]  # its column header


TASK = Dimension("task", lambda task: ("", task), str, str)
WORKERS = Dimension(
    "world_size", lambda n: ("", f"{n} workers"), lambda n: f"n{n}", lambda n: f"{n} workers"
)
ALPHA = Dimension(
    "alpha",
    lambda alpha: ("alpha", _num(alpha)),
    lambda alpha: f"alpha{_num(alpha)}",
    lambda alpha: f"alpha={_num(alpha)}",
)
DROP = Dimension(
    "drop_prob",
    lambda p: ("drop_prob", f"{p:g}") if p else ("", None),
    lambda p: f"drop{p:g}" if p else "",
    lambda p: "reliable" if p == 0 else f"{100 * p:g}% dropped",
)


@dataclass(frozen=True)
class TableSpec:
    """A table family over classification runs: one table per value of ``family`` (and the runs'
    extra settings), algorithms x ``column``."""

    kind: str
    title: str
    family: tuple[Dimension, ...]
    column: Dimension
    min_columns: int = 2  # fewer distinct column values: no table
    descending: bool = False  # columns from the largest value
    lowest_drop: bool = (
        False  # only the family's runs at its lowest drop probability (named in the title)
    )


ACCURACY = TableSpec(
    "accuracy", "Test accuracy", (TASK, WORKERS, DROP), ALPHA, min_columns=1, descending=True
)
SPECS = (
    ACCURACY,
    TableSpec("scaling", "Scaling the number of workers", (TASK, ALPHA), WORKERS, lowest_drop=True),
    TableSpec("robustness", "Robustness to dropped messages", (TASK, ALPHA, WORKERS), DROP),
)
# the learning-rate tables: the accuracy tables' families and columns, the best lr in each cell
LR_SPEC = dataclasses.replace(ACCURACY, kind="lr", title="Learning rates")


@dataclass(frozen=True)
class Family:
    """The classification runs of one table, with its file name, title and the columns its records
    share."""

    name: str
    title: str
    base: dict[str, Any]
    runs: list[RunSummary]


def _families(
    runs: Iterable[RunSummary], key: Callable[[RunSummary], tuple]
) -> dict[tuple, list[RunSummary]]:
    families: dict[tuple, list[RunSummary]] = defaultdict(list)
    for run in runs:
        families[key(run)].append(run)
    return dict(sorted(families.items(), key=lambda kv: repr(kv[0])))


def _min_drop(runs: Sequence[RunSummary]) -> list[RunSummary]:
    low = min(r.drop_prob for r in runs)
    return [r for r in runs if r.drop_prob == low]


def spec_families(spec: TableSpec, runs: Sequence[RunSummary]) -> Iterator[Family]:
    """The tables ``spec`` makes of the classification runs, in a stable order."""
    classification = [r for r in runs if r.metric_name is not None]

    def key(run: RunSummary) -> tuple:
        return (*(getattr(run, d.name) for d in spec.family), run.extra)

    for (*values, extra), family in _families(classification, key).items():
        if spec.lowest_drop:
            family = _min_drop(family)
        if len({getattr(r, spec.column.name) for r in family}) < spec.min_columns:
            continue
        named = list(zip(spec.family, values, strict=True))
        if spec.lowest_drop:
            named.append((DROP, family[0].drop_prob))
        parts = [d.part(v) for d, v in named] + list(extra)
        slugs = [d.slug(v) for d, v in zip(spec.family, values, strict=True)]
        yield Family(
            name=_slug(spec.kind, *slugs, *[v for _, v in extra]),
            title=f"{spec.title}: {_family_title(parts)}",
            base={**{d.name: v for d, v in named}, **dict(extra)},
            runs=family,
        )


def _cell_base(base: dict[str, Any], label: str, key: tuple) -> dict[str, Any]:
    """A record's columns before its column value: the family's, then the row's algorithm."""
    return {
        **base,
        "algorithm": label,
        "algo": key[1],
        "topology": key[2],
        "momentum": key[4],
        "optimizer": key[3],
    }


Cells = dict[tuple, dict[Any, LrChoice]]


def _fill_rows(
    table: Table,
    labels: RowLabels,
    task: str,
    row_keys: Sequence[tuple],
    columns: Sequence[Any],
    cells: Cells,
    display: Callable[[LrChoice], str],
    record: Callable[[str, tuple, Any, LrChoice], dict[str, Any]],
    plotted: Callable[[dict[str, Any], Any], bool] = lambda record, column: False,
) -> dict[tuple, str]:
    """One row per row key with each column's display text ("-": no runs); one record per cell,
    and a plot point (mean, min, max) where ``plotted``. Returns the row labels (``labels``'s,
    the report's one labelling)."""
    shown = {key: labels(task, key) for key in row_keys}
    for key in row_keys:
        label = shown[key]
        row = [label, key[2]]
        for col in columns:
            choice = cells[key].get(col)
            row.append(display(choice) if choice else "-")
            if choice is None:
                continue
            cell = record(label, key, col, choice)
            table.records.append(cell)
            if plotted(cell, col):
                table.series.setdefault(labels.series(task, key), {})[col] = (
                    cell["mean"],
                    cell["min"],
                    cell["max"],
                )
        table.rows.append(row)
    table.hold(cells)
    return shown


def _accuracy_like_table(
    spec: TableSpec, family: Family, settings: ReportSettings, labels: RowLabels
) -> Table:
    column_key = spec.column.name
    task = family.runs[0].task
    row_keys, columns, cells = pivot(family.runs, lambda r: getattr(r, column_key))
    if spec.descending:
        columns = columns[::-1]
    tuned = any(len(choice.by_lr) > 1 for cols in cells.values() for choice in cols.values())
    caption = _metric_caption({r.metric_name for r in family.runs}, settings.last_epochs)
    caption += "Cells: mean over seeds [min, max over seeds]"
    caption += (
        "; learning rate: the best of those tried per cell (see the learning-rate table)."
        if tuned
        else "."
    )
    table = Table(
        name=family.name,
        title=family.title,
        caption=caption,
        kind=spec.kind,
        metric=_metric_text({r.metric_name for r in family.runs}, settings.last_epochs),
        header=["Algorithm", "Topology", *[spec.column.label(c) for c in columns]],
        rows=[],
    )

    def record(label: str, key: tuple, col: Any, choice: LrChoice) -> dict[str, Any]:
        if spec.kind == "accuracy":
            curves = [r.curve for r in choice.best.runs if r.curve is not None]
            table.curves.setdefault(col, {})[labels.series(task, key)] = curves
        cell = cell_record(
            spec.kind, {**_cell_base(family.base, label, key), column_key: col}, choice
        )
        if _lost(choice):  # only then: the CSV of runs without lost workers stays as it was
            cell["lost_workers"] = True
        return cell

    shown = _fill_rows(
        table,
        labels,
        task,
        row_keys,
        columns,
        cells,
        lambda choice: (
            format_accuracy(cast(Cell, choice.best))  # an accuracy table's cells
            + (LOST_MARK if _lost(choice) else "")
        ),
        record,
        lambda cell, col: cell["n_seeds"] > cell["n_diverged"] and col is not None,
    )
    for cell in table.records:
        if cell.get("lost_workers"):
            cell["display"] += LOST_MARK
    _warn(table, shown, cells, column_key)
    _lost_notes(table, shown, cells, column_key)
    partial = sum(r["n_diverged"] > 0 and r["n_diverged"] < r["n_seeds"] for r in table.records)
    if partial:
        table.notes.append(
            f"{partial} cell(s) have diverged seeds: their numbers are over the converged "
            "seeds only."
        )
    return table


# marks a cell whose runs lost workers (membership changes): its metric is over those that finished
LOST_MARK = "\N{DAGGER}"


def _lost(choice: LrChoice) -> bool:
    """Whether a cell shows a run that lost workers."""
    return any(run.finished is not None for run in choice.best.runs)


def _lost_words(run: RunSummary) -> str:
    """What happened to a run's workers, for its note: 'lost workers', or with re-admissions
    'lost workers, re-admitted: rank 7' (some still out at the end: 'lost workers, some
    re-admitted: ranks 3, 7')."""
    if not run.readmitted or run.finished is None:
        return "lost workers"
    done, start = run.finished
    some = "" if done == start else " some"
    ranks = f"rank{'s' if len(run.readmitted) > 1 else ''} {', '.join(map(str, run.readmitted))}"
    return f"lost workers,{some} re-admitted: {ranks}"


def _lost_notes(table: Table, labels: dict[tuple, str], cells: Cells, column_key: str) -> None:
    """Per run a cell shows that lost workers: a note that its metric is over the workers that
    finished, and its membership changes in ``table.changes``."""
    for key, label in labels.items():
        for col, choice in cells[key].items():
            for run in choice.best.runs:
                if run.finished is None:
                    continue
                where = (
                    f"{label} on {key[2]}, "
                    f"{column_key}={_num(col) if isinstance(col, float) else col}, seed {run.seed}"
                )
                done, start = run.finished
                table.notes.append(
                    f"{LOST_MARK} {where}: {_lost_words(run)}: metric over the {done} of {start} "
                    f"that finished ({run.path.name})."
                )
                table.changes += [
                    f"{where}: {text}" + (f" (epoch {epoch:.3g})" if epoch == epoch else "")
                    for epoch, text in run.changes
                ]


def _warn(table: Table, labels: dict[tuple, str], cells: Cells, column_key: str) -> None:
    """A note for every run a cell shows that ends with workers at chance accuracy or unstable."""
    for key, label in labels.items():  # in the table's row order
        for col, choice in cells[key].items():
            for run in choice.best.runs:
                where = (
                    f"Warning: {label} on {key[2]}, "
                    f"{column_key}={_num(col) if isinstance(col, float) else col}, seed {run.seed}"
                )
                if run.at_chance:
                    table.notes.append(
                        f"{where}: worker(s) {', '.join(map(str, run.at_chance))} at "
                        "chance accuracy "
                        f"(below {CHANCE_FACTOR:g}/classes; {run.path.name}): the "
                        "learning rate may not suit this run."
                    )
                if run.unstable:
                    table.notes.append(f"{where}: {unstable_text(run.unstable)}; {run.path.name}.")


def accuracy_like_tables(
    runs: Sequence[RunSummary], settings: ReportSettings, labels: RowLabels | None = None
) -> list[Table]:
    """Every table of SPECS, in its order: accuracy, scaling, robustness."""
    labels = labels or RowLabels(runs)
    return [
        _accuracy_like_table(spec, family, settings, labels)
        for spec in SPECS
        for family in spec_families(spec, runs)
    ]


# ------------------------------------------------------------------------- the other tables


def _lr_record(
    base: dict[str, Any], label: str, key: tuple, alpha: Any, choice: LrChoice
) -> dict[str, Any]:
    record = cell_record("lr", {**_cell_base(base, label, key), "alpha": alpha}, choice)
    record["lr_means"] = " ".join(
        f"{lr:g}:{c.mean:.4f}"
        for lr, c in sorted(
            ((lr, c) for lr, c in choice.by_lr.items() if lr is not None),
            key=lambda x: x[0],
        )
    )
    record["display"] = format_lr(choice)
    return record


def lr_tables(
    runs: Sequence[RunSummary], settings: ReportSettings, labels: RowLabels | None = None
) -> list[Table]:
    """Per (task, world size, drop probability): the best lr of algorithms x alpha, with the grid
    check."""
    labels = labels or RowLabels(runs)
    tables = []
    for family in spec_families(LR_SPEC, runs):
        row_keys, columns, cells = pivot(family.runs, lambda r: getattr(r, LR_SPEC.column.name))
        if not any(len(choice.by_lr) > 1 for cols in cells.values() for choice in cols.values()):
            continue
        if LR_SPEC.descending:
            columns = columns[::-1]
        caption = (
            "Best learning rate per cell (highest mean metric over seeds, preferring "
            "learning rates "
            "at which no seed diverged); in parentheses the number of converged seeds at it. "
            "* marks a best learning rate at the edge of the grid (not sandwiched between two "
            "worse learning rates): extend the grid."
        )
        table = Table(
            name=family.name,
            title=family.title,
            caption=caption,
            kind="lr",
            header=["Algorithm", "Topology", *[LR_SPEC.column.label(a) for a in columns]],
            rows=[],
        )
        _fill_rows(
            table,
            labels,
            family.runs[0].task,
            row_keys,
            columns,
            cells,
            format_lr,
            partial(_lr_record, family.base),
        )
        edges = sum(not choice.sandwiched for cols in cells.values() for choice in cols.values())
        if edges:
            table.notes.append(
                f"{edges} cell(s) have their best learning rate at the edge of the grid."
            )
        tables.append(table)
    return tables


def quadratics_tables(
    runs: Sequence[RunSummary], settings: ReportSettings, labels: RowLabels | None = None
) -> list[Table]:
    """Per (task, problem constants, drop probability): steps to reach the target, algorithms x
    world size."""
    labels = labels or RowLabels(runs)
    tables = []
    quadratic = [r for r in runs if r.is_quadratic]
    for (task, drop, extra), family in _families(
        quadratic, lambda r: (r.task, r.drop_prob, r.extra)
    ).items():
        row_keys, columns, cells = pivot(family, lambda r: r.world_size, steps=True)
        parts = [("", task), DROP.part(drop), *extra]
        tuned = any(len(c.by_lr) > 1 for cols in cells.values() for c in cols.values())
        caption = (
            f"Steps until the averaged model's suboptimality is <= {settings.target:g} "
            "(first evaluation "
            "at or below it); mean over seeds [min, max]"
            + (
                "; learning rate: the one reaching it in the fewest steps per cell."
                if tuned
                else "."
            )
        )
        table = Table(
            name=_slug(
                "quadratics" if task == "quadratics" else f"quadratics_{task}",
                DROP.slug(drop),
                *[f"{k}{v}" for k, v in extra],
            ),
            title=f"Steps to suboptimality <= {settings.target:g}: {_family_title(parts)}",
            caption=caption,
            kind="quadratics",
            metric=f"steps until the averaged model's suboptimality is <= {settings.target:g} "
            "(seeds that never reach it left out)",
            header=["Algorithm", "Topology", *[WORKERS.label(n) for n in columns]],
            rows=[],
        )
        base = {"task": task, "drop_prob": drop, **dict(extra)}

        def record(
            label: str, key: tuple, n: Any, choice: LrChoice, base: dict = base
        ) -> dict[str, Any]:
            fields = {**_cell_base(base, label, key), "world_size": n, "target": settings.target}
            del fields["optimizer"]  # quadratics records leave the optimizer out
            return cell_record("quadratics", fields, choice)

        shown = _fill_rows(
            table,
            labels,
            task,
            row_keys,
            columns,
            cells,
            lambda choice: format_steps(cast(StepsCell, choice.best)),  # a steps table's cells
            record,
            lambda cell, n: bool(cell["n_reached"]),
        )
        _warn(table, shown, cells, "world_size")
        tables.append(table)
    return tables


def untabulated(runs: Sequence[RunSummary], tables: Sequence[Table]) -> list[tuple[Path, str]]:
    """Finished runs that no table holds, each with the reason (so no run vanishes silently)."""
    held = set().union(*(t.paths for t in tables)) if tables else set()
    left = []
    for run in runs:
        if run.path in held:
            continue
        if run.metric_name is None and not run.is_quadratic:
            reason = "no test_accuracy or suboptimality recorded: nothing to tabulate"
        else:
            reason = "in no table (no table groups this combination of settings)"
        left.append((run.path, f"status {run.status}, {reason}"))
    return left


def all_tables(
    runs: Sequence[RunSummary], settings: ReportSettings, labels: RowLabels | None = None
) -> list[Table]:
    """The accuracy-like, learning-rate and quadratics tables, their rows labelled by ``labels``
    (default: the labelling of ``runs``)."""
    labels = labels or RowLabels(runs)
    return [
        *accuracy_like_tables(runs, settings, labels),
        *lr_tables(runs, settings, labels),
        *quadratics_tables(runs, settings, labels),
    ]
