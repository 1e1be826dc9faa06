"""The report's labels: one per run in every table and plot, never Python's None; and plots whose
legend covers neither the title, the caption nor most of the axes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


ALGOS = (
    ("allreduce", "fully-connected"),
    ("relay", "double-binary-trees"),
    ("relay-grad", "double-binary-trees"),
    ("dpsgd", "ring"),
    ("qgm", "ring"),
    ("d2", "ring"),
    ("gt", "ring"),
    ("sgp", "exponential"),
    ("relay", "edge-list:/home/someone/experiments/topologies/a_rather_long_chain.txt"),
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many series with long labels: every algorithm at two alphas and two worker counts, with
    costs (for the accuracy-over-time plots), and RelaySGD placed three ways."""
    root = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(0)
    for index, (algo, topology) in enumerate(ALGOS):
        for alpha in (1.0, 0.1):
            for n in (4, 8):
                rf.write_classification_run(
                    root / f"{index}_{algo}_{alpha}_{n}.h5",
                    np.clip(
                        _accuracy(0.6 + 0.03 * index, n) + rng.normal(0, 0.02, (EVALS, n)), 0, 1
                    ),
                    algo=algo,
                    topology=topology,
                    alpha=alpha,
                    costs={"time_s": np.arange(EVALS) * (1 + 0.1 * index)},
                )
    for path in _write_placed(tmp_path_factory.mktemp("placed")).glob("relay_*.h5"):
        path.rename(root / path.name)
    return root


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.slow
def test_legends_cover_neither_title_caption_nor_axes(
    sweep: Path, tmp_path: Path, monkeypatch
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from relaympi.report.plots import write_plots

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure for inspection
    paths = write_plots(_tables(sweep), tmp_path)
    kinds = {p.name.split("_")[0] for p in paths}
    assert kinds == {"accuracy", "curves", "scaling", "time"}, sorted(p.name for p in paths)
    for path, fig in zip(paths, figures, strict=True):
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        (ax,) = fig.axes
        (legend,) = fig.legends
        whole = fig.bbox
        boxes = {
            "title": fig._suptitle.get_window_extent(renderer),
            "caption": ax.title.get_window_extent(renderer),
            "axes": ax.get_tightbbox(renderer),
            "legend": legend.get_window_extent(renderer),
        }
        for name, box in boxes.items():  # nothing is clipped by the figure's edge
            assert whole.x0 <= box.x0 and box.x1 <= whole.x1 + 1, (path.name, name)
            assert whole.y0 <= box.y0 and box.y1 <= whole.y1 + 1, (path.name, name)
        for name in ("title", "caption", "axes"):
            assert not _overlap(boxes["legend"], boxes[name]), (path.name, name)
        assert not _overlap(boxes["caption"], boxes["title"]), path.name
        # long labels do not shrink the axes: they keep most of the figure's width
        assert ax.get_window_extent(renderer).width > 0.75 * whole.width, path.name
        assert len(legend.get_texts()) >= 9
