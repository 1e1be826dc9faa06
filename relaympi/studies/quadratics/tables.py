"""Plain-text tables of study rows, row look-ups, and the numbers the findings compare."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Row = dict[str, Any]


def grid(
    title: str,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    cells: Callable[[str, str], str],
) -> str:
    """A plain-text table: one row per row label, one column per column label."""
    body = [[cells(r, c) for c in col_labels] for r in row_labels]
    first = max(len(title), *(len(r) for r in row_labels))
    widths = [max(len(c), *(len(line[k]) for line in body)) for k, c in enumerate(col_labels)]
    lines = [
        f"{title:<{first}}  "
        + "  ".join(f"{c:>{w}}" for c, w in zip(col_labels, widths, strict=True))
    ]
    lines.append("-" * len(lines[0]))
    for label, line in zip(row_labels, body, strict=True):
        lines.append(
            f"{label:<{first}}  "
            + "  ".join(f"{v:>{w}}" for v, w in zip(line, widths, strict=True))
        )
    return "\n".join(lines)


def find(rows: list[Row], **match: Any) -> Row | None:
    """The first row whose columns hold every given value."""
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def expect_row(rows: list[Row], **match: Any) -> Row:
    """find's row, for a setting the study ran (so it wrote a row for it)."""
    row = find(rows, **match)
    assert row is not None, f"no row matches {match}"
    return row


def steps_of(rows: list[Row], **match: Any) -> int | None:
    """Steps to the target of the matching row; None if it did not reach it (or no row matches)."""
    row = find(rows, **match)
    return row["steps"] if row is not None and row["reached"] else None


def fmt(steps: float | None) -> str:
    return "n.r." if steps is None else f"{steps:g}"


def seed_steps(rows: list[Row], **match: Any) -> list[float]:
    """Steps to the target of every matching row (one per seed), math.inf where not reached."""
    return [
        float(r["steps"]) if r["reached"] else math.inf
        for r in rows
        if all(r.get(k) == v for k, v in match.items())
    ]


def median_steps(rows: list[Row], **match: Any) -> float | None:
    """The median over seeds of the matching rows' steps to the target, a seed that did not reach
    it counting as infinitely many; None if that median is infinite (or no row matches).

    Args:
        rows: the study's rows.
        **match: the columns' values (method, zeta2, n).

    Returns:
        The median steps, or None.
    """
    values = seed_steps(rows, **match)
    if not values:
        return None
    median = float(np.median(values))
    return median if math.isfinite(median) else None


def log_log_slope(ns: Sequence[int], steps: Sequence[float | None]) -> float | None:
    """Slope of log(steps) against log(n) (least squares); None if some setting did not reach the
    target."""
    if any(s is None for s in steps) or len(ns) < 2:
        return None
    return float(np.polyfit(np.log(ns), np.log(np.asarray(steps, dtype=float)), 1)[0])


def ratio_within(values: Sequence[float | None], tolerance: float) -> tuple[bool, float | None]:
    """Whether max/min <= 1 + tolerance, and the ratio (None if some setting did not reach the
    target)."""
    if not values or any(v is None for v in values):
        return False, None
    reached = [v for v in values if v is not None]  # all of them
    ratio = max(reached) / min(reached)
    return ratio <= 1.0 + tolerance, ratio
