"""What the optimization studies share: their problems, one tuned run per (method, setting), its row
and tables.

Each study tunes a constant learning rate per (method, setting) with tuning.tune, logs it,
stores it as a row (tuned_row), and prints two tables over its settings: steps to the target
and the tuned learning rate (tuned_tables).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relaympi.studies.quadratics.findings import StudyResult
from relaympi.studies.quadratics.tables import Row, expect_row, find, fmt, grid
from relaympi.studies.quadratics.tuning import Method, SearchConfig, Tuned, tune
from relaympi.tasks.quadratics import Quadratics, QuadraticsSpec, generate

log = logging.getLogger("relaympi.studies.quadratics")

# table marker: D² ran with (W + I) / 2 because W's smallest eigenvalue is < -1/3
EXACT_DIFFUSION_MARK = "+"


@dataclass(frozen=True)
class ProblemSettings:
    """Random quadratics of the paper's appendix; the global optimum is x* with ||x*|| = r0, x(0) =
    0."""

    dim: int = 10  # even, so double binary trees relay the same number of coordinates on each tree
    mu: float = 0.5  # smallest singular value of every A_i (Hessian eigenvalues >= mu^2)
    L: float = 1.0  # largest singular value of every A_i
    r0: float = 10.0


def make_problem(n: int, p: ProblemSettings, zeta2: float, sigma2: float, seed: int) -> Quadratics:
    return generate(
        n, QuadraticsSpec(dim=p.dim, mu=p.mu, L=p.L, zeta2=zeta2, r0=p.r0, sigma2=sigma2), seed
    )


def tuned_row(method: Method, tuned: Tuned, **setting: Any) -> Row:
    return {
        "method": method.label,
        "algo": method.algo,
        "topology": method.topology.name,
        **setting,
        "d2_exact_diffusion": method.d2_exact_diffusion,
        "lr": tuned.lr,
        "steps": tuned.steps if tuned.reached else -1,
        "reached": tuned.reached,
        "best_suboptimality": tuned.best_suboptimality,
        "lr_at_search_boundary": tuned.at_boundary,
        "wall_s": tuned.wall_s,
    }


def add_tuned(
    result: StudyResult,
    problem: Quadratics,
    method: Method,
    search: SearchConfig,
    context: str,
    **setting: Any,
) -> Row:
    """Tune ``method`` on ``problem``, log it under ``context``, and add its row (returned) to
    ``result``."""
    tuned = tune(problem, method, search)
    log.info(
        "%s %s: %s steps (lr %.3g, %.1fs)",
        context,
        method.label,
        fmt(tuned.steps),
        tuned.lr,
        tuned.wall_s,
    )
    row = tuned_row(method, tuned, **setting)
    result.add(row, tuned)
    return row


def steps_cell(row: Row | None) -> str:
    """Steps to the target, or "n.r." with the lowest suboptimality reached; marked for D² with (W +
    I) / 2."""
    if row is None:
        return "-"
    mark = EXACT_DIFFUSION_MARK if row.get("d2_exact_diffusion") else ""
    if row["reached"]:
        return f"{row['steps']}{mark}"
    return f"n.r. {row['best_suboptimality']:.1e}{mark}"


def tuned_tables(
    rows: list[Row],
    titles: tuple[str, str],
    labels: Sequence[str],
    columns: Mapping[str, Mapping[str, Any]],
    **fixed: Any,
) -> list[str]:
    """Two tables, methods x ``columns`` (column label -> the settings it matches): steps to the
    target, tuned lr.

    ``titles`` are the steps table's and the lr table's; ``fixed`` are settings every cell matches.
    """

    def row(label: str, column: str) -> Row | None:
        return find(rows, method=label, **fixed, **columns[column])

    def tuned_lr(label: str, column: str) -> float:  # every method was tuned in every column
        return expect_row(rows, method=label, **fixed, **columns[column])["lr"]

    steps_title, lr_title = titles
    return [
        grid(steps_title, labels, list(columns), lambda label, c: steps_cell(row(label, c))),
        grid(lr_title, labels, list(columns), lambda label, c: f"{tuned_lr(label, c):.3g}"),
    ]
