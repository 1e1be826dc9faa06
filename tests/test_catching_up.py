"""A worker behind its neighbours under --message-deadline catches up by skipping steps: MPI sees
how far ahead they are from the messages they already sent it (probes, nothing received), it
skips, the messages of its skipped rounds are taken off the wire, the run file records the
skipped steps, and the in-process backend replays them bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi.comm import DropPolicy, run_local
from relaympi.config import ConfigError
from relaympi.drops import ROUNDS_PER_STEP
from relaympi.results import RunFileError, RunWriter, read_run
from relaympi.training.replay import replayed
from tests.conftest import replay_bit_for_bit, requires_mpirun, run_train
from tests.test_message_deadline import _cfg, run_module_file


def _run_file(path: Path, world_size: int = 3) -> RunWriter:
    writer = RunWriter.create(
        path, config={"algo": "relay", "topology": "chain"}, provenance={}, world_size=world_size
    )
    writer.append({"step": 0, "loss": np.zeros(world_size)})
    return writer


def test_skipped_steps_are_appended_read_and_forgotten_when_steps_are_redone(
    tmp_path: Path,
) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
        writer.add_skipped_steps(np.zeros((0, 2)))  # none yet: no dataset made
        writer.add_skipped_steps(np.array([[4, 1], [5, 1]]))
        writer.add_skipped_steps(np.array([[9, 2]]))
        writer.rewind(9)  # steps 9 on are run again
    run = read_run(tmp_path / "run.h5")
    assert run.skipped_steps is not None and run.skipped_steps.tolist() == [[4, 1], [5, 1]]
    with _run_file(tmp_path / "none.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
        writer.add_skipped_steps(np.zeros((0, 2)))
    assert read_run(tmp_path / "none.h5").skipped_steps is None  # nobody skipped


@pytest.mark.parametrize(
    "rows, why",
    [
        (np.zeros((2, 3), dtype=np.int64), "not rows of 2 integers"),
        (np.array([[3, 3]]), "names a worker outside 0..2"),
        (np.array([[-1, 0]]), "negative step"),
    ],
)
def test_a_crafted_skipped_dataset_is_refused(tmp_path: Path, rows, why) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
    with h5py.File(tmp_path / "run.h5", "a") as file:
        file["late_drops"].create_dataset("skipped", data=rows)
    with pytest.raises(RunFileError, match=why):
        read_run(tmp_path / "run.h5")


def test_a_replayed_skip_sends_nothing_and_its_neighbours_messages_to_it_are_counted() -> None:
    """Rank 1 skipped step 1 (rounds 4..7): in round 4 rank 0's message to it is counted but not
    delivered, rank 1's to rank 0 is missing there and recorded as late (as its MPI receiver did),
    and in step 2 every message is its own round's (nothing stale left in a mailbox)."""
    drops = DropPolicy(skipped=[(1, 1)])

    def body(comm):
        peer = 1 - comm.rank
        seen = []
        for step in range(3):
            if step == 1 and comm.rank == 1:
                continue  # the skipped step: no exchange at all
            got = np.full(2, -1.0)
            sent = np.full(2, 10.0 * step + comm.rank)
            request = comm.exchange({peer: sent}, {peer: got}, round=step * ROUNDS_PER_STEP)
            seen.append((step, sorted(request.wait()), got.tolist()))
        return seen, comm.late_drops, comm.bytes_sent.tolist()

    (seen0, late0, bytes0), (seen1, late1, bytes1) = run_local(2, body, drops=drops)
    assert seen0 == [(0, [1], [1.0, 1.0]), (1, [], [-1.0, -1.0]), (2, [1], [21.0, 21.0])]
    assert seen1 == [(0, [0], [0.0, 0.0]), (2, [0], [20.0, 20.0])]
    assert late0 == [(4, 0, 1, 0)] and late1 == []
    assert bytes0 == [0, 3 * 16] and bytes1 == [2 * 16, 0]  # rank 1 sent nothing in step 1


def test_the_batched_engine_refuses_a_run_with_skipped_steps(tmp_path: Path) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.array([[4, 16, 0, 1, 0]]))
        writer.add_skipped_steps(np.array([[4, 1]]))
    late, skipped, _ = replayed(_cfg(replay_drops=tmp_path / "run.h5"), 3)
    assert late == [(16, 0, 1, 0)] and skipped == [(4, 1)]
    with pytest.raises(ConfigError, match="skipped 1 steps to catch up, which only --backend"):
        replayed(_cfg(replay_drops=tmp_path / "run.h5", backend="batched"), 3)


AHEAD = """
import json, pathlib, sys
import numpy as np
from relaympi.comm import mpi_communicator

comm = mpi_communicator(deadline=0.05)
peer, found = 1 - comm.rank, {}
got = np.full(4, -1.0)
comm.exchange({peer: np.full(4, float(comm.rank))}, {peer: got}, round=0).wait()
if comm.rank == 0:  # ten rounds ahead of rank 1, which receives none of them
    for round in range(1, 11):
        comm.exchange({1: np.full(4, 10.0 * round)}, {}, round=round).wait()
comm.barrier()
if comm.rank == 1:
    found["ahead"] = [
        comm.steps_ahead(0, 1, 4, 64), comm.steps_ahead(0, 1, 11, 64),
        comm.steps_ahead(0, 1, 4, 6), comm.steps_ahead(3, 1, 4, 64),
    ]
comm.barrier()  # rank 0's message of round 11 is not sent before rank 1 looked
if comm.rank == 1:
    comm.skip_rounds(1, 11)  # rounds 1..10 left out: their messages are taken off the wire
got = np.full(4, -1.0)
arrived = comm.exchange({peer: np.full(4, 110.0 + comm.rank)}, {peer: got}, round=11).wait()
comm.barrier()
comm._reap_discards()
found.update(arrived=sorted(arrived), got=got.tolist(), detached=len(comm._detached))
found.update(drained=len(comm._drained), late=comm.late_drops)
pathlib.Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(found))
"""


@pytest.mark.slow
@requires_mpirun
def test_mpi_sees_how_far_ahead_a_neighbour_is_and_drains_the_skipped_rounds(
    tmp_path: Path,
) -> None:
    """Rank 0 sent rank 1 the messages of rounds 1..10 that rank 1 never received: rank 1's probe
    sees it 10 rounds ahead (not at 11 or more; at most the limit asked), skipping those rounds
    takes all ten off the wire (rank 0's sends complete), and round 11 then carries its own
    messages on both sides."""
    program = tmp_path / "ahead.py"
    program.write_text(AHEAD)
    proc = run_module_file(program, tmp_path)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert found[1]["ahead"] == [10, 0, 6, 7], proc.stdout + proc.stderr[-2000:]
    assert found[1]["arrived"] == [0] and found[1]["got"] == [110.0] * 4
    assert found[0]["arrived"] == [1] and found[0]["got"] == [111.0] * 4
    assert found[0]["detached"] == 0  # every send of the skipped rounds was taken
    assert found[1]["drained"] == 0 and found[1]["late"] == []


TAKING_TURNS = """
import json, pathlib, sys
import numpy as np
from relaympi.comm import mpi_communicator

comm = mpi_communicator(deadline=0.05)
peer, found = 1 - comm.rank, {}
for round in (0, 3):  # two rounds a step: rank 0 has sent in the first round and then the second
    got = np.full(4, -1.0)
    comm.exchange({peer: np.full(4, float(comm.rank))}, {peer: got}, round=round).wait()
if comm.rank == 0:  # steps 2..10 ahead of rank 1, each in its first round only (rounds 4, 6, ..)
    for step in range(2, 11):
        comm.exchange({1: np.full(4, float(step))}, {}, round=2 * step).wait()
comm.barrier()
if comm.rank == 1:
    found["ahead"] = [comm.steps_ahead(2, 2, 4, 64), comm.steps_ahead(2, 2, 9, 64)]
comm.barrier()
if comm.rank == 1:
    comm.skip_rounds(4, 22)  # steps 2..10 left out
got = np.full(4, -1.0)
arrived = comm.exchange({peer: np.full(4, 50.0 + comm.rank)}, {peer: got}, round=22).wait()
comm.barrier()
comm._reap_discards()
found.update(arrived=sorted(arrived), got=got.tolist(), detached=len(comm._detached))
found.update(late=comm.late_drops)
pathlib.Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(found))
"""


@pytest.mark.slow
@requires_mpirun
def test_mpi_sees_a_neighbour_ahead_in_any_round_of_a_step_it_sends_in(tmp_path: Path) -> None:
    """A schedule whose neighbours take turns across a step's rounds (SGP's): rank 0 last sent in
    the second round of a step, then sends steps 2..10 ahead in their first rounds only. Rank 1's
    probe looks in both rounds of a step and sees it 8 steps ahead (a probe of the newest round
    alone saw nothing); skipping those steps takes every message off the wire."""
    program = tmp_path / "turns.py"
    program.write_text(TAKING_TURNS)
    proc = run_module_file(program, tmp_path)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert found[1]["ahead"] == [8, 0], proc.stdout + proc.stderr[-2000:]
    assert found[1]["arrived"] == [0] and found[1]["got"] == [50.0] * 4
    assert found[0]["arrived"] == [1] and found[0]["got"] == [51.0] * 4
    assert found[0]["detached"] == 0 and found[1]["late"] == []


@pytest.mark.slow
@requires_mpirun
def test_a_held_rank_catches_up_by_skipping_and_the_replay_is_bit_for_bit(tmp_path: Path) -> None:
    """Rank 1 of 3 (chain) is held 3 s at step 2 while its neighbours run on: when it wakes it
    sees them far ahead, skips steps (recorded), and the local replay of the
    recorded drops and skips gives every dataset but the timers bit for bit."""
    args = ["--task", "quadratics", "--lr", "0.1", "--steps", "60", "--eval-every", "60"]
    args += ["--algo", "relay", "--topology", "chain", "--record-params", "--dim", "6"]
    run_train(
        [*args, "--message-deadline", "0.15", "--out", tmp_path / "mpi.h5"],
        mpi=3,
        env={"RELAYMPI_INJECT_DELAY": "1:2:3.0", "RELAYMPI_AGREEMENT_LAG": ""},
        check=0,
    )
    recorded = read_run(tmp_path / "mpi.h5")
    assert recorded.skipped_steps is not None, recorded.late_drops
    steps = recorded.skipped_steps[:, 0].tolist()
    assert set(recorded.skipped_steps[:, 1].tolist()) == {1}  # only the held rank skipped
    # after the hold; how many, and from when, depends on how fast MPI's progress brings in the
    # neighbours' messages that are queued for it
    assert steps and steps[0] > 2, steps
    replay_bit_for_bit(recorded, args, workers=3, out=tmp_path / "local.h5")  # skips included
