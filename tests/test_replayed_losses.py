"""--replay-drops of a run that lost a worker (--on-failure continue under --message-deadline): the
lost worker's late drops are shared at each step's end, so the survivors keep them, and the local
replay loses the same worker at the start of its step and gives the MPI run's numbers bit for
bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaympi.results import read_run
from tests.conftest import PY, matched, replay_bit_for_bit, requires_ulfm, run_ulfm

QUAD = ["--task", "quadratics", "--lr", "0.1", "--steps", "8", "--eval-every", "2", "--dim", "6"]


@pytest.mark.slow
@requires_ulfm
@pytest.mark.parametrize("algo, topology", [("dpsgd", "ring"), ("relay", "chain")])
def test_a_run_that_lost_a_worker_replays_bit_for_bit(tmp_path: Path, algo, topology) -> None:
    """Rank 1 is late at steps 2 and 6 and rank 2, one of its receivers, is lost at the start of
    step 4, before the evaluation that would gather its late drop of step 2: the run file keeps
    it, and the local replay (which loses worker 2 at step 4 and drops the same messages, named
    by original ids after the survivors are renumbered) equals every dataset but the timers."""
    args = [*QUAD, "--algo", algo, "--topology", topology, "--record-params"]
    proc = run_ulfm(
        [PY, "-m", "relaympi.train", *args, "--message-deadline", "0.15"]
        + ["--on-failure", "continue", "--out", tmp_path / "mpi.h5"],
        4,
        env={"RELAYMPI_INJECT_FAILURE": "2:4", "RELAYMPI_INJECT_DELAY": "1:2,6:1.0"},
    )
    matched(r"completed: .*rank 2 \(\S+\) lost at step 4", proc.stdout + proc.stderr)
    recorded = read_run(tmp_path / "mpi.h5")
    assert recorded.late_drops is not None
    late = {(step, s, d) for step, _, _, s, d in recorded.late_drops.tolist()}
    assert (2, 1, 2) in late, late  # the lost worker's own late drop, kept by the survivors
    # and after the heal, named by original ids (worker 3 is rank 2 of the survivors)
    assert {(6, 1, 0), (6, 1, 3)} <= late, late
    assert [change["lost"] for change in recorded.membership] == [[2]]
    replay = [*args, "--on-failure", "continue"]
    replayed = replay_bit_for_bit(recorded, replay, workers=4, out=tmp_path / "local.h5")
    assert [(c["step"], c["lost"]) for c in replayed.membership] == [(4, [2])]
