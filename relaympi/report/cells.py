"""Table cells and rows: the seeds of one configuration per learning rate, the paper's choice of lr,
their display, and the row labels that tell every two rows apart."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relaympi.report.summary import ALGO_NAMES, RunSummary


@dataclass
class Cell:
    """The seeds of one configuration at one learning rate."""

    runs: list[RunSummary]
    lr: float | None

    @property
    def values(self) -> list[float]:
        return [r.metric for r in self.runs if r.converged]

    @property
    def n_seeds(self) -> int:
        return len(self.runs)

    @property
    def n_diverged(self) -> int:
        return self.n_seeds - len(self.values)

    @property
    def mean(self) -> float:
        values = self.values
        return float(np.mean(values)) if values else math.nan

    @property
    def diverged_epochs(self) -> list[float]:
        return sorted(r.diverged_epoch for r in self.runs if r.diverged_epoch is not None)


@dataclass
class StepsCell:
    """Quadratics: the seeds of one configuration at one learning rate, in steps to target."""

    runs: list[RunSummary]
    lr: float | None

    @property
    def values(self) -> list[int]:
        return [r.steps_to_target for r in self.runs if r.steps_to_target is not None]

    @property
    def n_seeds(self) -> int:
        return len(self.runs)

    @property
    def n_reached(self) -> int:
        return len(self.values)

    @property
    def n_diverged(self) -> int:
        return sum(r.status == "diverged" for r in self.runs)

    @property
    def mean(self) -> float:
        values = self.values
        return float(np.mean(values)) if values else math.nan


@dataclass
class LrChoice:
    """The best learning rate of one cell by the paper's tuning rule, and the grid around it."""

    best: Cell | StepsCell
    by_lr: dict[float | None, Cell | StepsCell]
    sandwiched: bool  # a worse lr was tried on both sides of the best one

    @property
    def grid(self) -> list[float]:
        return sorted(lr for lr in self.by_lr if lr is not None)


def _accuracy_rank(cell: Cell) -> tuple:
    # Paper, appendix "Hyper-parameters": best mean over seeds; an lr where a seed diverged
    # loses to any lr where none did ("reduce the learning rate ... until it does [converge]").
    return (len(cell.values) > 0, cell.n_diverged == 0, cell.mean if cell.values else -math.inf)


def _steps_rank(cell: StepsCell) -> tuple:
    return (
        cell.n_reached > 0,
        cell.n_reached == cell.n_seeds,
        -cell.mean if cell.values else -math.inf,
    )


def choose_lr(runs: Sequence[RunSummary], steps: bool = False) -> LrChoice:
    """Group runs by lr; the best lr is sandwiched when both grid neighbours rank strictly lower."""
    by_lr_runs: dict[float | None, list[RunSummary]] = defaultdict(list)
    for run in runs:
        by_lr_runs[run.lr].append(run)
    make: Callable = StepsCell if steps else Cell
    rank: Callable = _steps_rank if steps else _accuracy_rank
    by_lr = {
        lr: make(sorted(group, key=lambda r: (r.seed is None, r.seed or 0)), lr)
        for lr, group in by_lr_runs.items()
    }
    best = max(by_lr.values(), key=lambda c: (rank(c), -(c.lr or 0.0)))
    grid = sorted(lr for lr in by_lr if lr is not None)
    sandwiched = False
    if best.lr is not None and best.lr in grid:
        i = grid.index(best.lr)
        if 0 < i < len(grid) - 1:
            sandwiched = rank(by_lr[grid[i - 1]]) < rank(best) and rank(by_lr[grid[i + 1]]) < rank(
                best
            )
    return LrChoice(best, by_lr, sandwiched)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _seeds_text(
    values: Sequence[float], show: Callable[[float], str], spread: bool, note: str
) -> str:
    """A cell's display: the mean over seeds, [min, max] where ``spread``, (note) where one is
    given."""
    # np.mean of floats is a float64, a float; numpy's stubs say np.floating
    text = show(np.mean(values))  # type: ignore[arg-type]
    if spread:
        text += f" [{show(min(values))}, {show(max(values))}]"
    return f"{text} ({note})" if note else text


def format_accuracy(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    values = cell.values
    if not values:
        epochs = cell.diverged_epochs
        if not epochs:
            return "diverged" if cell.n_diverged else "no accuracy"
        low, high = epochs[0], epochs[-1]
        return (
            f"diverged at epoch {low:.3g}"
            if low == high
            else f"diverged at epochs {low:.3g}-{high:.3g}"
        )
    note = f"{cell.n_diverged}/{cell.n_seeds} diverged" if cell.n_diverged else ""
    return _seeds_text(values, _pct, len(values) > 1, note)


def format_steps(cell: StepsCell | None) -> str:
    if cell is None:
        return "-"
    values = cell.values
    if not values:
        return "diverged" if cell.n_diverged == cell.n_seeds else "not reached"
    note = f"{cell.n_reached}/{cell.n_seeds} reached" if cell.n_reached < cell.n_seeds else ""
    return _seeds_text(values, "{:.0f}".format, min(values) != max(values), note)


def format_lr(choice: LrChoice | None) -> str:
    if choice is None:
        return "-"
    best = choice.best
    lr = "default" if best.lr is None else f"{best.lr:.3g}"
    good = len(best.values)
    text = f"{lr} ({good})" if good == best.n_seeds else f"{lr} ({good} of {best.n_seeds})"
    return text if choice.sandwiched else text + " *"


def cell_record(kind: str, base: dict[str, Any], choice: LrChoice) -> dict[str, Any]:
    cell = choice.best
    values = cell.values
    record = dict(base)
    record.update(
        lr=cell.lr,
        mean=float(np.mean(values)) if values else math.nan,
        min=float(min(values)) if values else math.nan,
        max=float(max(values)) if values else math.nan,
        n_seeds=cell.n_seeds,
        n_diverged=cell.n_diverged,
        lr_grid=" ".join(f"{lr:g}" for lr in choice.grid),
        lr_sandwiched=choice.sandwiched,
    )
    if isinstance(cell, Cell):
        epochs = cell.diverged_epochs
        record["diverged_epoch"] = epochs[0] if epochs else math.nan
        record["display"] = format_accuracy(cell)
    else:
        record["n_reached"] = cell.n_reached
        record["display"] = format_steps(cell)
    return record


def pivot(
    runs: Sequence[RunSummary],
    column: Callable[[RunSummary], Any],
    steps: bool = False,
) -> tuple[list[tuple], list[Any], dict[tuple, dict[Any, LrChoice]]]:
    """Group runs by (row key, column value) and choose each cell's lr."""
    groups: dict[tuple, dict[Any, list[RunSummary]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        groups[run.row_key][column(run)].append(run)
    columns = sorted({c for cols in groups.values() for c in cols}, key=_column_order)
    cells = {
        row: {col: choose_lr(rs, steps) for col, rs in cols.items()} for row, cols in groups.items()
    }
    return sorted(groups), columns, cells


def _column_order(value: Any) -> tuple:
    return (value is None, 0 if value is None else value)


# settings whose non-default value reads better as words than as key=value
_SETTING_WORDS = {
    ("relay_lr_correction", "True"): "lr correction",
    ("nesterov", "False"): "heavy ball",
    ("d2_exact_diffusion", "True"): "exact diffusion",
}
_SETTING_DEFAULTS = {
    "relay_lr_correction": "False",
    "nesterov": "True",
    "d2_exact_diffusion": "False",
}


def algo_label(key: tuple, momenta: set[float]) -> str:
    _, algo, _topology, optimizer, momentum, relay_mode, settings = key
    label = ALGO_NAMES.get(algo, algo)
    if momentum > 0 and algo != "qgm":
        label += " + momentum" if momenta <= {0.0, 0.9} else f" + momentum {momentum:g}"
    if optimizer != "sgd":
        label += f" ({'Adam' if optimizer == 'adam' else optimizer})"
    if relay_mode:
        label += f" [{relay_mode}]"
    words = [_SETTING_WORDS[item] for item in settings if item in _SETTING_WORDS]
    return ", ".join([label, *words])


def row_labels(row_keys: Iterable[tuple]) -> dict[tuple, str]:
    """A label per row key that tells apart every two rows of the same algorithm.

    Beyond algo_label's words, a setting shows as key=value when rows of the same algorithm
    differ in it (so "RelaySGD, epochs=20" next to "RelaySGD, epochs=10"); a row without a value
    for it (None) leaves it out, which still tells it apart from the rows that have one.
    """
    row_keys = sorted(set(row_keys))
    momenta = {k[4] for k in row_keys}
    by_algo: dict[str, list[dict[str, str]]] = defaultdict(list)
    for key in row_keys:
        by_algo[key[1]].append(dict(key[6]))
    labels = {}
    for key in row_keys:
        rows = by_algo[key[1]]
        names = sorted({n for row in rows for n in row})
        varying = [
            n for n in names if n not in _SETTING_DEFAULTS and len({row.get(n) for row in rows}) > 1
        ]
        own = dict(key[6])
        shown = [f"{n}={own[n]}" for n in varying if own.get(n, "None") != "None"]
        labels[key] = ", ".join([algo_label(key, momenta), *shown])
    return labels


class RowLabels:
    """The report's one labelling of its rows: a label per (task, row key), made from every row
    key of the task's runs, so that a run has the same label in every table and plot (its
    accuracy, scaling, robustness, learning-rate, quadratics and cost tables alike)."""

    def __init__(self, runs: Iterable[RunSummary]) -> None:
        keys: dict[str, set[tuple]] = defaultdict(set)
        for run in runs:
            keys[run.task].add(run.row_key)
        self._labels = {
            (task, key): label
            for task, task_keys in keys.items()
            for key, label in row_labels(task_keys).items()
        }

    def __call__(self, task: str, key: tuple) -> str:
        """The row's label (its Algorithm column)."""
        return self._labels[(task, key)]

    def series(self, task: str, key: tuple) -> str:
        """The row as one plot series: its label and topology (the table's Topology column)."""
        return f"{self(task, key)} on {key[2]}"
