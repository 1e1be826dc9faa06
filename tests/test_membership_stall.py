"""A stalled rank evicted (--peer-timeout) under Open MPI with ULFM: one rank is SIGSTOPped mid-run;
the others heal without it once its silence passed the timeout, the run completes with it recorded
as stalled, the survivors' numbers equal the in-process engine's with that rank lost at the
recorded step, and the stopped process, resumed, ends with one line and a non-zero status, having
written nothing."""

from __future__ import annotations

import pytest

from benchmarks.kill_loop import differences, replay
from benchmarks.stall_heal import DECLARED_DEAD, stall_once
from relaympi.results import read_run
from tests.conftest import PY, ULFM_MPIRUN, env_for_subprocess, requires_ulfm

TIMEOUT_S = 2.0
WORKERS = 3


@pytest.mark.slow
@requires_ulfm
@pytest.mark.parametrize("stalled", [2, 0], ids=["a-rank", "the-writer"])
def test_a_stopped_rank_is_evicted_and_the_survivors_equal_the_local_replay(
    tmp_path, stalled: int
) -> None:
    out, ckpt, exits = tmp_path / "mpi.h5", tmp_path / "ckpt", tmp_path / "exits"
    exits.mkdir()
    train = [
        *(PY, "-m", "relaympi.train", "--task", "digits", "--steps", "600"),
        *("--on-failure", "continue", "--peer-timeout", str(TIMEOUT_S)),
        *("--checkpoint-dir", ckpt, "--checkpoint-every", "20", "--out", out),
    ]
    # each rank's exit status, as its shell saw it (the launcher's is no verdict on a lost rank)
    keep_status = f'"$0" "$@"; echo $? > {exits}/rank$OMPI_COMM_WORLD_RANK'
    command = [
        *(str(ULFM_MPIRUN), "-n", str(WORKERS), "-x", "PYTHONPATH"),
        *("bash", "-c", keep_status, *map(str, train)),
    ]
    # stopped between checkpoints (every 20 steps): a process stopped inside a checkpoint's write
    # finishes that one write when it resumes (a limit the docs name), which is not what this checks
    result = stall_once(command, stalled, at=50, timeout_s=240, env=env_for_subprocess())
    output = result["output"][-4000:]
    assert result["ended"], output  # no hang: the stopped rank resumed and ended, so did the job
    assert result["stop_to_heal_s"] is not None, output
    # the detector declares it between 3/4 of the timeout and the timeout after its last heartbeat
    assert 0.7 * TIMEOUT_S <= result["stop_to_heal_s"] < TIMEOUT_S + 3.0, output

    run = read_run(out)
    assert run.status == "completed", output
    [change] = run.membership
    assert change["lost"] == [stalled] and change["stalled"] == [stalled], change
    assert 0.5 * TIMEOUT_S <= change["silent_s"] < TIMEOUT_S + 3.0, change
    assert change["heal_s"] >= change["silent_s"], change  # the heal counts from the silence
    assert f"{WORKERS - 1} of {WORKERS} workers finished" in output

    # resumed: Open MPI's one line, a non-zero status (SIGABRT), nothing written after the stop
    assert len(result["resumed_lines"]) == 1, output
    assert sum(DECLARED_DEAD in line for line in result["output"].splitlines()) == 1
    statuses = {p.name: int(p.read_text()) for p in exits.iterdir()}
    assert statuses.pop(f"rank{stalled}") != 0 and set(statuses.values()) == {0}
    own = list(ckpt.glob(f"rank{stalled:05d}.step*.pt"))  # its checkpoints: all before the stop
    assert own and max(p.stat().st_mtime for p in own) < result["stopped_wall"]
    first = min(set(range(WORKERS)) - {stalled})  # the lowest survivor: the writer after it
    saved = [int(p.name.split(".step")[1][:10]) for p in ckpt.glob(f"rank{first:05d}.step*.pt")]
    assert max(saved) > change["step"]  # while the survivors saved theirs on

    # the same run in one process, that rank lost at the recorded step
    plain = [*map(str, train[: train.index("--on-failure") + 2]), "--out", str(out)]
    local = replay(plain, out, run.membership, WORKERS)
    assert differences(out, local) == []
