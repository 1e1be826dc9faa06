"""benchmarks.slow_neighbour: rank 0's pace read from a run file, ranks found by their launcher's
environment."""

from __future__ import annotations

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
