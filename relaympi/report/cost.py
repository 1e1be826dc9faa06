"""The cost tables: per accuracy-table family and hardware, what each experiment cost per step,
in bytes, and in wall time to a target accuracy (relaympi.costs computes each run's numbers)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from relaympi.algorithms.registry import COLLECTIVE, DECLARED
from relaympi.costs import TIMERS, StepCosts, hardware_label, median, time_to_accuracy
from relaympi.report.cells import RowLabels
from relaympi.report.summary import ReportSettings, RunSummary
from relaympi.report.tables import (
    ACCURACY,
    Family,
    Table,
    _cell_base,
    _metric_text,
    _num,
    _slug,
    spec_families,
)

COST_SPEC = dataclasses.replace(ACCURACY, kind="cost", title="Cost")
TARGET_FRACTION = 0.95  # the default target: this fraction of the family's reference accuracy
COLUMNS = (
    "step_ms",
    "compute_ms",
    "comm_ms",
    "wait_ms",
    "bytes_per_step",
    "bytes_per_step_max",
    "inter_node_bytes_per_step",
    "samples_per_s",
    "time_to_target_s",
)
PER_STEP_TEXT = (
    "Per step: a cumulative counter's growth between two consecutive evaluations divided "
    "by the steps "
    "between them; cells are medians over those intervals, workers and seeds. step_ms: "
    "wall time less "
    "evaluation; compute_ms: local gradients; comm_ms: the algorithm's communication and "
    "update; wait_ms: "
    "the per-step stop agreement. bytes_per_step: bytes each worker sent per step over "
    "the run, mean over "
    "workers and seeds (_max: the largest worker); inter_node_bytes_per_step: the same for "
    "bytes sent to workers on other nodes ('-' for run files written before it was recorded)"
    ". samples_per_s: workers x batch size / step_ms. time_to_target_s: wall time "
    "(evaluations included) "
    "at the first evaluation where the worst worker's test accuracy is at or above the "
    "target, mean over the "
    "seeds that reach it (never: none does)."
)


Experiment = tuple  # (row key, alpha, lr)


def _experiments(runs: Sequence[RunSummary]) -> dict[Experiment, list[RunSummary]]:
    groups: dict[Experiment, list[RunSummary]] = defaultdict(list)
    for run in runs:
        groups[(run.row_key, run.alpha, run.lr)].append(run)
    return dict(sorted(groups.items(), key=lambda kv: _experiment_order(kv[0])))


def _experiment_order(key: Experiment) -> tuple:
    row, alpha, lr = key
    return (row, alpha is None, -(alpha if alpha is not None else 0.0), lr is None, lr or 0.0)


def _mean_metric(runs: Sequence[RunSummary]) -> float:
    values = [r.metric for r in runs if r.converged]
    return float(np.mean(values)) if values else math.nan


def family_target(family: Family, settings: ReportSettings) -> tuple[float | None, str]:
    """The family's target accuracy and the words saying where it came from."""
    if settings.target_accuracy is not None:
        return (
            settings.target_accuracy,
            f"the target is {100 * settings.target_accuracy:.1f}% (--target-accuracy)",
        )
    experiments = _experiments(family.runs)
    allreduce = {k: v for k, v in experiments.items() if k[0][1] == "allreduce"}
    pool = allreduce or experiments
    means = [m for m in (_mean_metric(runs) for runs in pool.values()) if math.isfinite(m)]
    whose = (
        "all-reduce's" if allreduce else "the best experiment's (no all-reduce run in this family)"
    )
    if not means:
        return None, f"no target: {whose} accuracy is unknown (no converged run)"
    metric = _metric_text({r.metric_name for r in family.runs}, settings.last_epochs)
    target = TARGET_FRACTION * max(means)
    return target, (
        f"the target is {100 * TARGET_FRACTION:g}% of {whose} accuracy ({metric}, mean over seeds; "
        f"the best such experiment of the family, on any hardware) = {100 * target:.1f}%"
    )


def _fmt(value: float, spec: str) -> str:
    return "" if value is None or not math.isfinite(value) else format(value, spec)


# algorithms whose communication is a collective: run files written before its messages were
# counted (those without inter_node_bytes_sent) record 0 bytes_sent for it
COLLECTIVE_ALGOS = tuple(name for name, d in DECLARED.items() if d.communication == COLLECTIVE)
COLLECTIVE_NOTE = (
    "All-reduce's bytes columns are empty for run files written before its messages were counted "
    "(no inter_node_bytes_sent): they record 0 bytes for the collective (its fixed tree sends "
    "about 2(n-1)/n times the model per worker per step)."
)


def _uncounted(costs: StepCosts) -> bool:
    """A collective's costs from a run file that did not count its messages."""
    return costs.inter_node_bytes_per_step is None


def experiment_record(runs: Sequence[RunSummary], target: float | None) -> dict[str, Any]:
    """The cost columns (COLUMNS) of one experiment's seeds on one hardware."""
    measured = [r.costs for r in runs if r.costs is not None]
    if runs[0].algo in COLLECTIVE_ALGOS:  # an old file's zero is "not counted", not "nothing sent"
        measured = [
            dataclasses.replace(c, bytes_per_step=None) if _uncounted(c) else c for c in measured
        ]
    record: dict[str, Any] = {"step_ms": median([c.step_ms for c in measured])}
    for name in TIMERS:
        record[name] = median([c.timers_ms[name] for c in measured if name in c.timers_ms])
    sent = [c.bytes_per_step for c in measured if c.bytes_per_step is not None]
    record["bytes_per_step"] = float(np.mean([np.mean(b) for b in sent])) if sent else math.nan
    record["bytes_per_step_max"] = float(max(np.max(b) for b in sent)) if sent else math.nan
    inter = [
        c.inter_node_bytes_per_step for c in measured if c.inter_node_bytes_per_step is not None
    ]
    record["inter_node_bytes_per_step"] = (
        float(np.mean([np.mean(b) for b in inter])) if inter else math.nan
    )
    batch = runs[0].batch_size
    record["samples_per_s"] = (
        runs[0].world_size * batch * 1000 / record["step_ms"]
        if batch and math.isfinite(record["step_ms"]) and record["step_ms"] > 0
        else math.nan
    )
    times = []
    if target is not None:
        for run in runs:
            if run.time_s is not None and run.curve is not None:
                seconds = time_to_accuracy(run.time_s, run.curve.worst, target)
                if seconds is not None:
                    times.append(seconds)
    record["time_to_target_s"] = float(np.mean(times)) if times else math.nan
    record["n_reached"] = len(times)
    return record


def _display(record: dict[str, Any], n_seeds: int) -> list[str]:
    cells = [_fmt(record[name], ".3g") for name in ("step_ms", "compute_ms", "comm_ms", "wait_ms")]
    cells += [
        _fmt(record[name], ".6g")
        for name in ("bytes_per_step", "bytes_per_step_max", "inter_node_bytes_per_step")
    ]
    cells.append(_fmt(record["samples_per_s"], ".0f"))
    reached = record["n_reached"]
    time = "never" if not reached else _fmt(record["time_to_target_s"], ".3g")
    if 0 < reached < n_seeds:
        time += f" ({reached}/{n_seeds} reached)"
    cells.append(time)
    return [c or "-" for c in cells]


def _hardware_slug(key: tuple) -> str:
    info = dict(key)
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:6]
    if info.get("nodes") is None:
        return _slug(info.get("engine") or "unknown", "hardware", digest)
    return _slug(
        info.get("engine"), f"{info['nodes']}x{info.get('ranks_per_node')}".replace(" ", ""), digest
    )


def cost_table(
    family: Family,
    key: tuple,
    runs: Sequence[RunSummary],
    target: tuple[float | None, str],
    settings: ReportSettings,
    labels: RowLabels | None = None,
) -> Table:
    """One family's runs on one hardware: a row per experiment (seeds combined), labelled by
    ``labels`` (default: the labelling of ``runs``)."""
    experiments = _experiments(runs)
    labels = labels or RowLabels(runs)
    task = runs[0].task
    alphas = {k[1] for k in experiments}
    lrs_by_row: dict[tuple, set] = defaultdict(set)
    for row, _alpha, lr in experiments:
        lrs_by_row[row].add(lr)
    where = hardware_label(dict(key))
    value, words = target
    table = Table(
        name=_slug(family.name, _hardware_slug(key)),
        title=f"{family.title} -- on {where}",
        caption=(
            f"{PER_STEP_TEXT} Here {words}. Times compare only within one table (one "
            "engine, launch shape, "
            "CPU, GPU, MPI library and link); bytes compare across tables."
        ),
        kind="cost",
        metric="worst worker's test accuracy per evaluation"
        + ("" if value is None else f"; target {100 * value:.1f}%"),
        header=["Algorithm", "Topology", "alpha", "lr", "seeds", *COLUMNS],
        rows=[],
    )
    table.target = value
    for (row, alpha, lr), group in experiments.items():
        record = experiment_record(group, value)
        label = labels(task, row)
        table.rows.append(
            [label, row[2], _num(alpha), _num(lr), str(len(group)), *_display(record, len(group))]
        )
        table.records.append(
            {
                **_cell_base(family.base, label, row),
                "alpha": alpha,
                "lr": lr,
                "n_seeds": len(group),
                "hardware": where,
                "target": value,
                **{name: record[name] for name in COLUMNS},
                "n_reached": record["n_reached"],
            }
        )
        series = labels.series(task, row)
        if len(alphas) > 1:
            series += f", alpha={_num(alpha)}"
        if len(lrs_by_row[row]) > 1:
            series += f", lr={_num(lr)}"
        table.time_curves[series] = [
            (r.time_s, r.curve) for r in group if r.time_s is not None and r.curve is not None
        ]
        table.paths.update(r.path for r in group)
    if any(
        r.algo in COLLECTIVE_ALGOS and r.costs is not None and _uncounted(r.costs) for r in runs
    ):
        table.notes.append(COLLECTIVE_NOTE)
    return table


def cost_tables(
    runs: Sequence[RunSummary], settings: ReportSettings, labels: RowLabels | None = None
) -> list[Table]:
    """Per accuracy-table family: one cost table per hardware and launch shape its runs ran on."""
    labels = labels or RowLabels(runs)
    tables = []
    for family in spec_families(COST_SPEC, runs):
        target = family_target(family, settings)
        by_hardware: dict[tuple, list[RunSummary]] = defaultdict(list)
        for run in family.runs:
            by_hardware[run.hardware].append(run)
        for key in sorted(by_hardware, key=lambda k: hardware_label(dict(k))):
            tables.append(cost_table(family, key, by_hardware[key], target, settings, labels))
    return tables
