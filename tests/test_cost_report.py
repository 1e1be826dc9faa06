"""The report's cost tables, accuracy over wall-clock time, show's time to target, and the
provenance that keeps times from different hardware apart."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi import provenance, report, results
from tests import run_factories as rf

# Seed 0 of a 2-worker run evaluated at steps 0, 100, 200, 300 (epochs 0..3, batch 32 per worker).
EPOCHS = np.array([0.0, 1.0, 2.0, 3.0])
# worst worker: 0.1, 0.5, 0.8, 0.9
ACC = np.array([[0.1, 0.1], [0.5, 0.9], [0.85, 0.8], [0.9, 0.9]])
SEED0 = {
    "time_s": [0.0, 1.0, 2.5, 3.5],
    # slowest worker's evaluation per interval: 0.2 s each -> wall per step 8, 13, 8 ms
    "time_eval_s": [[0, 0], [0.1, 0.2], [0.3, 0.4], [0.5, 0.6]],
    # per step per worker (ms): intervals 1..3 -> (2, 4), (4, 4), (2, 2)
    "time_compute_s": [[0, 0], [0.2, 0.4], [0.6, 0.8], [0.8, 1.0]],
    # (1, 1), (1, 1), (5, 5)
    "time_comm_s": [[0, 0], [0.1, 0.1], [0.2, 0.2], [0.7, 0.7]],
    # (0, 1), (0, 1), (0, 1)
    "time_sync_s": [[0, 0], [0, 0.1], [0, 0.2], [0, 0.3]],
    # 1 and 3 bytes per step
    "bytes_sent": [[0, 0], [100, 300], [200, 600], [300, 900]],
}
SEED1 = {
    "time_s": [0.0, 2.2, 4.2, 6.2],  # no evaluation time: 22, 20, 20 ms per step
    "time_compute_s": [[0, 0], [1, 1], [2, 2], [3, 3]],  # 10 ms per step, both workers
    "time_comm_s": [[0, 0], [0.1, 0.1], [0.2, 0.2], [0.3, 0.3]],  # 1 ms
    "time_sync_s": [[0, 0], [0, 0], [0, 0], [0, 0]],
    "bytes_sent": [[0, 0], [500, 300], [1000, 600], [1500, 900]],  # 5 and 3 bytes per step
}
LOCAL = {
    "transport_backend": "local",
    "hosts": ["a"],
    "nodes": 1,
    "ranks_per_node": 2,
    "cpu_model": "CPU X",
}
BATCHED = {**LOCAL, "transport_backend": "batched", "transport_device": "cpu", "ranks_per_node": 1}


def write(
    path: Path, costs: dict, acc: np.ndarray = ACC, prov: dict | None = None, **config
) -> Path:
    config = {"task": "digits", "alpha": 1.0, **config}
    return rf.write_classification_run(
        path, acc, EPOCHS, costs=costs, provenance=prov or LOCAL, **config
    )


def csv_tables(tmp_path: Path, *args: str) -> dict[str, list[dict[str, str]]]:
    """--format csv's tables by title: one dict per CSV line."""
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert report.main([str(tmp_path), "--format", "csv", *args]) == 0
    tables = {}
    for block in out.getvalue().split("\n\n"):
        first, _, body = block.partition("\n")
        if first.startswith("# ") and ": " in first and body and not first.startswith("# problems"):
            tables[first.split(": ", 1)[1]] = list(csv.DictReader(io.StringIO(body)))
    return tables


def cost_rows(tables: dict) -> dict[str, list[dict[str, str]]]:
    return {title: rows for title, rows in tables.items() if title.startswith("Cost:")}


def test_every_cost_column_of_one_run_by_hand(tmp_path: Path) -> None:
    write(
        tmp_path / "a.h5",
        {**SEED0, "inter_node_bytes_sent": [[0, 0], [50, 100], [100, 200], [150, 300]]},
    )
    (rows,) = cost_rows(csv_tables(tmp_path, "--target-accuracy", "0.8")).values()
    (row,) = rows
    expected = {
        "step_ms": 8.0,  # median of 8, 13, 8
        "compute_ms": 3.0,  # median of 2, 4, 4, 4, 2, 2
        "comm_ms": 1.0,  # median of 1, 1, 1, 1, 5, 5
        "wait_ms": 0.5,  # median of 0, 1, 0, 1, 0, 1
        "bytes_per_step": 2.0,
        "bytes_per_step_max": 3.0,
        "inter_node_bytes_per_step": 0.75,  # mean of 0.5 and 1
        "samples_per_s": 2 * 32 * 1000 / 8.0,
        # worst worker 0.5 after step 100 and exactly 0.8 at step 200: crossed between evaluations,
        # reported at the first evaluation at or above the target
        "time_to_target_s": 2.5,
    }
    for name, value in expected.items():
        assert float(row[name]) == pytest.approx(value, rel=1e-12), name
    assert row["n_seeds"] == "1" and row["n_reached"] == "1" and float(row["target"]) == 0.8


def test_a_run_that_never_reaches_the_target_has_an_empty_time(tmp_path: Path, capsys) -> None:
    write(tmp_path / "a.h5", SEED0)
    (rows,) = cost_rows(csv_tables(tmp_path, "--target-accuracy", "0.95")).values()
    assert rows[0]["time_to_target_s"] == "" and rows[0]["n_reached"] == "0"
    assert rows[0]["inter_node_bytes_per_step"] == ""  # no run records nodes yet
    capsys.readouterr()
    assert report.main([str(tmp_path), "--target-accuracy", "0.95"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RelaySGD")][-1]
    assert line.split()[-1] == "never"


def test_seeds_are_combined(tmp_path: Path) -> None:
    write(tmp_path / "s0.h5", SEED0, seed=0)
    write(tmp_path / "s1.h5", SEED1, seed=1)
    (rows,) = cost_rows(csv_tables(tmp_path, "--target-accuracy", "0.8")).values()
    (row,) = rows
    assert row["n_seeds"] == "2" and row["n_reached"] == "2"
    assert float(row["step_ms"]) == pytest.approx((13 + 20) / 2)  # median of 8, 13, 8, 22, 20, 20
    assert float(row["compute_ms"]) == pytest.approx((4 + 10) / 2)  # 2,2,2,4,4,4 | 10 x 6
    assert float(row["comm_ms"]) == pytest.approx(1.0)
    assert float(row["wait_ms"]) == pytest.approx(0.0)  # 0 x 9, 1 x 3
    assert float(row["bytes_per_step"]) == pytest.approx((2 + 4) / 2)
    assert float(row["bytes_per_step_max"]) == pytest.approx(5.0)
    assert float(row["time_to_target_s"]) == pytest.approx((2.5 + 4.2) / 2)
    assert float(row["samples_per_s"]) == pytest.approx(2 * 32 * 1000 / 16.5)


def test_a_seed_short_of_the_target_is_counted(tmp_path: Path, capsys) -> None:
    write(tmp_path / "s0.h5", SEED0, seed=0)
    write(tmp_path / "s1.h5", SEED1, acc=ACC * 0.5, seed=1)
    (rows,) = cost_rows(csv_tables(tmp_path, "--target-accuracy", "0.8")).values()
    assert rows[0]["n_reached"] == "1" and float(rows[0]["time_to_target_s"]) == pytest.approx(2.5)
    capsys.readouterr()
    assert report.main([str(tmp_path), "--target-accuracy", "0.8"]) == 0
    assert "2.5 (1/2 reached)" in capsys.readouterr().out


def test_default_target_is_95_percent_of_allreduce(tmp_path: Path, capsys) -> None:
    # metric: worst worker mean 0.8
    flat = np.array([[0.1, 0.1], [0.8, 0.8], [0.8, 0.8], [0.8, 0.8]])
    write(tmp_path / "ar.h5", SEED0, acc=flat, algo="allreduce", topology="fully-connected")
    write(tmp_path / "relay.h5", SEED0, acc=np.minimum(ACC + 0.05, 1))  # better than all-reduce
    (rows,) = cost_rows(csv_tables(tmp_path)).values()
    assert [float(r["target"]) for r in rows] == pytest.approx([0.95 * 0.8] * 2)
    by_algo = {r["algo"]: r for r in rows}
    # 0.8 >= 0.76 at the second evaluation
    assert float(by_algo["allreduce"]["time_to_target_s"]) == 1.0
    assert float(by_algo["relay"]["time_to_target_s"]) == 2.5  # 0.55 < 0.76 <= 0.85
    capsys.readouterr()
    assert report.main([str(tmp_path)]) == 0
    assert "95% of all-reduce's accuracy" in capsys.readouterr().out


def test_default_target_without_allreduce_is_the_best_experiments(tmp_path: Path, capsys) -> None:
    # metric: worst of worker means (0.75, 0.8667) over epochs 1-3
    write(tmp_path / "relay.h5", SEED0)
    write(tmp_path / "dpsgd.h5", SEED0, acc=ACC * 0.5, algo="dpsgd", topology="ring")
    (rows,) = cost_rows(csv_tables(tmp_path)).values()
    assert float(rows[0]["target"]) == pytest.approx(0.95 * (0.5 + 0.85 + 0.9) / 3)
    capsys.readouterr()
    assert report.main([str(tmp_path)]) == 0
    assert "the best experiment's (no all-reduce run in this family)" in capsys.readouterr().out


def test_mixed_hardware_gets_two_labelled_tables(tmp_path: Path, capsys) -> None:
    write(tmp_path / "local.h5", SEED0, prov=LOCAL)
    # the same experiment and seed, other engine
    write(tmp_path / "batched.h5", SEED1, prov=BATCHED)
    write(tmp_path / "other_cpu.h5", SEED1, prov={**LOCAL, "cpu_model": "CPU Y"}, seed=4)
    tables = cost_rows(csv_tables(tmp_path, "--target-accuracy", "0.8"))
    assert len(tables) == 3
    titles = sorted(tables)
    assert any(
        "on batched engine on cpu, 1 node(s) x 1 process(es) per node, CPU CPU X" in t
        for t in titles
    )
    assert any(
        "on local engine, 1 node(s) x 2 in-process rank(s) per node, CPU CPU X" in t for t in titles
    )
    assert any("CPU CPU Y" in t for t in titles)
    batched = next(rows for t, rows in tables.items() if "batched" in t)
    assert float(batched[0]["step_ms"]) == pytest.approx(20.0) and batched[0]["n_seeds"] == "1"
    # the accuracy table keeps one of the two duplicates, as before
    capsys.readouterr()
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ignored in the accuracy tables, in the cost table of its hardware" in out


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex"])
def test_every_format_shows_the_cost_table(tmp_path: Path, capsys, fmt: str) -> None:
    write(tmp_path / "a.h5", SEED0)
    assert report.main([str(tmp_path), "--format", fmt, "--target-accuracy", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "Cost: digits, 2 workers" in out
    assert ("step\\_ms" if fmt == "latex" else "step_ms") in out and "8000" in out  # samples/s
    for cell in ("8", "3", "1", "0.5", "2", "2.5"):
        assert cell in out


def test_target_accuracy_out_of_range_exits_2(tmp_path: Path, capsys) -> None:
    write(tmp_path / "a.h5", SEED0)
    with pytest.raises(SystemExit) as info:
        report.main([str(tmp_path), "--target-accuracy", "80"])
    assert info.value.code == 2
    assert "--target-accuracy must be in (0, 1], got 80" in capsys.readouterr().err


def test_accuracy_over_time_plot(tmp_path: Path, monkeypatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write(tmp_path / "runs" / "s0.h5", SEED0, seed=0)
    write(tmp_path / "runs" / "s1.h5", SEED1, seed=1)
    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert (
        report.main(
            [str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--target-accuracy", "0.8"]
        )
        == 0
    )
    names = sorted(p.name for p in (tmp_path / "out").glob("time_cost_*.png"))
    assert len(names) == 1
    fig = next(f for f in figures if "Cost:" in f._suptitle.get_text())
    ax = fig.axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "RelaySGD on double-binary-trees")
    # seeds averaged per evaluation: time and worst worker accuracy
    assert np.allclose(line.get_xdata(), [0, 1.6, 3.35, 4.85])
    assert np.allclose(line.get_ydata(), [10, 50, 80, 90])
    caption = " ".join(ax.get_title().split())
    assert "Line: worst worker's test accuracy per evaluation over wall-clock seconds" in caption
    assert caption.startswith(
        "on local engine, 1 node(s) x 2 in-process rank(s) per node, CPU CPU X."
    )
    assert ax.get_xlabel() == "wall-clock time (s)"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "target 80.0%" in legend


def test_show_prints_time_to_target(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "a.h5", SEED0)
    assert results.main(["show", str(path), "--target-accuracy", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "time to worst-worker test accuracy >= 80.00%: 2.5 s" in out
    assert "step 8 ms, compute 3 ms, comm 1 ms, wait 0.5 ms, bytes/step 2 (max worker 3)" in out
    # default: 95% of its own final worst-worker accuracy, 0.9 -> 0.855: first reached at step 300
    assert results.main(["show", str(path)]) == 0
    assert (
        "time to 95% of its own final worst-worker accuracy (85.50%): 3.5 s"
        in capsys.readouterr().out
    )
    assert results.main(["show", str(path), "--target-accuracy", "0.99"]) == 0
    assert "99.00%: never reached" in capsys.readouterr().out


def test_provenance_records_hardware_and_launch_shape(monkeypatch) -> None:
    from relaympi.costs import hardware, hardware_label, launch_shape

    monkeypatch.setenv(provenance.EMULATED_LINK_ENV, "1gbit")
    info = provenance.collect(
        {"backend": "mpi", "mpi_library": "MPICH Version:      5.0.2\nMPICH Release date: x"},
        hosts=["n1", "n2", "n1", "n2"],
    )
    assert info["nodes"] == 2 and info["ranks_per_node"] == 2 and info["emulated_link"] == "1gbit"
    assert info["cpu_model"] and "gpu_model" not in info  # no CUDA initialized here
    key = hardware(json.loads(json.dumps(info)), world_size=4)
    assert key["mpi_library"] == "MPICH Version: 5.0.2" and key["engine"] == "mpi"
    assert hardware_label(key).startswith("mpi engine, 2 node(s) x 2 rank(s) per node, CPU ")
    assert hardware_label(key).endswith(", MPICH Version: 5.0.2, emulated cluster (link 1gbit)")
    assert launch_shape(["a", "a", "b"]) == {"nodes": 2, "ranks_per_node": [2, 1]}
    monkeypatch.delenv(provenance.EMULATED_LINK_ENV)
    assert "emulated_link" not in provenance.collect({"backend": "local"}, hosts=["a"])


def test_real_local_and_batched_runs_land_in_separate_tables(tmp_path: Path) -> None:
    from relaympi import train

    args = [
        "--task",
        "digits",
        "--algo",
        "relay",
        "--workers",
        "4",
        "--steps",
        "20",
        "--eval-every",
        "5",
    ]
    for backend in ("local", "batched"):
        assert (
            train.main([*args, "--backend", backend, "--out", str(tmp_path / f"{backend}.h5")]) == 0
        )
    tables = cost_rows(csv_tables(tmp_path))
    assert len(tables) == 2
    local = next(
        rows
        for t, rows in tables.items()
        if "on local engine, 1 node(s) x 4 in-process rank(s) per node" in t
    )
    batched = next(
        rows
        for t, rows in tables.items()
        if "on batched engine on cpu, 1 node(s) x 1 process(es) per node" in t
    )
    # bytes compare across engines: the same messages
    assert float(local[0]["bytes_per_step"]) == float(batched[0]["bytes_per_step"]) > 0
    for rows in (local, batched):
        assert float(rows[0]["step_ms"]) > 0 and float(rows[0]["samples_per_s"]) > 0


def test_allreduce_bytes_are_not_counted_so_left_empty(tmp_path: Path, capsys) -> None:
    zero = {**SEED0, "bytes_sent": [[0, 0]] * 4}
    write(tmp_path / "ar.h5", zero, algo="allreduce", topology="fully-connected")
    (rows,) = cost_rows(csv_tables(tmp_path)).values()
    assert rows[0]["bytes_per_step"] == rows[0]["bytes_per_step_max"] == ""
    capsys.readouterr()
    assert report.main([str(tmp_path)]) == 0
    assert "before its messages were counted" in capsys.readouterr().out
