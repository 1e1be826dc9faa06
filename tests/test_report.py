"""The report: table numbers against hand computations, problem files, formats, outputs, exit
codes."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi import report
from relaympi.report.summary import ReportSettings, worker_means
from relaympi.report.tables import all_tables
from tests import run_factories as rf

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
EVALS = 10  # epochs 1..10: the paper's window (last 5 epochs) is epochs 6..10, indices 5..9
LRS = (0.05, 0.1, 0.2)


def curve(top: float, seed: int) -> np.ndarray:
    """[evals, workers]: worker w rises linearly to top - 0.02 w, seed shifts everything."""
    ramp = np.linspace(0.1, 1.0, EVALS)[:, None]
    return ramp * (top - 0.02 * np.arange(WORKERS))[None, :] + 0.003 * seed


def quality(algo: str, lr: float) -> float:
    if algo == "relay":  # peak at lr 0.1: sandwiched
        return {0.05: 0.80, 0.1: 0.90, 0.2: 0.85}[lr]
    return {0.05: 0.70, 0.1: 0.75, 0.2: 0.80}[lr]  # d2: best at the largest lr: edge of the grid


def hand_metric(acc: np.ndarray) -> float:
    """The paper's CIFAR metric, computed plainly: worst worker of the mean over epochs 6..10."""
    return min(acc[5:10, w].mean() for w in range(acc.shape[1]))


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hand-made runs with known curves; returns the directory."""
    root = tmp_path_factory.mktemp("runs") / "results dir"
    for algo, topology in (("relay", "double-binary-trees"), ("d2", "ring")):
        for alpha in (1.0, 0.01):
            for lr in LRS:
                for seed in range(3):
                    path = root / f"{algo}_{alpha}_{lr}_{seed}.h5"
                    if algo == "d2" and alpha == 0.01 and lr == 0.2 and seed == 2:
                        rf.write_classification_run(
                            path,
                            curve(0.5, seed),
                            algo=algo,
                            topology=topology,
                            alpha=alpha,
                            lr=lr,
                            seed=seed,
                            status="diverged",
                            diverged_epoch=7.5,
                        )
                        continue
                    rf.write_classification_run(
                        path,
                        curve(quality(algo, lr), seed),
                        algo=algo,
                        topology=topology,
                        alpha=alpha,
                        lr=lr,
                        seed=seed,
                    )
    for seed, epoch in enumerate((4.0, 6.0, 5.0)):  # every seed of one cell diverged
        rf.write_classification_run(
            root / f"sgp_{seed}.h5",
            curve(0.3, seed),
            algo="sgp",
            topology="exponential",
            alpha=0.01,
            lr=0.1,
            seed=seed,
            status="diverged",
            diverged_epoch=epoch,
        )
    return root


@pytest.fixture(scope="module")
def tables(sweep_dir: Path) -> dict[str, list]:
    runs, problems = report.load_runs(report.find_run_files([sweep_dir]), ReportSettings())
    assert problems == []
    result: dict[str, list] = {}
    for table in all_tables(runs, ReportSettings()):
        result.setdefault(table.kind, []).append(table)
    return result


def _record(table, **match) -> dict:
    found = [r for r in table.records if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, table.records)
    return found[0]


def test_worker_means_window() -> None:
    epoch = np.array([0.0, 1, 2, 3, 4, 5, 6, 7])
    acc = np.arange(16, dtype=float).reshape(8, 2)
    # epochs 3..7 (> 7 - 5)
    np.testing.assert_allclose(worker_means(epoch, acc, 5), acc[3:].mean(axis=0))
    short = np.array([0.0, 0.5, 1.0])  # shorter than the window: everything after epoch 0
    np.testing.assert_allclose(worker_means(short, acc[:3], 5), acc[1:3].mean(axis=0))
    # only the initial eval
    np.testing.assert_allclose(worker_means(np.array([0.0]), acc[:1], 5), acc[0])


def test_accuracy_table_numbers(tables: dict) -> None:
    (table,) = tables["accuracy"]
    assert table.header == ["Algorithm", "Topology", "alpha=1", "alpha=0.01"]
    relay = _record(table, algo="relay", alpha=1.0)
    per_seed = [hand_metric(curve(0.90, seed)) for seed in range(3)]
    assert relay["lr"] == 0.1
    assert relay["mean"] == pytest.approx(np.mean(per_seed), abs=1e-12)
    assert relay["min"] == pytest.approx(min(per_seed), abs=1e-12)
    assert relay["max"] == pytest.approx(max(per_seed), abs=1e-12)
    assert relay["n_seeds"] == 3 and relay["n_diverged"] == 0
    # by hand: worker 3 is worst (top 0.84); mean of ramp over epochs 6..10 =
    # mean(linspace(.1,1,10)[5:]) = 0.8
    assert per_seed[0] == pytest.approx(0.8 * 0.84)
    expected = (
        f"{100 * np.mean(per_seed):.1f}% [{100 * min(per_seed):.1f}%, {100 * max(per_seed):.1f}%]"
    )
    assert relay["display"] == expected
    assert any(expected in " ".join(row) for row in table.rows)

    # d2 at alpha 0.01: lr 0.2 has the best mean but a diverged seed, so 0.1 wins (paper's rule)
    d2 = _record(table, algo="d2", alpha=0.01)
    assert d2["lr"] == 0.1
    assert d2["mean"] == pytest.approx(np.mean([hand_metric(curve(0.75, s)) for s in range(3)]))

    sgp = _record(table, algo="sgp", alpha=0.01)
    assert sgp["n_diverged"] == 3 and np.isnan(sgp["mean"])
    assert sgp["display"] == "diverged at epochs 4-6"
    assert "Metric: the worst worker's mean test accuracy over the last 5 epochs" in table.caption


def test_lr_table(tables: dict) -> None:
    (table,) = tables["lr"]
    relay = _record(table, algo="relay", alpha=1.0)
    assert (relay["lr"], relay["lr_sandwiched"], relay["display"]) == (0.1, True, "0.1 (3)")
    d2 = _record(table, algo="d2", alpha=1.0)
    assert (d2["lr"], d2["lr_sandwiched"], d2["display"]) == (0.2, False, "0.2 (3) *")
    d2_het = _record(table, algo="d2", alpha=0.01)
    assert (d2_het["lr"], d2_het["lr_sandwiched"]) == (0.1, True)
    assert d2_het["lr_grid"] == "0.05 0.1 0.2"
    sgp = _record(table, algo="sgp", alpha=0.01)
    assert sgp["display"] == "0.1 (0 of 3) *"
    assert "edge of the grid" in table.caption


def test_partially_diverged_cell(tmp_path: Path) -> None:
    for seed in range(3):
        status = "diverged" if seed == 1 else "completed"
        rf.write_classification_run(
            tmp_path / f"r{seed}.h5", curve(0.9, seed), seed=seed, status=status, diverged_epoch=3.0
        )
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    (table,) = [t for t in all_tables(runs, ReportSettings()) if t.kind == "accuracy"]
    record = table.records[0]
    values = [hand_metric(curve(0.9, s)) for s in (0, 2)]
    assert record["mean"] == pytest.approx(np.mean(values))
    assert (record["n_seeds"], record["n_diverged"]) == (3, 1)
    assert record["display"].endswith("(1/3 diverged)")
    assert table.notes and "diverged seeds" in table.notes[0]


def test_mean_metric_for_imagenet_and_short_runs(tmp_path: Path) -> None:
    epochs = np.array([0.0, 0.5, 1.0, 1.5, 2.0])  # shorter than 5 epochs
    acc = np.array([[0.1, 0.1], [0.2, 0.4], [0.3, 0.5], [0.4, 0.6], [0.5, 0.9]])
    rf.write_classification_run(tmp_path / "in.h5", acc, epochs, task="imagenet")
    rf.write_classification_run(tmp_path / "c.h5", acc, epochs, task="cifar10")
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    by_task = {r.task: r for r in runs}
    assert by_task["imagenet"].metric == pytest.approx(
        np.mean([(0.2 + 0.3 + 0.4 + 0.5) / 4, (0.4 + 0.5 + 0.6 + 0.9) / 4])
    )
    assert by_task["cifar10"].metric == pytest.approx((0.2 + 0.3 + 0.4 + 0.5) / 4)
    tables = {
        t.records[0]["task"]: t for t in all_tables(runs, ReportSettings()) if t.kind == "accuracy"
    }
    assert "mean over workers" in tables["imagenet"].caption
    assert "worst worker" in tables["cifar10"].caption


def test_scaling_and_robustness_tables(tmp_path: Path) -> None:
    for n, top in ((4, 0.9), (8, 0.8)):
        for seed in range(2):
            acc = np.linspace(0.1, 1.0, EVALS)[:, None] * np.full(n, top)[None, :] + 0.01 * seed
            rf.write_classification_run(tmp_path / f"n{n}_{seed}.h5", acc, alpha=0.01, seed=seed)
    for drop, top in ((0.1, 0.7),):
        rf.write_classification_run(
            tmp_path / f"d{drop}.h5", curve(top, 0), alpha=0.01, drop_prob=drop
        )
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    kinds = {t.kind: t for t in all_tables(runs, ReportSettings())}
    scaling = kinds["scaling"]
    assert scaling.header[2:] == ["4 workers", "8 workers"]
    record = _record(scaling, world_size=8)
    assert record["mean"] == pytest.approx(np.mean([0.8 * 0.8 + 0.01 * s for s in range(2)]))
    robustness = kinds["robustness"]
    assert robustness.header[2:] == ["reliable", "10% dropped"]
    assert _record(robustness, drop_prob=0.1)["mean"] == pytest.approx(hand_metric(curve(0.7, 0)))
    assert _record(robustness, drop_prob=0.0)["mean"] == pytest.approx(
        np.mean([0.8 * 0.9 + 0.01 * s for s in range(2)])
    )


def test_quadratics_steps_to_target(tmp_path: Path) -> None:
    steps = np.array([0, 10, 20, 30, 40])
    rf.write_quadratics_run(
        tmp_path / "a0.h5", [1, 1e-2, 1e-4, 1e-6, 1e-8], steps, seed=0, world_size=4
    )
    rf.write_quadratics_run(
        tmp_path / "a1.h5", [1, 1e-1, 1e-3, 1e-5, 1e-7], steps, seed=1, world_size=4
    )
    rf.write_quadratics_run(
        tmp_path / "b.h5", [1, 0.5, 0.4, 0.3, 0.2], steps, algo="d2", topology="ring", world_size=4
    )
    rf.write_quadratics_run(tmp_path / "c.h5", [1, 1e-3, 1e-7, 1e-9, 1e-9], steps, world_size=8)
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    (table,) = [t for t in all_tables(runs, ReportSettings()) if t.kind == "quadratics"]
    relay4 = _record(table, algo="relay", world_size=4)
    assert (relay4["mean"], relay4["min"], relay4["max"], relay4["n_reached"]) == (35.0, 30, 40, 2)
    assert relay4["display"] == "35 [30, 40]"
    assert _record(table, algo="relay", world_size=8)["mean"] == 20
    assert _record(table, algo="d2", world_size=4)["display"] == "not reached"
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), ReportSettings(target=1e-3))
    (table,) = [t for t in all_tables(runs, ReportSettings(target=1e-3)) if t.kind == "quadratics"]
    assert _record(table, algo="relay", world_size=4)["mean"] == 20  # 1e-4 and 1e-3 at step 20
    assert "<= 0.001" in table.title


def test_problem_files_are_listed_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rf.write_classification_run(tmp_path / "good.h5", curve(0.9, 0))
    rf.write_not_hdf5(tmp_path / "corrupt.h5")
    rf.write_empty_file(tmp_path / "empty.h5")
    rf.write_unknown_schema(tmp_path / "future.h5")
    rf.write_truncated_file(tmp_path / "truncated.h5", tmp_path / "good.h5")
    rf.write_classification_run(
        tmp_path / "sub" / "running.h5", curve(0.9, 1), seed=1, status="running"
    )
    rf.write_classification_run(tmp_path / "failed.h5", curve(0.9, 2), seed=2, status="failed")
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    problems = out[out.index("Problems") :]
    for name, reason in (
        ("corrupt.h5", "not an HDF5 file"),
        ("empty.h5", "empty file"),
        ("future.h5", "unknown schema_version 99"),
        ("truncated.h5", "truncated"),
        ("running.h5", "status running, last evaluation at step 1000 (epoch 10)"),
        ("failed.h5", "status failed"),
    ):
        assert any(name in line and reason in line for line in problems.splitlines()), (
            name,
            problems,
        )
    assert "1 completed, 0 diverged, 6 with problems" in out
    assert f"{100 * hand_metric(curve(0.9, 0)):.1f}%" in out


def test_duplicates_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rf.write_classification_run(tmp_path / "a.h5", curve(0.9, 0))
    rf.write_classification_run(tmp_path / "b.h5", curve(0.8, 0))
    assert report.main([str(tmp_path)]) == 0
    assert "duplicate of" in capsys.readouterr().out


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # no run file: the path is the mistake, as a missing one is
    with pytest.raises(SystemExit) as info:
        report.main([str(tmp_path)])
    assert info.value.code == 2 and "no run files" in capsys.readouterr().err
    rf.write_empty_file(tmp_path / "empty.h5")
    assert report.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "none of the 1 run file(s)" in captured.err and "empty file" in captured.out
    for argv in (
        ["--frobnicate"],
        ["--format", "pdf", str(tmp_path)],
        [str(tmp_path / "nope")],
        ["--target", "-1", str(tmp_path)],
    ):
        with pytest.raises(SystemExit) as info:
            report.main(argv)
        assert info.value.code == 2


def test_formats(sweep_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert report.main([str(sweep_dir), "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "### Test accuracy: cifar10, 4 workers" in markdown
    assert "| Algorithm | Topology | alpha=1 | alpha=0.01 |" in markdown
    assert report.main([str(sweep_dir), "--format", "latex"]) == 0
    latex = capsys.readouterr().out
    assert "\\begin{tabular}" in latex and "\\toprule" in latex and "$\\alpha=0.01$" in latex
    assert "\\%" in latex and "{\\color{gray}diverged at epochs 4-6}" in latex
    assert report.main([str(sweep_dir), "--format", "csv"]) == 0
    text = capsys.readouterr().out
    blocks = [b for b in text.split("\n\n") if b.startswith("# accuracy")]
    rows = list(csv.DictReader(io.StringIO(blocks[0].split("\n", 1)[1])))
    relay = [r for r in rows if r["algo"] == "relay" and r["alpha"] == "1.0"][0]
    assert float(relay["mean"]) == pytest.approx(
        np.mean([hand_metric(curve(0.9, s)) for s in range(3)])
    )


@pytest.mark.slow
def test_out_writes_tables_and_plots(
    sweep_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "report out"
    assert report.main([str(sweep_dir), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "accuracy_cifar10_n4.csv",
        "accuracy_cifar10_n4.tex",
        "lr_cifar10_n4.csv",
        "lr_cifar10_n4.tex",
    } <= names
    assert "accuracy_cifar10_n4.png" in names  # accuracy vs alpha
    assert {
        "curves_accuracy_cifar10_n4_alpha1.png",
        "curves_accuracy_cifar10_n4_alpha0.01.png",
    } <= names
    for name in names:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((out / "accuracy_cifar10_n4.csv").open()))
    assert len(rows) == 5 and {"mean", "min", "max", "n_seeds", "n_diverged", "lr"} <= set(rows[0])


@pytest.mark.slow
@pytest.mark.parametrize("module", ["relaympi.report", "benchmarks.report"])
def test_module_entry_point(sweep_dir: Path, module: str) -> None:
    """`python -m relaympi.report`, and `python -m benchmarks.report`, the name it had before."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", module, str(sweep_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Test accuracy: cifar10, 4 workers" in proc.stdout


# -- the metric's order of operations, on curves that cross --------------------------------------
# Three workers, evaluations at epochs 0..10 (epoch 0: the initial model). In the window (epochs
# 6..10) A falls, B rises and C wobbles, so every order of min / mean / last evaluation differs:
CROSSING_WINDOW = np.array(
    [  # A     B     C
        [0.90, 0.40, 0.80],  # epoch 6
        [0.80, 0.60, 0.70],
        [0.70, 0.70, 0.75],
        [0.60, 0.80, 0.70],
        [0.50, 0.85, 0.72],  # epoch 10
    ]
)
CROSSING_BEFORE = np.array(
    [
        [0.00, 0.00, 0.00],  # epoch 0: never in the window
        [0.30, 0.90, 0.60],
        [0.40, 0.90, 0.60],
        [0.50, 0.90, 0.60],
        [0.60, 0.90, 0.60],
        [0.70, 0.90, 0.60],  # epoch 5: just outside the window
    ]
)
CROSSING = np.vstack([CROSSING_BEFORE, CROSSING_WINDOW])
CROSSING_EPOCHS = np.arange(11, dtype=float)
# By hand, from the rows above:
#   each worker's window mean: A 3.50/5 = 0.700, B 3.35/5 = 0.670, C 3.67/5 = 0.734
PAPER_WORST = 0.670  # the paper: each worker's mean over the last 5 epochs, then the worst worker
PAPER_MEAN = (0.700 + 0.670 + 0.734) / 3  # ImageNet / AG News: then the mean over workers
WRONG_ORDERS = {
    "worst worker per evaluation, then mean over the window": (0.4 + 0.6 + 0.7 + 0.6 + 0.5) / 5,
    "worst worker at the last evaluation": 0.50,
    "worst single evaluation": 0.40,
    "best worker's window mean": 0.734,
    "worst worker's mean over all epochs 1..10": (2.5 + 3.5) / 10,  # A; B 0.785, C 0.667
    "worst worker's mean including epoch 0": (2.5 + 3.5) / 11,
}


def test_crossing_curves_hand_values_are_all_different() -> None:
    """The fixture discriminates: all orders differ (> 0.01), the paper's from every other by >
    0.02."""
    assert CROSSING_WINDOW.mean(axis=0) == pytest.approx([0.700, 0.670, 0.734])
    assert CROSSING[1:].mean(axis=0).min() == pytest.approx(0.6)
    values = [PAPER_WORST, PAPER_MEAN, *WRONG_ORDERS.values()]
    gaps = np.abs(np.subtract.outer(values, values))[np.triu_indices(len(values), 1)]
    assert gaps.min() > 0.01, values
    assert min(abs(PAPER_WORST - v) for v in values[1:]) > 0.02


@pytest.mark.parametrize(
    "task, expected",
    [
        ("cifar10", PAPER_WORST),
        ("digits", PAPER_WORST),
        ("imagenet", PAPER_MEAN),
        ("agnews", PAPER_MEAN),
    ],
)
def test_metric_order_on_crossing_curves(tmp_path: Path, task: str, expected: float) -> None:
    rf.write_classification_run(tmp_path / "r.h5", CROSSING, CROSSING_EPOCHS, task=task)
    runs, problems = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    assert problems == []
    (run,) = runs
    assert run.metric == pytest.approx(expected, abs=1e-12)
    for name, wrong in WRONG_ORDERS.items():
        assert abs(run.metric - wrong) > 0.02, name
    (table,) = [t for t in all_tables(runs, ReportSettings()) if t.kind == "accuracy"]
    assert table.records[0]["display"] == f"{100 * expected:.1f}%"
    assert any(
        row[0].startswith("RelaySGD") and row[-1] == f"{100 * expected:.1f}%" for row in table.rows
    ), table.rows


def test_scaling_and_robustness_tables_on_crossing_curves(tmp_path: Path) -> None:
    """Each table cell is the mean over seeds of the per-run metric, computed in the paper's
    order."""
    shifted = CROSSING + 0.02  # seed 1: every worker 2 points higher, window means 0.72/0.69/0.754
    wide = np.hstack([CROSSING, CROSSING[:, ::-1] * 0.9])  # 6 workers; worst: 0.9 x B = 0.603
    lossy = CROSSING[:, [2, 0, 1]] - 0.05  # permuted workers: worst is still B, 0.62
    common: dict[str, Any] = dict(alpha=0.01, task="cifar10")
    rf.write_classification_run(tmp_path / "n3s0.h5", CROSSING, CROSSING_EPOCHS, seed=0, **common)
    rf.write_classification_run(tmp_path / "n3s1.h5", shifted, CROSSING_EPOCHS, seed=1, **common)
    rf.write_classification_run(tmp_path / "n6s0.h5", wide, CROSSING_EPOCHS, seed=0, **common)
    rf.write_classification_run(
        tmp_path / "n3d.h5", lossy, CROSSING_EPOCHS, seed=0, drop_prob=0.1, **common
    )
    runs, problems = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    assert problems == []
    kinds = {t.kind: t for t in all_tables(runs, ReportSettings())}

    scaling = kinds["scaling"]
    assert scaling.header[2:] == ["3 workers", "6 workers"]
    three = _record(scaling, world_size=3)
    assert (three["mean"], three["min"], three["max"]) == pytest.approx(
        (0.680, 0.670, 0.690), abs=1e-12
    )
    assert three["display"] == "68.0% [67.0%, 69.0%]"
    assert _record(scaling, world_size=6)["mean"] == pytest.approx(0.603, abs=1e-12)
    assert any(row[2:] == ["68.0% [67.0%, 69.0%]", "60.3%"] for row in scaling.rows), scaling.rows

    robustness = kinds["robustness"]
    assert robustness.header[2:] == ["reliable", "10% dropped"]
    assert _record(robustness, drop_prob=0.0)["mean"] == pytest.approx(0.680, abs=1e-12)
    assert _record(robustness, drop_prob=0.1)["mean"] == pytest.approx(0.620, abs=1e-12)
    assert any(row[2:] == ["68.0% [67.0%, 69.0%]", "62.0%"] for row in robustness.rows), (
        robustness.rows
    )
