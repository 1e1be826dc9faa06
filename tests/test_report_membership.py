"""The report on runs that lost workers (--on-failure continue): the paper metric over the workers
that finished, the flagged cell and its note, and the membership changes on the HTML page and on
the accuracy curves."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from relaympi import report
from relaympi.report.plots import curves_figure
from relaympi.report.summary import ReportSettings, summarize
from relaympi.report.tables import LOST_MARK, accuracy_like_tables
from relaympi.results import RunWriter, read_run
from tests import run_factories as rf

N = 8
EPOCHS = np.arange(1, 11, dtype=float)  # steps 100 .. 1000 (the factory's 100 steps per epoch)
LOST, LOST_STEP = 5, 750  # worker 5 lost between the evaluations of epochs 7 and 8


def _accuracy(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.6 + 0.03 * EPOCHS[:, None] + 0.02 * rng.random((len(EPOCHS), N))


def _lost_run(path: Path) -> np.ndarray:
    """A cifar10 relay run whose worker 5 (the worst before it was lost) is lost at step 750:
    its columns are NaN from epoch 8 on, and the membership attribute says so."""
    accuracy = _accuracy(1)
    accuracy[:, LOST] -= 0.4  # in the last-5-epochs window (epochs 6, 7) it would be the worst
    accuracy[EPOCHS * 100 >= LOST_STEP, LOST] = np.nan
    rf.write_classification_run(path, accuracy, EPOCHS, status="running", algo="relay")
    with RunWriter.take_over(path, from_step=10**9) as writer:
        writer.add_membership(
            {
                "step": LOST_STEP,
                "lost": [LOST],
                "lost_nodes": [1],
                "lost_hosts": ["h2"],
                "world_size": N - 1,
                "heal_s": 0.41,
            }
        )
        writer.set_status("completed")
    return accuracy


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    _lost_run(tmp_path / "relay.h5")
    rf.write_classification_run(tmp_path / "dpsgd.h5", _accuracy(2), EPOCHS, algo="dpsgd")
    return tmp_path


def _hand_worst(accuracy: np.ndarray, workers: list[int]) -> float:
    """The paper's cifar10 metric by hand: the worst worker's mean over epochs 6..10."""
    window = EPOCHS > EPOCHS[-1] - 5
    return min(float(np.mean(accuracy[window, w])) for w in workers)


def test_metric_over_the_workers_that_finished(tmp_path: Path) -> None:
    accuracy = _lost_run(tmp_path / "relay.h5")
    summary = summarize(read_run(tmp_path / "relay.h5"), ReportSettings())
    finished = [w for w in range(N) if w != LOST]
    assert summary.finished == (N - 1, N)
    assert summary.metric == pytest.approx(_hand_worst(accuracy, finished), abs=1e-12)
    # the lost worker's evaluations before its loss would have pulled the metric down
    with_lost = float(np.nanmean(accuracy[EPOCHS > 5, LOST]))
    assert with_lost < summary.metric - 0.3
    assert summary.changes == (
        (7.5, "step 750: lost rank 5 (node 1, host h2); 7 workers after; healed in 0.41 s"),
    )
    assert summary.curve is not None and summary.curve.changes == (7.5,)
    assert summary.unstable is None and summary.at_chance == ()


def test_a_run_without_changes_is_summarized_as_before(runs_dir: Path) -> None:
    summary = summarize(read_run(runs_dir / "dpsgd.h5"), ReportSettings())
    assert summary.finished is None and summary.changes == ()
    assert summary.metric == pytest.approx(_hand_worst(_accuracy(2), list(range(N))), abs=1e-12)


def test_the_cell_is_flagged_with_a_note(runs_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert report.main([str(runs_dir), "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    finished = [w for w in range(N) if w != LOST]
    lost_cell = (
        f"{100 * _hand_worst(read_run(runs_dir / 'relay.h5').data['test_accuracy'], finished):.1f}%"  # noqa: E501
    )
    plain = f"{100 * _hand_worst(_accuracy(2), list(range(N))):.1f}%"
    rows = [line for line in out.splitlines() if line.startswith("| RelaySGD")]
    assert rows and rows[0].rstrip(" |").endswith(f"{lost_cell}{LOST_MARK}")
    rows = [line for line in out.splitlines() if line.startswith("| D-PSGD")]
    assert rows and rows[0].rstrip(" |").endswith(plain)  # no mark without lost workers
    assert (
        f"{LOST_MARK} RelaySGD on double-binary-trees, alpha=0.1, seed 0: lost workers: metric "
        "over the 7 of 8 that finished (relay.h5)." in out
    )


def test_csv_and_latex_carry_the_flag(runs_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert report.main([str(runs_dir), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("task,")))
    names = lines[header].split(",")
    relay = next(line for line in lines[header:] if ",relay," in line).split(",")
    dpsgd = next(line for line in lines[header:] if ",dpsgd," in line).split(",")
    assert relay[names.index("lost_workers")] == "True"
    assert dpsgd[names.index("lost_workers")] == ""
    assert report.main([str(runs_dir), "--format", "latex"]) == 0
    assert r"\textsuperscript{\dag}" in capsys.readouterr().out


def test_html_lists_the_changes(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert report.main([str(runs_dir), "--out", str(out)]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<h3>Membership changes (1)</h3>" in page
    assert (
        "<li>RelaySGD on double-binary-trees, alpha=0.1, seed 0: step 750: lost rank 5 (node 1, "
        "host h2); 7 workers after; healed in 0.41 s (epoch 7.5)</li>" in page
    )
    assert "lost workers: metric over the 7 of 8 that finished (relay.h5).</li>" in page


def test_curves_mark_the_change_with_a_vertical_line(runs_dir: Path) -> None:
    from relaympi.report.summary import Curve

    summaries = [summarize(read_run(p), ReportSettings()) for p in sorted(runs_dir.glob("*.h5"))]
    (table,) = [
        t for t in accuracy_like_tables(summaries, ReportSettings()) if t.kind == "accuracy"
    ]
    by_label = table.curves[0.1]
    fig = curves_figure(table.title, by_label)
    try:
        ax = fig.axes[0]
        marks = [line for line in ax.lines if line.get_gid() == "membership"]
        assert len(marks) == 1
        assert list(np.asarray(marks[0].get_xdata())) == [7.5, 7.5]
        relay = next(label for label in by_label if label.startswith("RelaySGD"))
        series = [line for line in ax.lines if line.get_label() == relay][0]
        assert marks[0].get_color() == series.get_color()
        assert "membership change" in ax.get_title()
        plain = curves_figure("t", {"x": [Curve(EPOCHS, *(EPOCHS,) * 3)]})
        assert "membership change" not in plain.axes[0].get_title()
        assert not [line for line in plain.axes[0].lines if line.get_gid() == "membership"]
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    assert math.isclose(table.curves[0.1][relay][0].changes[0], 7.5)


# ------------------------------------------------------- re-admission: back to full strength

READMIT_STEP = 900  # worker 5 back from the evaluation of epoch 9 on (epoch 8 stays NaN)


def _readmitted_run(path: Path, *, bytes_sent: np.ndarray | None = None) -> np.ndarray:
    """_lost_run's run, then a rerun that re-admitted worker 5 at step 900: its columns hold
    numbers again from epoch 9 on."""
    accuracy = _accuracy(1)
    accuracy[:, LOST] -= 0.4
    out = (EPOCHS * 100 >= LOST_STEP) & (EPOCHS * 100 < READMIT_STEP)
    accuracy[out, LOST] = np.nan
    costs = None if bytes_sent is None else {"bytes_sent": bytes_sent}
    rf.write_classification_run(path, accuracy, EPOCHS, status="running", algo="relay", costs=costs)
    with RunWriter.take_over(path, from_step=10**9) as writer:
        writer.add_membership(
            {
                "step": LOST_STEP,
                "lost": [LOST],
                "lost_nodes": [1],
                "lost_hosts": ["h2"],
                "world_size": N - 1,
                "heal_s": 0.41,
            }
        )
        writer.add_membership(
            {
                "step": READMIT_STEP,
                "lost": [],
                "lost_nodes": [],
                "lost_hosts": [],
                "world_size": N,
                "heal_s": 0.2,
                "readmitted": [LOST],
            }
        )
        writer.set_status("completed")
    return accuracy


def test_a_readmitted_worker_counts_over_its_rows_present(tmp_path: Path) -> None:
    accuracy = _readmitted_run(tmp_path / "relay.h5")
    summary = summarize(read_run(tmp_path / "relay.h5"), ReportSettings())
    assert summary.finished == (N, N) and summary.readmitted == (LOST,)
    # by hand: worker 5 over epochs 6, 7, 9, 10 (out at 8), every other worker over 6 .. 10
    means = [float(np.mean(accuracy[EPOCHS > 5, w])) for w in range(N) if w != LOST]
    means.append(float(np.mean(accuracy[[5, 6, 8, 9], LOST])))
    assert summary.metric == pytest.approx(min(means), abs=1e-12)
    assert summary.metric == pytest.approx(means[-1], abs=1e-12)  # it is the worst again
    assert summary.changes == (
        (7.5, "step 750: lost rank 5 (node 1, host h2); 7 workers after; healed in 0.41 s"),
        (9.0, "step 900: re-admitted rank 5; 8 workers after; in 0.20 s"),
    )
    assert summary.curve is not None and summary.curve.changes == (7.5, 9.0)


def test_a_readmitted_workers_bytes_per_step_are_since_it_came_back(tmp_path: Path) -> None:
    steps = EPOCHS * 100
    sent = np.repeat(steps[:, None] * 10.0, N, axis=1)  # 10 bytes a step, cumulative
    back = steps >= READMIT_STEP
    sent[back, LOST] = (steps[back] - READMIT_STEP) * 30.0  # again from 0, 30 bytes a step
    sent[~back & (steps >= LOST_STEP), LOST] = np.nan
    _readmitted_run(tmp_path / "relay.h5", bytes_sent=sent)
    summary = summarize(read_run(tmp_path / "relay.h5"), ReportSettings())
    assert summary.costs is not None and summary.costs.bytes_per_step is not None
    expected = np.full(N, 10.0)
    expected[LOST] = 30.0
    np.testing.assert_allclose(summary.costs.bytes_per_step, expected)


def test_the_readmitted_cell_note_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _readmitted_run(tmp_path / "relay.h5")
    assert report.main([str(tmp_path), "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert (
        f"{LOST_MARK} RelaySGD on double-binary-trees, alpha=0.1, seed 0: lost workers, "
        "re-admitted: rank 5: metric over the 8 of 8 that finished (relay.h5)." in out
    )
    rows = [line for line in out.splitlines() if line.startswith("| RelaySGD")]
    assert rows and rows[0].rstrip(" |").endswith(LOST_MARK)


def test_the_note_says_some_were_readmitted_while_others_stay_out(tmp_path: Path) -> None:
    import dataclasses

    from relaympi.report.tables import _lost_words

    _readmitted_run(tmp_path / "relay.h5")
    summary = summarize(read_run(tmp_path / "relay.h5"), ReportSettings())
    assert _lost_words(summary) == "lost workers, re-admitted: rank 5"
    partly = dataclasses.replace(summary, finished=(N - 1, N), readmitted=(2, LOST))
    assert _lost_words(partly) == "lost workers, some re-admitted: ranks 2, 5"
    assert _lost_words(dataclasses.replace(summary, readmitted=())) == "lost workers"
