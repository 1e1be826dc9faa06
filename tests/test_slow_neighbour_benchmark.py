"""benchmarks.slow_neighbour: rank 0's pace read from a run file, ranks found by their launcher's
environment."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import slow_neighbour
from relaympi.results import RunWriter


def test_pace_is_rank_0s_seconds_per_step_after_the_skipped_steps(tmp_path: Path) -> None:
    with RunWriter.create(tmp_path / "run.h5", config={}, provenance={}, world_size=2) as run:
        for step, seconds in [(0, 0.0), (50, 9.0), (100, 10.0), (150, 12.0)]:
            run.append({"step": step, "time_s": np.array([seconds, 99.0])})
    # from step 50 (9 s) to step 150 (12 s): 3 s over 100 steps, rank 0's column
    assert slow_neighbour._pace(tmp_path / "run.h5", skip=50) == pytest.approx(0.03)
    assert slow_neighbour._pace(tmp_path / "run.h5", skip=1) == pytest.approx(0.03)


def test_a_rank_is_found_below_its_launcher_by_its_environment() -> None:
    env = {**os.environ, "PMI_RANK": "3"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        assert child.pid in slow_neighbour.descendants(os.getpid())
        assert slow_neighbour.rank_of(child.pid) == 3
        assert slow_neighbour.rank_of(os.getpid()) is None or "PMI_RANK" in os.environ
    finally:
        child.kill()
        child.wait()


def test_kinds_keep_their_order_with_clean_first() -> None:
    assert slow_neighbour.parse_kinds("slow+deadline,clean+deadline") == [
        "clean",
        "clean+deadline",
        "slow+deadline",
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="fast unknown; choose from clean"):
        slow_neighbour.parse_kinds("clean,fast")


def test_a_variant_names_a_checkout(tmp_path: Path) -> None:
    (tmp_path / "relaympi").mkdir()
    assert slow_neighbour.parse_variant(f"after={tmp_path}") == ("after", tmp_path.resolve())
    for bad in (str(tmp_path), f"={tmp_path}", f"after={tmp_path / 'relaympi'}"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=TREE"):
            slow_neighbour.parse_variant(bad)


def test_the_median_interval_brackets_the_median_and_narrows_with_agreement() -> None:
    assert slow_neighbour.interval(np.full(6, 1.05)) == (1.05, 1.05)
    ratios = np.array([0.9, 1.0, 1.02, 1.04, 1.1, 1.3])
    low, high = slow_neighbour.interval(ratios)
    assert 0.9 <= low <= np.median(ratios) <= high <= 1.3
    # every resample's median lies between the second smallest and second largest of six
    assert low >= 0.95 and high <= 1.2
