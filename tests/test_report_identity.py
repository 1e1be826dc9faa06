"""The report never merges or hides distinct experiments: identity, labels, coverage, plot keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi import report
from relaympi.config import NON_SEMANTIC_KEYS, RunConfig, experiment_settings
from relaympi.report.summary import ReportSettings as Settings
from relaympi.report.tables import all_tables
from tests import run_factories as rf

EVALS = 10


def curve(top: float, workers: int = 4) -> np.ndarray:
    return np.linspace(0.1, 1.0, EVALS)[:, None] * np.full(workers, top)[None, :]


def _load(path: Path):
    runs, problems = report.load_runs(report.find_run_files([path]), Settings())
    return runs, problems, all_tables(runs, Settings())


def test_non_semantic_keys_are_named_and_everything_else_is_identity() -> None:
    fields = set(RunConfig().to_dict())
    assert (
        {
            "out",
            "checkpoint_dir",
            "log_every",
            "threads",
            "loader_workers",
            "eval_batch_size",
            "data_dir",
            "model_dir",
            "backend",
            "device",
        }
        <= NON_SEMANTIC_KEYS
        <= fields
    )
    settings = experiment_settings({"algo": "relay", "relay_lr_correction": True, "out": "a.h5"})
    assert settings["relay_lr_correction"] is True and "out" not in settings
    # a flag that cannot apply to the algorithm is not part of its identity
    assert "relay_mode" not in experiment_settings({"algo": "dpsgd", "relay_mode": "counts"})
    assert "nesterov" not in experiment_settings({"algo": "dpsgd", "momentum": 0.0})


@pytest.mark.parametrize(
    "algo, topology, flag, word",
    [
        (
            "relay",
            "double-binary-trees",
            {"relay_lr_correction": True},
            "RelaySGD + momentum, lr correction",
        ),
        ("qgm", "ring", {"nesterov": False}, "D-PSGD + quasi-global momentum, heavy ball"),
    ],
)
def test_runs_differing_in_one_flag_are_two_experiments(
    tmp_path: Path, algo, topology, flag, word
) -> None:
    base = dict(algo=algo, topology=topology, momentum=0.9, task="digits")
    rf.write_classification_run(tmp_path / "plain.h5", curve(0.5), **base)
    rf.write_classification_run(tmp_path / "flag.h5", curve(0.7), **base, **flag)
    runs, problems, tables = _load(tmp_path)
    assert problems == [] and len(runs) == 2
    (table,) = [t for t in tables if t.kind == "accuracy"]
    labels = [row[0] for row in table.rows]
    assert len(set(labels)) == 2 and word in labels, labels
    assert report.main([str(tmp_path)]) == 0


def test_runs_differing_in_batch_size_get_distinct_labels(tmp_path: Path) -> None:
    rf.write_classification_run(tmp_path / "a.h5", curve(0.5), batch_size=16)
    rf.write_classification_run(tmp_path / "b.h5", curve(0.7), batch_size=32)
    _, problems, tables = _load(tmp_path)
    (table,) = [t for t in tables if t.kind == "accuracy"]
    assert problems == []
    assert sorted(row[0] for row in table.rows) == [
        "RelaySGD, batch_size=16",
        "RelaySGD, batch_size=32",
    ]


def test_non_semantic_differences_are_still_duplicates(tmp_path: Path, capsys) -> None:
    rf.write_classification_run(tmp_path / "a.h5", curve(0.5), threads=1, out="a.h5", backend="mpi")
    rf.write_classification_run(
        tmp_path / "b.h5", curve(0.5), threads=4, out="b.h5", backend="local", workers=4
    )
    assert report.main([str(tmp_path)]) == 0
    assert "duplicate of" in capsys.readouterr().out


def test_drop_runs_appear_in_a_table(tmp_path: Path, capsys) -> None:
    for mode in ("counts", "previous", "initial"):
        rf.write_classification_run(
            tmp_path / f"drop_{mode}.h5", curve(0.6), alpha=0.01, drop_prob=0.1, relay_mode=mode
        )
    rf.write_classification_run(tmp_path / "reliable.h5", curve(0.9), alpha=1.0)
    runs, _, tables = _load(tmp_path)
    held = set().union(*(t.paths for t in tables))
    assert {r.path for r in runs} <= held
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Test accuracy: cifar10, 4 workers, drop_prob=0.1" in out
    for label in ("RelaySGD [previous]", "RelaySGD [initial]"):
        assert label in out


def test_a_run_no_table_can_hold_is_listed(tmp_path: Path, capsys) -> None:
    rf.write_classification_run(tmp_path / "good.h5", curve(0.9))
    with rf.RunWriter.create(
        tmp_path / "bare.h5", config=rf.make_config(seed=3), provenance={}, world_size=4
    ) as w:
        w.extend(
            {
                "step": np.array([1]),
                "epoch": np.array([1.0]),
                "time_s": np.array([0.0]),
                "train_loss": np.ones((1, 4)),
            }
        )
        w.set_status("completed")
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 finished but in no table" in out
    assert any("bare.h5" in line and "nothing to tabulate" in line for line in out.splitlines())


def _figures(monkeypatch, tables, out_dir):
    """write_plots, keeping each figure open for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from relaympi.report.plots import write_plots

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    paths = write_plots(tables, out_dir)
    return dict(zip((p.name for p in paths), figures, strict=True))


@pytest.mark.slow
def test_plots_keep_rows_apart_with_a_legend_per_curve(tmp_path: Path, monkeypatch) -> None:
    runs_dir = tmp_path / "runs"
    for topo in ("chain", "star", "double-binary-trees"):
        for alpha in (1.0, 0.1):
            rf.write_classification_run(
                runs_dir / f"{topo}_{alpha}.h5", curve(0.5 + alpha / 10), topology=topo, alpha=alpha
            )
    rf.write_classification_run(
        runs_dir / "chain8.h5", curve(0.6, 8), topology="edge-list:/data/chain.txt", alpha=0.1
    )
    rf.write_classification_run(runs_dir / "star8.h5", curve(0.6, 8), topology="star", alpha=0.1)
    _, _, tables = _load(runs_dir)
    figures = _figures(monkeypatch, tables, tmp_path)
    fig = figures["accuracy_cifar10_n4.png"]
    (ax,) = fig.axes
    (figure_legend,) = fig.legends  # the legend sits outside the axes, on the figure
    lines = list(figure_legend.get_texts())
    assert len(lines) == 3 and len({t.get_text() for t in lines}) == 3
    assert len(figures["curves_accuracy_cifar10_n4_alpha1.png"].legends[0].get_texts()) == 3
    scaling = figures["scaling_cifar10_alpha0.1.png"].axes[0]
    legend = {t.get_text() for t in figures["scaling_cifar10_alpha0.1.png"].legends[0].get_texts()}
    assert "RelaySGD on star" in legend and "RelaySGD on edge-list:/data/chain.txt" in legend
    # the star line joins 4 and 8 workers; the edge-list chain stands alone
    star = [c for c in scaling.containers if c.get_label() == "RelaySGD on star"][0]
    assert list(star.lines[0].get_xdata()) == [4, 8]
    assert [t.get_text() for t in scaling.get_xticklabels()] == ["4", "8"]


@pytest.mark.slow
def test_accuracy_vs_alpha_shows_inf_with_plain_ticks(tmp_path: Path, monkeypatch) -> None:
    runs_dir = tmp_path / "runs"
    for alpha in (0.01, 1.0, float("inf")):
        rf.write_classification_run(runs_dir / f"a{alpha}.h5", curve(0.5), alpha=alpha)
    _, _, tables = _load(runs_dir)
    (table,) = [t for t in tables if t.kind == "accuracy"]
    assert table.header[2] == "alpha=inf"
    figures = _figures(monkeypatch, tables, tmp_path)
    ax = figures["accuracy_cifar10_n4.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.01", "1", "inf"]
    (container,) = ax.containers
    assert (
        len(container.lines[0].get_xdata()) == 3
        and np.isfinite(np.asarray(container.lines[0].get_xdata(), dtype=float)).all()
    )


def test_out_naming_an_existing_file_exits_2(tmp_path: Path, capsys) -> None:
    rf.write_classification_run(tmp_path / "runs" / "a.h5", curve(0.5))
    existing = tmp_path / "notes.txt"
    existing.write_text("mine\n")
    with pytest.raises(SystemExit) as info:
        report.main([str(tmp_path / "runs"), "--out", str(existing)])
    assert info.value.code == 2
    assert f"--out {existing} is a file" in capsys.readouterr().err
    assert existing.read_text() == "mine\n"


def test_report_flags_a_worker_at_chance(tmp_path: Path, capsys) -> None:
    import h5py

    acc = curve(0.9)
    acc[:, 2] = 0.1
    path = rf.write_classification_run(tmp_path / "chance.h5", acc, task="digits")
    with h5py.File(path, "a") as f:
        f.attrs["num_classes"] = 10
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker(s) 2 at chance accuracy" in out and "chance.h5" in out
