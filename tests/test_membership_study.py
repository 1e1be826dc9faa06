"""benchmarks.membership_study: the scenarios it runs, the losses it injects and the metric its
table prints, checked against the run files it wrote."""

from __future__ import annotations

import re

import numpy as np
import pytest

from benchmarks.membership_study import Scenario, main, scenarios
from relaympi.results import read_run
from tests.conftest import matched


def test_scenarios_are_full_then_each_loss_at_each_fraction_then_each_loss_from_the_start():
    found = scenarios([(5,), (5, 6, 7, 8)], [0.25, 0.5])
    assert found == [
        Scenario("full"),
        Scenario("lose 1 @ 25%", (5,), 0.25),
        Scenario("lose 1 @ 50%", (5,), 0.5),
        Scenario("lose 4 @ 25%", (5, 6, 7, 8), 0.25),
        Scenario("lose 4 @ 50%", (5, 6, 7, 8), 0.5),
        Scenario("survivors 1", (5,), 0.0),
        Scenario("survivors 4", (5, 6, 7, 8), 0.0),
    ]


def _worst_of_last_epochs(path, window=5.0):
    """The worst finished worker's mean test accuracy over the evaluations of the last
    ``window`` epochs (epoch > 0), computed here from the run file alone."""
    run = read_run(path)
    epoch, accuracy = run.data["epoch"], run.data["test_accuracy"]
    rows = (epoch > epoch.max() - window) & (epoch > 0)
    kept = accuracy[rows][:, run.finished_workers]
    return float(np.min(np.mean(kept, axis=0)))


@pytest.mark.slow
def test_the_study_injects_its_losses_and_prints_the_runs_metric(tmp_path, capsys):
    out = tmp_path / "study"
    assert (
        main(
            [
                *("--out", str(out), "--algos", "relay", "--alphas", "1", "--workers", "4"),
                *("--lose", "1", "--at", "0.5", "--metrics", "worst"),
                *("--", "--epochs", "6"),
            ]
        )
        == 0
    )
    full = read_run(out / "full" / "relay_alpha1_seed0.h5")
    steps = int(full.attrs["total_steps"])
    mid = read_run(out / "lose1_at50" / "relay_alpha1_seed0.h5")
    start = read_run(out / "lose1_at0" / "relay_alpha1_seed0.h5")
    assert full.membership == []
    assert [(c["step"], c["lost"], c["world_size"]) for c in mid.membership] == [
        (round(steps / 2), [1], 3)
    ]
    assert [(c["step"], c["lost"]) for c in start.membership] == [(0, [1])]
    # worker 1's columns are NaN from its step on; the others trained to the end
    accuracy, step = mid.data["test_accuracy"], mid.data["step"]
    assert np.isnan(accuracy[step >= round(steps / 2), 1]).all()
    assert np.isfinite(accuracy[:, [0, 2, 3]]).all()

    table = capsys.readouterr().out
    printed = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"\| relay \| 1 \| ([a-z0-9 @%]+) \| \d+/4 \| ([\d.]+) \|", table)
    }
    for name, path in [
        ("full", "full"),
        ("lose 1 @ 50%", "lose1_at50"),
        ("survivors 1", "lose1_at0"),
    ]:
        want = 100 * _worst_of_last_epochs(out / path / "relay_alpha1_seed0.h5")
        assert printed[name] == pytest.approx(want, abs=0.006), name
    # the differences it prints are those of the printed means
    row = matched(r"\| lose 1 @ 50% \|[^\n]*\| ([+-][\d.]+) \| ([+-][\d.]+) \|", table)
    assert float(row.group(1)) == pytest.approx(printed["lose 1 @ 50%"] - printed["full"], abs=0.02)
    assert float(row.group(2)) == pytest.approx(
        printed["lose 1 @ 50%"] - printed["survivors 1"], abs=0.02
    )
