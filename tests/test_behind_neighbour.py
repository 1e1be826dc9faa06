"""A neighbour that is behind under --message-deadline costs its receivers one deadline, not one
per step: once its message was dropped it is not waited for until it sends again, and no rank
waits at a step's end for it either until it is DEADLINE_AGREEMENT_LAG steps behind. A rank held
at half speed from outside is dropped where timing says, and the run still replays bit for bit."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.slow_neighbour import hold
from relaympi.results import read_run
from relaympi.training.agreement import AGREEMENT_LAG, DEADLINE_AGREEMENT_LAG, LAG_ENV
from relaympi.training.loop import TrainingLoop
from tests.conftest import (
    ROOT,
    env_for_subprocess,
    matched,
    module_command,
    replay_bit_for_bit,
    requires_mpirun,
    run_train,
)
from tests.test_message_deadline import run_module_file

DEADLINE_S, HOLD_S, BEHIND = 0.25, 6.0, range(1, 17)

BEHIND_SENDER = """
import json, pathlib, sys, time
import numpy as np
from relaympi.comm import mpi_communicator

comm = mpi_communicator(deadline=DEADLINE_S)
size, peer, rounds = int(sys.argv[2]), 1 - comm.rank, []
for round in range(20):
    if comm.rank == 1 and round == BEHIND.start:
        time.sleep(HOLD_S)  # past rank 0's deadline at every round it is behind in
    if comm.rank == 0 and round == BEHIND.start:
        start = time.monotonic()
    if round == BEHIND.stop:
        if comm.rank == 0:
            elapsed = time.monotonic() - start
        comm.barrier()  # rank 1 catches up: its late messages have landed
    got = np.full(size, -1.0)
    sent = np.full(size, 10.0 * round + comm.rank)
    arrived = comm.exchange({peer: sent}, {peer: got}, round=round).wait()
    rounds.append([sorted(arrived), np.unique(got).tolist()])
record = {"rounds": rounds, "late": comm.late_drops}
if comm.rank == 0:
    record["elapsed"] = elapsed
pathlib.Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(record))
"""


@pytest.mark.slow
@requires_mpirun
@pytest.mark.parametrize("size", [3, 1 << 20])
def test_a_neighbour_behind_is_not_waited_for_until_it_catches_up(tmp_path: Path, size) -> None:
    """Rank 1 sleeps through 16 of rank 0's rounds: rank 0 waits for the first one's deadline
    only (16 deadlines would take 4 s), drops all 16, and once rank 1 has caught up its messages
    count again from the next round (its late ones have landed: it is sending again). At 8 MB a
    message is too large to leave before its receive is posted (MPI's rendezvous): rank 0's sends
    to the sleeping rank do not hold it either."""
    program = tmp_path / "behind.py"
    constants = (
        f"DEADLINE_S, HOLD_S, BEHIND = {DEADLINE_S}, {HOLD_S}, range{BEHIND.start, BEHIND.stop}\n"
    )
    program.write_text(BEHIND_SENDER.replace("comm = ", constants + "comm = ", 1))
    proc = run_module_file(program, tmp_path, size)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    rounds = found[0]["rounds"]
    assert found[0]["late"] == [[r, 0, 1, 0] for r in BEHIND], proc.stdout + proc.stderr[-2000:]
    for r, (arrived, got) in enumerate(rounds):
        if r in BEHIND:
            assert (arrived, got) == ([], [-1.0]), r  # dropped: nothing landed in it
        else:
            assert (arrived, got) == ([1], [10.0 * r + 1]), r  # its own round's message
    # one deadline and 15 rounds not waited for, far under the 16 deadlines waited one by one
    assert found[0]["elapsed"] < len(BEHIND) * DEADLINE_S / 2, found[0]["elapsed"]
    assert found[1]["late"] == []  # rank 0's messages were all there when rank 1 woke
    assert [arrived for arrived, _ in found[1]["rounds"]] == [[0]] * 20


def _lag(set_by_env: int | None, deadline: float | None) -> int:
    """The training loop's agreement lag for RELAYMPI_AGREEMENT_LAG and --message-deadline."""
    loop = SimpleNamespace(
        lag_set=set_by_env, plan=SimpleNamespace(cfg=SimpleNamespace(message_deadline=deadline))
    )
    return TrainingLoop.agreement_lag.fget(loop)  # type: ignore[attr-defined]


def test_a_deadline_lets_ranks_run_ahead_unless_the_environment_says_otherwise() -> None:
    assert _lag(None, None) == AGREEMENT_LAG
    assert _lag(None, 0.05) == DEADLINE_AGREEMENT_LAG > AGREEMENT_LAG
    assert _lag(0, 0.05) == 0 and _lag(3, None) == 3


@pytest.mark.slow
@requires_mpirun
def test_ranks_run_ahead_of_a_held_rank_and_replay_bit_for_bit(tmp_path: Path) -> None:
    """Rank 1 of 3 (chain 0-1-2) is held 3 s before its exchange at step 2, past a 0.15 s deadline:
    its neighbours run on without it for many steps (a step's end waits for it only once it is
    DEADLINE_AGREEMENT_LAG steps behind; unlagged they would stop at the next step's end), and the
    local replay of the recorded drops gives every dataset but the timers bit for bit."""
    args = ["--task", "quadratics", "--lr", "0.1", "--steps", "40", "--eval-every", "40"]
    args += ["--algo", "relay", "--topology", "chain", "--record-params", "--dim", "6"]
    mpi = run_train(
        [*args, "--message-deadline", "0.15", "--out", tmp_path / "mpi.h5"],
        mpi=3,
        env={"RELAYMPI_INJECT_DELAY": "1:2:3.0", LAG_ENV: ""},
        check=0,
    )
    matched(r"completed: ", mpi.stdout + mpi.stderr)
    recorded = read_run(tmp_path / "mpi.h5")
    assert recorded.late_drops is not None
    for receiver in (0, 2):
        steps = {int(row[0]) for row in recorded.late_drops if (row[3], row[4]) == (1, receiver)}
        # it ran on past the held step without waiting at a step's end, up to the lag
        assert set(range(2, 2 + DEADLINE_AGREEMENT_LAG // 2)) <= steps, (receiver, sorted(steps))
    replay_bit_for_bit(recorded, args, workers=3, out=tmp_path / "local.h5")


@pytest.mark.slow
@requires_mpirun
def test_a_rank_held_at_half_speed_is_dropped_and_replayed_bit_for_bit(tmp_path: Path) -> None:
    """Rank 1 of 4 (chain) is stopped from outside 50 ms of every 100 ms for the whole run, as
    benchmarks.slow_neighbour holds it, under a 10 ms deadline: which of its messages are late
    depends on timing alone, and the local replay of what the run recorded still gives every
    dataset but the timers bit for bit."""
    args = ["--task", "quadratics", "--lr", "0.1", "--steps", "3000", "--eval-every", "1000"]
    args += ["--algo", "relay", "--topology", "chain", "--record-params", "--dim", "6"]
    command = module_command("relaympi.train", *args, mpi=4)
    command += ["--message-deadline", "0.01", "--out", str(tmp_path / "mpi.h5")]
    with open(tmp_path / "mpi.log", "w") as log:
        job = subprocess.Popen(command, cwd=ROOT, env=env_for_subprocess(), stdout=log, stderr=log)
    holder = threading.Thread(target=hold, args=(job, 1, 0.05, 0.1), daemon=True)
    holder.start()
    assert job.wait(timeout=300) == 0, (tmp_path / "mpi.log").read_text()[-3000:]
    holder.join()
    recorded = read_run(tmp_path / "mpi.h5")
    assert recorded.late_drops is not None  # a 50 ms stop outlasts a 10 ms deadline
    assert {int(row[3]) for row in recorded.late_drops} >= {1}, recorded.late_drops
    replay_bit_for_bit(recorded, args, workers=4, out=tmp_path / "local.h5")
