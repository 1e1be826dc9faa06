"""Run summaries and the paper's tables (accuracy, scaling, learning rate, robustness, quadratics)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.config import experiment_settings
from relaympi.results import CHANCE_FACTOR, Run, workers_at_chance

ALGO_NAMES = {
    "allreduce": "All-reduce",
    "relay": "RelaySGD",
    "relay-grad": "RelaySGD/Grad",
    "dpsgd": "D-PSGD",
    "qgm": "D-PSGD + quasi-global momentum",
    "d2": "D2",
    "gt": "Gradient tracking",
    "sgp": "SGP",
}
ALGO_ORDER = {name: i for i, name in enumerate(ALGO_NAMES)}
# The paper's reported metric per task (appendix "Detailed experimental setup").
TASK_METRICS = {
    "cifar10": "worst",
    "digits": "worst",
    "imagenet": "mean",
    "agnews": "mean",
    "ag_news": "mean",
}
METRIC_TEXT = {
    "worst": "the worst worker's mean test accuracy over the last {w:g} epochs",
    "mean": "the mean over workers of each worker's mean test accuracy over the last {w:g} epochs",
}
QUADRATIC_TASKS = ("quadratics", "quadratic")
# Quadratics problem constants (paper appendix "Random quadratics"): each setting gets its own table.
QUADRATIC_KEYS = ("dim", "mu", "L", "zeta2", "sigma2", "r0")
DATASETS = ("step", "epoch", "test_accuracy", "suboptimality")  # all the report reads


@dataclass(frozen=True)
class Settings:
    """How the report computes its numbers."""

    last_epochs: float = 5.0
    metric: str = "auto"  # auto | worst | mean
    target: float = 1e-6  # quadratics: suboptimality to reach
    split_by: tuple[str, ...] = ()  # extra config keys that separate tables

    def metric_for(self, task: str, config: dict[str, Any]) -> str:
        if self.metric != "auto":
            return self.metric
        if config.get("metric") in METRIC_TEXT:
            return str(config["metric"])
        return TASK_METRICS.get(task, "worst")


@dataclass(frozen=True)
class Curve:
    """Per-evaluation worst / mean / best worker test accuracy of one run."""

    epoch: np.ndarray
    worst: np.ndarray
    mean: np.ndarray
    best: np.ndarray


@dataclass(frozen=True)
class RunSummary:
    """What the tables need from one finished (completed or diverged) run."""

    path: Path
    status: str
    task: str
    algo: str
    topology: str
    alpha: float | None
    lr: float | None
    momentum: float
    optimizer: str
    world_size: int
    seed: int | None
    drop_prob: float
    relay_mode: str | None
    extra: tuple[tuple[str, str], ...]
    # every other setting of the experiment (relaympi.config.experiment_settings), as text
    settings: tuple[tuple[str, str], ...] = ()
    metric_name: str | None = None  # worst | mean, for classification runs
    metric: float = math.nan  # in [0, 1]; NaN when diverged or without accuracy
    final_epoch: float = math.nan
    diverged_epoch: float | None = None
    steps_to_target: int | None = None  # quadratics: first step with suboptimality <= target
    curve: Curve | None = None
    at_chance: tuple[int, ...] = ()  # workers whose metric window ends at chance accuracy

    @property
    def converged(self) -> bool:
        return self.status == "completed" and math.isfinite(self.metric)

    @property
    def is_quadratic(self) -> bool:
        return self.task in QUADRATIC_TASKS

    @property
    def identity(self) -> tuple:
        """Everything that makes two runs the same experiment (duplicates share it)."""
        return (
            self.task,
            self.row_key,
            self.alpha,
            self.lr,
            self.world_size,
            self.seed,
            self.drop_prob,
            self.extra,
        )

    @property
    def row_key(self) -> tuple:
        return (
            ALGO_ORDER.get(self.algo, len(ALGO_ORDER)),
            self.algo,
            self.topology,
            self.optimizer,
            self.momentum,
            self.relay_mode or "",
            self.settings,
        )


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any, default: float | None = None) -> float | None:
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _relay_mode(config: dict[str, Any]) -> str | None:
    """RelaySGD's normalization when it is not Algorithm 1's counts (other algorithms: None)."""
    mode = config.get("relay_mode")
    if config.get("algo") != "relay" or mode in (None, "counts"):
        return None
    return str(mode)


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# settings with their own field in RunSummary (or in its table family): not repeated in `settings`
_OWN_FIELDS = ("task", "algo", "topology", "alpha", "lr", "momentum", "optimizer", "seed", "drop_prob", "relay_mode")


def _settings(config: dict[str, Any], extra_keys: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The experiment's settings beyond the summary's own fields, so no two experiments merge."""
    settings = experiment_settings(config)
    skip = {*_OWN_FIELDS, *extra_keys}
    return tuple((k, _value_text(v)) for k, v in sorted(settings.items()) if k not in skip)


def worker_means(epoch: np.ndarray, accuracy: np.ndarray, last_epochs: float) -> np.ndarray:
    """Each worker's mean test accuracy over the evaluations of the last ``last_epochs`` epochs.

    The window holds the evaluations with final_epoch - last_epochs < epoch (final_epoch: the
    last evaluation's epoch) and epoch > 0, so an evaluation of the initial model never counts;
    a run shorter than the window uses all its evaluations after epoch 0, and a run with
    no such evaluation uses its last one. NaN evaluations are ignored.
    """
    accuracy = accuracy.reshape(len(accuracy), -1)
    final = np.nanmax(epoch)
    window = (epoch > final - last_epochs) & (epoch > 0)
    if not window.any():
        window = np.zeros(len(epoch), dtype=bool)
        window[-1] = True
    selected = accuracy[window]
    with np.errstate(invalid="ignore"), _quiet():
        return np.nanmean(selected, axis=0)


class _quiet:
    """Silence numpy's 'mean of empty slice' warnings (NaN is the intended answer)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def paper_metric(epoch: np.ndarray, accuracy: np.ndarray, metric: str, last_epochs: float) -> float:
    means = worker_means(epoch, accuracy, last_epochs)
    if not np.isfinite(means).any():
        return math.nan
    return float(np.nanmin(means) if metric == "worst" else np.nanmean(means))


def steps_to_target(step: np.ndarray, suboptimality: np.ndarray, target: float) -> int | None:
    values = suboptimality.reshape(len(suboptimality), -1)
    with _quiet():
        worst = np.nanmax(values, axis=1) if values.shape[1] > 1 else values[:, 0]
    reached = np.flatnonzero(worst <= target)
    return int(step[reached[0]]) if len(reached) else None


def summarize(run: Run, settings: Settings) -> RunSummary:
    """Reduce a completed or diverged run to the numbers the tables need."""
    config = run.config
    task = str(config.get("task", "unknown"))
    world_size = int(config.get("world_size") or run.attrs.get("world_size", 0))
    keys = settings.split_by
    if task in QUADRATIC_TASKS:
        keys = (*[k for k in QUADRATIC_KEYS if config.get(k) is not None], *keys)
    extra = tuple((key, _value_text(config.get(key))) for key in keys)
    diverged_epoch = _float(run.attrs.get("diverged_epoch")) if run.status == "diverged" else None
    summary: dict[str, Any] = dict(
        path=run.path,
        status=run.status,
        task=task,
        algo=str(config.get("algo", "unknown")),
        topology=str(config.get("topology") or "default"),
        alpha=_float(config.get("alpha")),
        lr=_float(config.get("lr")),
        momentum=_float(config.get("momentum"), 0.0) or 0.0,
        optimizer=str(config.get("optimizer") or "sgd"),
        world_size=world_size,
        seed=None if config.get("seed") is None else int(config["seed"]),
        drop_prob=_float(config.get("drop_prob"), 0.0) or 0.0,
        relay_mode=_relay_mode(config),
        extra=extra,
        settings=_settings(config, keys),
        diverged_epoch=diverged_epoch,
    )
    data = run.data
    epoch = data.get("epoch")
    if epoch is not None and len(epoch):
        summary["final_epoch"] = float(np.nanmax(epoch))
        if run.status == "diverged" and diverged_epoch is None:
            summary["diverged_epoch"] = summary["final_epoch"]
    accuracy = data.get("test_accuracy")
    if task not in QUADRATIC_TASKS and accuracy is not None and epoch is not None and len(epoch):
        metric_name = settings.metric_for(task, config)
        summary["metric_name"] = metric_name
        if run.status == "completed":
            summary["metric"] = paper_metric(epoch, accuracy, metric_name, settings.last_epochs)
            means = worker_means(epoch, accuracy, settings.last_epochs)
            summary["at_chance"] = tuple(workers_at_chance(means, _int(run.attrs.get("num_classes"))))
        per_eval = accuracy.reshape(len(accuracy), -1)
        with _quiet():
            summary["curve"] = Curve(
                epoch.copy(),
                np.nanmin(per_eval, axis=1),
                np.nanmean(per_eval, axis=1),
                np.nanmax(per_eval, axis=1),
            )
    suboptimality = data.get("suboptimality")
    if suboptimality is not None and "step" in data and len(suboptimality):
        summary["steps_to_target"] = steps_to_target(data["step"], suboptimality, settings.target)
    return RunSummary(**summary)


# ---------------------------------------------------------------------------------------- cells


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


# --------------------------------------------------------------------------------------- tables


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
    # for plots: row label -> {column value -> (mean, min, max)}
    series: dict[str, dict[float, tuple[float, float, float]]] = field(default_factory=dict)
    # for accuracy-over-epochs plots: column value (alpha) -> row label -> the best cell's curves
    curves: dict[Any, dict[str, list[Curve]]] = field(default_factory=dict)
    paths: set[Path] = field(default_factory=set)  # every run file the table's cells hold (any lr)

    def hold(self, cells: dict[tuple, dict[Any, LrChoice]]) -> None:
        self.paths.update(r.path for cols in cells.values() for c in cols.values() for cell in c.by_lr.values() for r in cell.runs)


# settings whose non-default value reads better as words than as key=value
_SETTING_WORDS = {
    ("relay_lr_correction", "True"): "lr correction",
    ("nesterov", "False"): "heavy ball",
    ("d2_exact_diffusion", "True"): "exact diffusion",
}
_SETTING_DEFAULTS = {"relay_lr_correction": "False", "nesterov": "True", "d2_exact_diffusion": "False"}


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


def row_labels(row_keys: Sequence[tuple]) -> dict[tuple, str]:
    """A label per table row that tells apart every two rows of the same algorithm.

    Beyond algo_label's words, a setting shows as key=value when rows of the same algorithm
    differ in it (so "RelaySGD, epochs=20" next to "RelaySGD, epochs=10").
    """
    momenta = {k[4] for k in row_keys}
    by_algo: dict[str, list[dict[str, str]]] = defaultdict(list)
    for key in row_keys:
        by_algo[key[1]].append(dict(key[6]))
    labels = {}
    for key in row_keys:
        rows = by_algo[key[1]]
        names = sorted({n for row in rows for n in row})
        varying = [n for n in names if n not in _SETTING_DEFAULTS and len({row.get(n) for row in rows}) > 1]
        own = dict(key[6])
        shown = [f"{n}={own[n]}" for n in varying if n in own]
        labels[key] = ", ".join([algo_label(key, momenta), *shown])
    return labels


def _series_name(label: str, key: tuple) -> str:
    """A plot's legend entry: one table row (label and topology), never several merged."""
    return f"{label} on {key[2]}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


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
    text = _pct(np.mean(values))
    if len(values) > 1:
        text += f" [{_pct(min(values))}, {_pct(max(values))}]"
    if cell.n_diverged:
        text += f" ({cell.n_diverged}/{cell.n_seeds} diverged)"
    return text


def format_steps(cell: StepsCell | None) -> str:
    if cell is None:
        return "-"
    values = cell.values
    if not values:
        return "diverged" if cell.n_diverged == cell.n_seeds else "not reached"
    text = f"{np.mean(values):.0f}"
    if len(values) > 1 and min(values) != max(values):
        text += f" [{min(values)}, {max(values)}]"
    if cell.n_reached < cell.n_seeds:
        text += f" ({cell.n_reached}/{cell.n_seeds} reached)"
    return text


def format_lr(choice: LrChoice | None) -> str:
    if choice is None:
        return "-"
    best = choice.best
    lr = "default" if best.lr is None else f"{best.lr:.3g}"
    good = len(best.values)
    text = f"{lr} ({good})" if good == best.n_seeds else f"{lr} ({good} of {best.n_seeds})"
    return text if choice.sandwiched else text + " *"


def _num(value: float | None) -> str:
    return "default" if value is None else f"{value:g}"


def _family_title(parts: Iterable[tuple[str, Any]]) -> str:
    return ", ".join(f"{k}={v}" if k else str(v) for k, v in parts if v is not None)


def _slug(*parts: Any) -> str:
    text = "_".join(str(p) for p in parts if p is not None and p != "")
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


def _cell_record(kind: str, base: dict[str, Any], choice: LrChoice) -> dict[str, Any]:
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


def _pivot(
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


def _metric_caption(metric_names: set[str | None], last_epochs: float) -> str:
    names = sorted(n for n in metric_names if n)
    text = "; ".join(METRIC_TEXT[n].format(w=last_epochs) for n in names if n in METRIC_TEXT)
    return f"Metric: {text}. " if text else ""


def _accuracy_like_table(
    kind: str,
    name: str,
    title: str,
    runs: Sequence[RunSummary],
    column: Callable[[RunSummary], Any],
    column_label: Callable[[Any], str],
    column_key: str,
    base: dict[str, Any],
    settings: Settings,
    descending: bool = False,
) -> Table:
    row_keys, columns, cells = _pivot(runs, column)
    if descending:
        columns = columns[::-1]
    labels = row_labels(row_keys)
    tuned = any(len(choice.by_lr) > 1 for cols in cells.values() for choice in cols.values())
    caption = _metric_caption({r.metric_name for r in runs}, settings.last_epochs)
    caption += "Cells: mean over seeds [min, max over seeds]"
    caption += (
        "; learning rate: the best of those tried per cell (see the learning-rate table)."
        if tuned
        else "."
    )
    table = Table(
        name=name,
        title=title,
        caption=caption,
        kind=kind,
        header=["Algorithm", "Topology", *[column_label(c) for c in columns]],
        rows=[],
    )
    for key in row_keys:
        label = labels[key]
        row = [label, key[2]]
        for col in columns:
            choice = cells[key].get(col)
            row.append(format_accuracy(choice.best) if choice else "-")
            if choice is None:
                continue
            record = _cell_record(
                kind,
                {
                    **base,
                    "algorithm": label,
                    "algo": key[1],
                    "topology": key[2],
                    "momentum": key[4],
                    "optimizer": key[3],
                    column_key: col,
                },
                choice,
            )
            table.records.append(record)
            if record["n_seeds"] > record["n_diverged"] and col is not None:
                table.series.setdefault(_series_name(label, key), {})[col] = (
                    record["mean"],
                    record["min"],
                    record["max"],
                )
            if kind == "accuracy":
                curves = [r.curve for r in choice.best.runs if r.curve is not None]
                table.curves.setdefault(col, {})[_series_name(label, key)] = curves
        table.rows.append(row)
    for key in row_keys:
        for col, choice in cells[key].items():
            for run in choice.best.runs:
                if run.at_chance:
                    table.notes.append(
                        f"Warning: {labels[key]} on {key[2]}, {column_key}={_num(col) if isinstance(col, float) else col}, "
                        f"seed {run.seed}: worker(s) {', '.join(map(str, run.at_chance))} at chance accuracy "
                        f"(below {CHANCE_FACTOR:g}/classes; {run.path.name}): the learning rate may not suit this run."
                    )
    partial = sum(r["n_diverged"] > 0 and r["n_diverged"] < r["n_seeds"] for r in table.records)
    if partial:
        table.notes.append(
            f"{partial} cell(s) have diverged seeds: their numbers are over the converged seeds only."
        )
    table.hold(cells)
    return table


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


def _drop_title(runs: Sequence[RunSummary]) -> tuple[str, Any]:
    drop = runs[0].drop_prob
    return ("drop_prob", f"{drop:g}") if drop else ("", None)


def accuracy_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    """Per (task, world size, drop probability): algorithms x alpha."""
    tables = []
    classification = [r for r in runs if r.metric_name is not None]
    for (task, world_size, drop, extra), family in _families(
        classification, lambda r: (r.task, r.world_size, r.drop_prob, r.extra)
    ).items():
        parts = [("", task), ("", f"{world_size} workers"), _drop_title(family), *extra]
        base = {
            "task": task,
            "world_size": world_size,
            "drop_prob": drop,
            **dict(extra),
        }
        tables.append(
            _accuracy_like_table(
                "accuracy",
                _slug("accuracy", task, f"n{world_size}", f"drop{drop:g}" if drop else "", *[v for _, v in extra]),
                f"Test accuracy: {_family_title(parts)}",
                family,
                lambda r: r.alpha,
                lambda a: f"alpha={_num(a)}",
                "alpha",
                base,
                settings,
                descending=True,
            )
        )
    return tables


def scaling_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    """Per (task, alpha): algorithms x world size, when more than one world size was run."""
    tables = []
    classification = [r for r in runs if r.metric_name is not None]
    for (task, alpha, extra), family in _families(
        classification, lambda r: (r.task, r.alpha, r.extra)
    ).items():
        family = _min_drop(family)
        if len({r.world_size for r in family}) < 2:
            continue
        parts = [("", task), ("alpha", _num(alpha)), _drop_title(family), *extra]
        base = {"task": task, "alpha": alpha, "drop_prob": family[0].drop_prob, **dict(extra)}
        tables.append(
            _accuracy_like_table(
                "scaling",
                _slug("scaling", task, f"alpha{_num(alpha)}", *[v for _, v in extra]),
                f"Scaling the number of workers: {_family_title(parts)}",
                family,
                lambda r: r.world_size,
                lambda n: f"{n} workers",
                "world_size",
                base,
                settings,
            )
        )
    return tables


def robustness_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    """Per (task, alpha, world size): algorithms x drop probability, when several were run."""
    tables = []
    classification = [r for r in runs if r.metric_name is not None]
    for (task, alpha, world_size, extra), family in _families(
        classification, lambda r: (r.task, r.alpha, r.world_size, r.extra)
    ).items():
        if len({r.drop_prob for r in family}) < 2:
            continue
        parts = [("", task), ("alpha", _num(alpha)), ("", f"{world_size} workers"), *extra]
        base = {"task": task, "alpha": alpha, "world_size": world_size, **dict(extra)}
        tables.append(
            _accuracy_like_table(
                "robustness",
                _slug(
                    "robustness",
                    task,
                    f"alpha{_num(alpha)}",
                    f"n{world_size}",
                    *[v for _, v in extra],
                ),
                f"Robustness to dropped messages: {_family_title(parts)}",
                family,
                lambda r: r.drop_prob,
                lambda p: "reliable" if p == 0 else f"{100 * p:g}% dropped",
                "drop_prob",
                base,
                settings,
            )
        )
    return tables


def lr_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    """Per (task, world size, drop probability): the best lr of algorithms x alpha, with the grid check."""
    tables = []
    classification = [r for r in runs if r.metric_name is not None]
    for (task, world_size, drop, extra), family in _families(
        classification, lambda r: (r.task, r.world_size, r.drop_prob, r.extra)
    ).items():
        row_keys, columns, cells = _pivot(family, lambda r: r.alpha)
        if not any(len(choice.by_lr) > 1 for cols in cells.values() for choice in cols.values()):
            continue
        columns = columns[::-1]
        parts = [
            ("", task),
            ("", f"{world_size} workers"),
            ("drop_prob", f"{drop:g}" if drop else None),
            *extra,
        ]
        caption = (
            "Best learning rate per cell (highest mean metric over seeds, preferring learning rates "
            "at which no seed diverged); in parentheses the number of converged seeds at it. "
            "* marks a best learning rate at the edge of the grid (not sandwiched between two "
            "worse learning rates): extend the grid."
        )
        table = Table(
            name=_slug(
                "lr",
                task,
                f"n{world_size}",
                f"drop{drop:g}" if drop else "",
                *[v for _, v in extra],
            ),
            title=f"Learning rates: {_family_title(parts)}",
            caption=caption,
            kind="lr",
            header=["Algorithm", "Topology", *[f"alpha={_num(a)}" for a in columns]],
            rows=[],
        )
        labels = row_labels(row_keys)
        edges = 0
        for key in row_keys:
            label = labels[key]
            row = [label, key[2]]
            for alpha in columns:
                choice = cells[key].get(alpha)
                row.append(format_lr(choice))
                if choice is None:
                    continue
                edges += not choice.sandwiched
                record = _cell_record(
                    "lr",
                    {
                        "task": task,
                        "world_size": world_size,
                        "drop_prob": drop,
                        **dict(extra),
                        "algorithm": label,
                        "algo": key[1],
                        "topology": key[2],
                        "momentum": key[4],
                        "optimizer": key[3],
                        "alpha": alpha,
                    },
                    choice,
                )
                record["lr_means"] = " ".join(
                    f"{lr:g}:{c.mean:.4f}"
                    for lr, c in sorted(
                        ((lr, c) for lr, c in choice.by_lr.items() if lr is not None),
                        key=lambda x: x[0],
                    )
                )
                record["display"] = format_lr(choice)
                table.records.append(record)
            table.rows.append(row)
        if edges:
            table.notes.append(
                f"{edges} cell(s) have their best learning rate at the edge of the grid."
            )
        table.hold(cells)
        tables.append(table)
    return tables


def quadratics_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    """Per (task, problem constants, drop probability): steps to reach the target, algorithms x world size."""
    tables = []
    quadratic = [r for r in runs if r.is_quadratic]
    for (task, drop, extra), family in _families(
        quadratic, lambda r: (r.task, r.drop_prob, r.extra)
    ).items():
        row_keys, columns, cells = _pivot(family, lambda r: r.world_size, steps=True)
        parts = [("", task), ("drop_prob", f"{drop:g}" if drop else None), *extra]
        tuned = any(len(c.by_lr) > 1 for cols in cells.values() for c in cols.values())
        caption = (
            f"Steps until the averaged model's suboptimality is <= {settings.target:g} (first evaluation "
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
                f"drop{drop:g}" if drop else "",
                *[f"{k}{v}" for k, v in extra],
            ),
            title=f"Steps to suboptimality <= {settings.target:g}: {_family_title(parts)}",
            caption=caption,
            kind="quadratics",
            header=["Algorithm", "Topology", *[f"{n} workers" for n in columns]],
            rows=[],
        )
        labels = row_labels(row_keys)
        for key in row_keys:
            label = labels[key]
            row = [label, key[2]]
            for n in columns:
                choice = cells[key].get(n)
                row.append(format_steps(choice.best) if choice else "-")
                if choice is None:
                    continue
                record = _cell_record(
                    "quadratics",
                    {
                        "task": task,
                        "drop_prob": drop,
                        **dict(extra),
                        "algorithm": label,
                        "algo": key[1],
                        "topology": key[2],
                        "momentum": key[4],
                        "world_size": n,
                        "target": settings.target,
                    },
                    choice,
                )
                table.records.append(record)
                if record["n_reached"]:
                    table.series.setdefault(_series_name(label, key), {})[n] = (
                        record["mean"],
                        record["min"],
                        record["max"],
                    )
            table.rows.append(row)
        table.hold(cells)
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


def all_tables(runs: Sequence[RunSummary], settings: Settings) -> list[Table]:
    return [
        *accuracy_tables(runs, settings),
        *scaling_tables(runs, settings),
        *robustness_tables(runs, settings),
        *lr_tables(runs, settings),
        *quadratics_tables(runs, settings),
    ]
