"""The report's labels: one per run in every table and plot, never Python's None."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaympi import report
from relaympi.report.cost import cost_tables
from relaympi.report.summary import ReportSettings
from relaympi.report.tables import all_tables
from tests import run_factories as rf

EVALS = 6


def _accuracy(top: float, workers: int) -> np.ndarray:
    return np.linspace(0.2, top, EVALS)[:, None] * np.ones((1, workers))


def _write_placed(root: Path) -> Path:
    """RelaySGD on 4 and 8 workers placed in rank order, and on 8 workers placed by node: by the
    nodes MPI reported (no --ranks-per-node) and by emulated nodes of 4 ranks; D2 beside them;
    two alphas."""
    for alpha in (1.0, 0.1):
        for n in (4, 8):
            rf.write_classification_run(
                root / f"relay_ranks_{alpha}_{n}.h5",
                _accuracy(0.8, n),
                alpha=alpha,
                placement="ranks",
                ranks_per_node=None,
            )
            rf.write_classification_run(
                root / f"d2_{alpha}_{n}.h5",
                _accuracy(0.7, n),
                algo="d2",
                topology="ring",
                alpha=alpha,
                placement="ranks",
                ranks_per_node=None,
            )
        rf.write_classification_run(
            root / f"relay_nodes_{alpha}.h5",
            _accuracy(0.75, 8),
            alpha=alpha,
            placement="nodes",
            ranks_per_node=4,
        )
        rf.write_classification_run(
            root / f"relay_mpi_nodes_{alpha}.h5",
            _accuracy(0.78, 8),
            alpha=alpha,
            placement="nodes",
            ranks_per_node=None,
        )
    return root


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_placed(tmp_path_factory.mktemp("placed"))


def _tables(root: Path):
    settings = ReportSettings()
    runs, cost_runs, _ = report.cli.load_all(report.find_run_files([root]), settings)
    return [*all_tables(runs, settings), *cost_tables(cost_runs, settings)]


def test_a_run_has_one_label_in_every_table_and_plot(placed: Path) -> None:
    tables = _tables(placed)
    assert {t.kind for t in tables} >= {"accuracy", "scaling", "cost"}
    row_labels = {row[0] for t in tables for row in t.rows}
    assert row_labels == {
        "RelaySGD, placement=ranks",
        "RelaySGD, placement=nodes",
        "RelaySGD, placement=nodes, ranks_per_node=4",
        "D2",
    }
    series = {name for t in tables for name in t.series}
    series |= {name for t in tables for by_label in t.curves.values() for name in by_label}
    assert series == {
        "RelaySGD, placement=ranks on double-binary-trees",
        "RelaySGD, placement=nodes on double-binary-trees",
        "RelaySGD, placement=nodes, ranks_per_node=4 on double-binary-trees",
        "D2 on ring",
    }
    time_series = {name for t in tables for name in t.time_curves}
    assert {name.split(", alpha=")[0] for name in time_series} <= series
    records = {r["algorithm"] for t in tables for r in t.records}
    assert records == row_labels


def test_labels_never_print_none(placed: Path, capsys: pytest.CaptureFixture) -> None:
    assert report.main([str(placed), "--format", "csv"]) == 0
    text = capsys.readouterr().out
    assert "None" not in text
    assert "RelaySGD, placement=ranks" in text
