"""Runs whose loss ends far above where it started are flagged: end summary, results CLI and
report."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from relaympi import report, results
from relaympi.results import UNSTABLE_FACTOR, unstable_loss
from relaympi.training.run_file import print_summary
from tests import run_factories as rf

NAN = math.nan
WORKERS = 2
# as a D² run with --drop-prob 0.1 diverged: the first interval's mean train loss 2, the last 78.
CLIMB = [2.0, 5.0, 30.0, 78.0]
# just under the rule: the final mean ends at 1.995 x the first (2.0 -> 3.99)
UNDER = [2.0, 1.0, 2.5, 3.99]


def _losses(means: list[float], spread: float = 0.5) -> np.ndarray:
    """[evals, workers] with these means over workers (workers mean-spread, mean+spread); NaN at
    step 0."""
    rows = [[NAN] * WORKERS] + [[m - spread, m + spread] for m in means]
    return np.array(rows)


def _accuracy(evals: int) -> np.ndarray:
    return np.tile([0.5, 0.6], (evals, 1))


def _run(path: Path, means: list[float], **config) -> Path:
    loss = _losses(means)
    # the first evaluation at epoch 0, as the trainer records it
    epochs = np.arange(len(loss), dtype=float)
    return rf.write_classification_run(
        path, _accuracy(len(loss)), epochs, train_loss=loss, task="digits", **config
    )


@pytest.mark.parametrize(
    "means, expected",
    [
        (CLIMB, (2.0, 78.0)),
        (UNDER, None),
        ([2.0, 1.0, 4.01], (2.0, 4.01)),  # just over: 2.005x
        ([2.0, 0.5, 0.1], None),  # a run that learns
        ([2.0, 30.0, 1.0], None),  # climbed, and came back below 2x before the end
    ],
)
def test_the_rule_compares_the_last_mean_train_loss_with_the_first_recorded(
    means, expected
) -> None:
    found = unstable_loss(_losses(means))
    assert found == (None if expected is None else pytest.approx(expected))


def test_the_rule_uses_the_mean_over_workers_and_skips_what_cannot_be_judged() -> None:
    # worker 0 improves (1 -> 0.5), worker 1 climbs (3 -> 8): mean 2 -> 4.25 > 2 x 2
    assert unstable_loss(np.array([[NAN, NAN], [1.0, 3.0], [0.5, 8.0]])) == pytest.approx(
        (2.0, 4.25)
    )
    # ends non-finite: status diverged says it
    assert unstable_loss(np.array([[1.0, 3.0], [0.5, NAN]])) is None
    # one recorded value: nothing to compare
    assert unstable_loss(np.array([[NAN, NAN], [2.0, 2.0]])) is None
    assert UNSTABLE_FACTOR == 2.0


def test_the_end_summary_flags_an_unstable_run(tmp_path: Path, capsys) -> None:
    print_summary(_run(tmp_path / "climb.h5", CLIMB), "completed")
    line = capsys.readouterr().out
    assert "WARNING: unstable: final mean train loss 78 > 2x the first recorded 2 " in line
    print_summary(_run(tmp_path / "under.h5", UNDER), "completed")
    assert "unstable" not in capsys.readouterr().out


def test_results_show_flags_an_unstable_run(tmp_path: Path, capsys) -> None:
    assert results.main(["show", str(_run(tmp_path / "climb.h5", CLIMB))]) == 0
    out = capsys.readouterr().out
    assert "warning: unstable: final mean train loss 78 > 2x the first recorded 2 " in out
    assert results.main(["show", str(_run(tmp_path / "under.h5", UNDER))]) == 0
    assert "unstable" not in capsys.readouterr().out


def test_report_flags_an_unstable_run_in_its_table_and_as_a_duplicate(
    tmp_path: Path, capsys
) -> None:
    _run(tmp_path / "runs" / "climb.h5", CLIMB, algo="d2", topology="ring", drop_prob=0.1)
    _run(tmp_path / "runs" / "under.h5", UNDER, algo="dpsgd", topology="ring", drop_prob=0.1)
    assert report.main([str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "unstable" in line]
    assert notes and all("D2 on ring" in line and "climb.h5" in line for line in notes), out
    assert "final mean train loss 78 > 2x the first recorded 2 " in notes[0]
    _run(tmp_path / "runs" / "climb-batched.h5", CLIMB, algo="d2", topology="ring", drop_prob=0.1)
    report.main([str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert (
        "duplicate of" in out
        and "this run is unstable, so the two may differ beyond rounding" in out
    )


def test_report_flags_an_unstable_quadratics_run(tmp_path: Path, capsys) -> None:
    steps = np.arange(5) * 10
    rf.write_quadratics_run(
        tmp_path / "q.h5",
        np.geomspace(1, 1e-8, 5),
        steps,
        train_loss=_losses([50.0, 80.0, 90.0, 101.0])[:5],
        world_size=WORKERS,  # the width of its per-worker train_loss, as the reader checks
    )
    rf.write_quadratics_run(
        tmp_path / "ok.h5",
        np.geomspace(1, 1e-8, 5),
        steps,
        train_loss=_losses([50.0, 20.0, 9.0, 99.0])[:5],
        world_size=WORKERS,
        algo="dpsgd",
        topology="ring",
    )
    assert report.main([str(tmp_path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "unstable" in line]
    assert len(notes) == 1 and "q.h5" in notes[0] and f"world_size={WORKERS}" in notes[0]
