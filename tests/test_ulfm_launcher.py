"""scripts/mpirun-ulfm around Open MPI's mpirun: Open MPI's line per survivor of a heal
("NBC_Progress: an error 75 ...") does not reach the user."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaympi.results import read_run
from tests.conftest import PY, requires_ulfm, run_ulfm

pytestmark = pytest.mark.slow

NOISE = "NBC_Progress: an error {} was found during schedule 0x55d0c0ffee at row-offset 0 - " + (
    "aborting the schedule"
)


@requires_ulfm
def test_the_launcher_drops_open_mpis_line_for_a_lost_rank_and_keeps_the_rest() -> None:
    # a rank that prints what libnbc prints (the line, then a blank one) for a failed process (75)
    # and a revoked communicator (77), between lines of its own; another error (13) still shows
    program = "\n".join(
        [
            "import sys",
            "for line in ['before', NOISE.format(75), '', 'between', NOISE.format(77), '',",
            "             NOISE.format(13), '', '', 'after']:",
            "    print(line, file=sys.stderr, flush=True)",
            "sys.exit(3)",
        ]
    )
    proc = run_ulfm([PY, "-c", f"NOISE = {NOISE!r}\n{program}"], 1, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the rank's status comes through
    assert proc.stderr.splitlines() == ["before", "between", NOISE.format(13), "", "", "after"]


@requires_ulfm
def test_a_healed_runs_output_has_no_open_mpi_noise(tmp_path: Path) -> None:
    out = tmp_path / "run.h5"
    train = [PY, "-m", "relaympi.train", "--task", "digits", "--steps", "30", "--eval-every", "10"]
    env = {"RELAYMPI_INJECT_FAILURE": "2:7"}
    args = ["-x", "PYTHONPATH", "-x", *env, *train, "--on-failure", "continue", "--out", out]
    proc = run_ulfm(args, 4, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lost rank 2 (node 0) at step 7; 3 workers carry on" in proc.stderr
    assert "NBC_Progress" not in proc.stderr and "\n\n" not in proc.stderr, proc.stderr
    assert "3 of 4 workers finished; rank 2" in proc.stdout
    assert read_run(out).status == "completed"
