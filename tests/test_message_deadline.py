"""--message-deadline and --replay-drops: late drops recorded, refused where they cannot apply, and
replayed with --drop-prob's rule for every algorithm that can lose a message; on MPI, a worker held
back past the deadline is dropped from its neighbours' step and the run replays bit for bit."""

# Long module: the deadline's refusals, bookkeeping, replay on each engine and its MPI runs

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi import train
from relaympi.algorithms import round_id
from relaympi.algorithms.base import ROUNDS_PER_STEP
from relaympi.batched.base import delivered
from relaympi.comm import CommError, DropPolicy, run_local
from relaympi.config import ConfigError, RunConfig, parse_args
from relaympi.results import RunFileError, RunWriter, read_run
from relaympi.training.replay import replayed, replayed_late_drops
from tests.algorithm_cases import cases
from tests.conftest import (
    PY,
    ROOT,
    env_for_subprocess,
    matched,
    mpirun,
    replay_bit_for_bit,
    requires_mpirun,
    requires_ulfm,
    run_train,
    run_ulfm,
)
from tests.test_algorithms_with_drops import STEPS, _message_passing, _oracle

# the algorithms that take the deadline (d2 and the collective ones are refused), one case each,
# and RelaySum's chunked and in-place messages
CASES = [
    c
    for c in cases("drops")
    if c.id
    in (
        "dpsgd-chain-n5-adam",
        "qgm-one-peer-exponential-n4-mom0.9",
        "gt-alternating-ring-n4-adam",
        "sgp-exponential-n4-mom0.9",
        "relay-grad-double-binary-trees-n8-sgd-chunk3",
        "relay-chain-n5-mom0.9-counts",
        "relay-star-n6-sgd-previous",
        "relay-double-binary-trees-n7-sgd-initial-in-place-chunk2",
    )
]


# -- the drop bookkeeping ------------------------------------------------------------------------
def test_a_replayed_late_drop_is_the_receivers_alone() -> None:
    drops = DropPolicy(late=[(5, 0, 1, 0)])
    assert drops.late(5, 0, 1, 0)
    assert not drops.late(5, 0, 0, 1) and not drops.late(6, 0, 1, 0) and not drops.late(5, 1, 1, 0)
    assert not drops.dropped(5, 0, 1, 0)  # the sender still sends it


def _late_exchange(comm):
    """Rank 1 sends 3 floats to rank 0 in rounds 4 and 5 (round 5's in two chunks); round 4's
    message from 1 is a replayed late drop."""
    got = np.full(3, -1.0)
    arrived = comm.exchange(
        {1 - comm.rank: np.full(3, 10.0 + comm.rank)}, {1 - comm.rank: got}, round=4
    ).wait()
    before = got.copy()
    later = [
        comm.exchange(
            {1 - comm.rank: np.full(len(part), 20.0)}, {1 - comm.rank: part}, round=5, chunk=c
        )
        for c, part in enumerate((got[:2], got[2:]))
    ]
    later_arrived = [request.wait() for request in later]
    return comm.rank, arrived, before, later_arrived, got, comm.bytes_sent.copy(), comm.late_drops


def test_a_replayed_late_message_is_sent_counted_and_discarded() -> None:
    results = run_local(2, _late_exchange, drops=DropPolicy(late=[(4, 0, 1, 0), (5, 0, 1, 0)]))
    (_, arrived0, before0, later0, got0, bytes0, late0) = results[0]
    (_, arrived1, before1, _, got1, bytes1, late1) = results[1]
    assert arrived0 == frozenset() and before0.tolist() == [-1.0] * 3  # the buffer kept its content
    assert arrived1 == frozenset({0}) and before1.tolist() == [10.0] * 3
    assert later0 == [frozenset(), frozenset()]  # a late message is late in every chunk
    assert got0.tolist() == [-1.0] * 3 and got1.tolist() == [20.0] * 3
    # sent and counted by the sender: 3 + 2 + 1 float64s each way
    assert bytes0.tolist() == [0, 48] and bytes1.tolist() == [48, 0]
    assert late0 == [(4, 0, 1, 0), (5, 0, 1, 0)] and late1 == []  # once per message


def _chunked_under_a_deadline(comm):
    comm.deadline = 0.5
    buf = np.zeros(2)
    with pytest.raises(CommError, match=r"\(chunk 1\) cannot have a deadline"):
        comm.exchange({}, {1 - comm.rank: buf}, round=0, chunk=1)
    with pytest.raises(CommError, match="in-place exchange cannot have a deadline"):
        comm.exchange_replace({1 - comm.rank: buf})
    return True


def test_a_message_in_pieces_cannot_have_a_deadline() -> None:
    assert run_local(2, _chunked_under_a_deadline) == [True, True]


def test_the_batched_engine_counts_a_late_message_as_sent_not_arrived() -> None:
    drops = DropPolicy(late=[(7, 1, 2, 0)])
    sent, arrived = delivered(drops, 7, 1, np.array([2, 0, 2]), np.array([0, 2, 1]))
    assert sent.tolist() == [True, True, True] and arrived.tolist() == [False, True, True]


def _messages(n: int, drops: DropPolicy) -> list[tuple[int, int, int, int]]:
    """Every message ``drops`` loses over STEPS steps (each sub-round, the tags in use)."""
    return [
        (round_id(t, sub), tag, s, d)
        for t, sub, tag in itertools.product(range(STEPS), range(ROUNDS_PER_STEP), range(3))
        for s, d in itertools.permutations(range(n), 2)
        if drops.dropped(round_id(t, sub), tag, s, d)
    ]


def _with_bytes(comm, case):
    rank, trajectory = _message_passing(comm, case)
    return rank, trajectory, comm.bytes_sent.copy(), len(comm.late_drops)


def _received(case) -> set[tuple[int, int, int, int]]:
    """Every message the case's algorithm receives over STEPS steps, (round, tag, sender,
    receiver), from a run that loses none."""

    def record(comm):
        seen: set = set()
        exchange = comm.exchange

        def spy(sends, recvs, *, tag=0, round=0, chunk=0):
            seen.update((round, tag, peer, comm.rank) for peer in recvs)
            return exchange(sends, recvs, tag=tag, round=round, chunk=chunk)

        comm.exchange = spy
        _message_passing(comm, case)
        return seen

    return set().union(*run_local(case.workers, record))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_late_drops_have_the_drop_rule_of_each_algorithm(case) -> None:
    """The messages --drop-prob would lose, replayed as late instead: the loss model's numbers,
    the bytes of a run that lost nothing (a late message was sent), and each late message that
    travelled recorded once, by its receiver."""
    drops = DropPolicy(0.25, seed=1)
    late = _messages(case.workers, drops)
    received = _received(case)
    assert set(late) & received  # the case loses something
    replayed = run_local(case.workers, _with_bytes, case, drops=DropPolicy(late=late))
    lossless = run_local(case.workers, _with_bytes, case)
    expected = _oracle(case, case.workers, drops)
    for (rank, trajectory, sent, recorded), (_, _, sent_all, _) in zip(
        replayed, lossless, strict=True
    ):
        np.testing.assert_allclose(trajectory, expected[:, rank], rtol=0, atol=1e-10)
        np.testing.assert_array_equal(sent, sent_all)
        assert recorded == sum(1 for m in set(late) & received if m[3] == rank)


# -- the run file --------------------------------------------------------------------------------
def _run_file(path: Path, world_size: int = 3, **config) -> RunWriter:
    writer = RunWriter.create(
        path,
        config={"algo": "relay", "topology": "chain", **config},
        provenance={},
        world_size=world_size,
    )
    writer.append({"step": 0, "loss": np.zeros(world_size)})
    return writer


def test_late_drops_are_appended_read_and_forgotten_when_steps_are_redone(tmp_path: Path) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
        writer.add_late_drops(np.array([[3, 12, 0, 1, 0], [3, 12, 0, 1, 2]]))
        writer.add_late_drops(np.array([[7, 28, 1, 2, 1]]))
        writer.rewind(7)  # a heal redoes step 7
    run = read_run(tmp_path / "run.h5")
    assert run.late_drops is not None
    assert run.late_drops.tolist() == [[3, 12, 0, 1, 0], [3, 12, 0, 1, 2]]
    with _run_file(tmp_path / "none.h5") as writer:
        pass
    assert read_run(tmp_path / "none.h5").late_drops is None  # not a deadline run


@pytest.mark.parametrize(
    "rows, why",
    [
        (np.zeros((2, 4), dtype=np.int64), "not rows of 5 integers"),
        (np.zeros((2, 5)), "not rows of 5 integers"),  # floats
        (np.array([[3, 12, 0, 1, 3]]), "names a worker outside 0..2"),
        (np.array([[-1, 12, 0, 1, 0]]), "negative step"),
    ],
)
def test_a_crafted_late_drops_dataset_is_refused(tmp_path: Path, rows, why) -> None:
    with _run_file(tmp_path / "run.h5"):
        pass
    with h5py.File(tmp_path / "run.h5", "a") as file:
        file.create_group("late_drops").create_dataset("drops", data=rows)
    with pytest.raises(RunFileError, match=why):
        read_run(tmp_path / "run.h5")


# -- where the flags apply -----------------------------------------------------------------------
LOCAL = ["--backend", "local", "--workers", "3", "--task", "quadratics", "--steps", "2"]


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--message-deadline", "0.1"], "--backend local has no wire to be late on"),
        (["--message-deadline", "0.1", "--backend", "batched"], "--backend batched has no wire"),
        (["--message-deadline", "0.1", "--algo", "allreduce", "--backend", "mpi"], "collective"),
        (["--message-deadline", "0.1", "--algo", "d2", "--backend", "mpi"], "d2 has no sound"),
        (["--message-deadline", "0.1", "--overlap", "--backend", "mpi"], "use --no-overlap"),
        (
            ["--message-deadline", "0.1", "--relay-chunk", "64", "--backend", "mpi"],
            "leave out --relay-chunk",
        ),
        (["--message-deadline", "0", "--backend", "mpi"], "positive number of seconds, got 0"),
        (["--message-deadline", "nan", "--backend", "mpi"], "positive number of seconds, got nan"),
        (["--replay-drops", "run.h5", "--backend", "mpi"], "--message-deadline makes them"),
        (["--replay-drops", "run.h5", "--algo", "d2"], "d2 has no sound rule"),
        (["--replay-drops", "run.h5", "--algo", "allreduce"], "collective"),
        (["--replay-drops", "missing.h5"], "--replay-drops missing.h5 does not exist"),
    ],
)
def test_the_flags_are_refused_where_they_cannot_apply(
    tmp_path: Path, monkeypatch, flags, why
) -> None:
    monkeypatch.chdir(tmp_path)
    with _run_file(tmp_path / "run.h5"):
        pass
    backend = flags[flags.index("--backend") + 1] if "--backend" in flags else "local"
    workers = [] if backend == "mpi" else ["--workers", "3"]
    base = [] if "--backend" in flags else ["--backend", "local"]
    with pytest.raises(ConfigError, match=why):
        parse_args(["--task", "quadratics", "--steps", "2", *base, *workers, *flags])


def _cfg(**settings) -> RunConfig:
    return RunConfig(**{"algo": "relay", "topology": "chain", "task": "quadratics", **settings})


@pytest.mark.parametrize(
    "cfg, world_size, why",
    [
        (_cfg(), 4, "it ran world size 3, this run has 4"),
        (_cfg(algo="relay-grad"), 3, "it ran --algo relay, this run has relay-grad"),
        (_cfg(topology="star"), 3, "it ran --topology chain, this run has star"),
    ],
)
def test_a_replay_file_of_another_run_is_refused(tmp_path: Path, cfg, world_size, why) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.array([[1, 4, 0, 1, 0]]))
    assert replayed_late_drops(_cfg(replay_drops=tmp_path / "run.h5"), 3) == [(4, 0, 1, 0)]
    with pytest.raises(ConfigError, match=why):
        replayed_late_drops(
            RunConfig(**{**cfg.to_dict(), "replay_drops": tmp_path / "run.h5"}), world_size
        )


def test_a_replay_file_without_late_drops_or_with_losses_elsewhere_is_refused(
    tmp_path: Path,
) -> None:
    with _run_file(tmp_path / "plain.h5"):
        pass
    with pytest.raises(ConfigError, match="records no late drops"):
        replayed_late_drops(_cfg(replay_drops=tmp_path / "plain.h5"), 3)
    with _run_file(tmp_path / "lost.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
        writer.add_membership(
            {
                "step": 2,
                "lost": [2],
                "lost_nodes": [0],
                "lost_hosts": [None],
                "world_size": 2,
                "heal_s": 0.1,
            }
        )
    with pytest.raises(ConfigError, match="lost 1 workers mid-run; replay its losses with --b"):
        replayed_late_drops(_cfg(replay_drops=tmp_path / "lost.h5"), 3)
    local = _cfg(replay_drops=tmp_path / "lost.h5", backend="local", on_failure="continue")
    assert replayed(local, 3)[2] == [(2, 2)]  # worker 2 lost at step 2
    (tmp_path / "junk.h5").write_text("not a run file")
    with pytest.raises(ConfigError, match="--replay-drops .*junk.h5: "):
        replayed_late_drops(_cfg(replay_drops=tmp_path / "junk.h5"), 3)


def test_a_replay_of_another_run_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    with _run_file(tmp_path / "run.h5") as writer:
        writer.add_late_drops(np.zeros((0, 5)))
    code = train.main(
        [
            *LOCAL,
            "--algo",
            "dpsgd",
            "--topology",
            "ring",
            "--replay-drops",
            str(tmp_path / "run.h5"),
        ]
        + ["--out", str(tmp_path / "out.h5")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error:" in line] == [
        f"error: --replay-drops {tmp_path / 'run.h5'}: it ran --algo relay, this run has dpsgd; "
        "replay it with the same world size, algorithm and topology"
    ]


@pytest.mark.slow
def test_the_batched_engine_replays_the_same_late_drops(tmp_path: Path) -> None:
    """A recorded run's late drops (written here) replayed on --backend local and batched: the
    same late_drops rows and bytes, the same numbers to rounding (the batched engine sums in
    another order), and numbers that differ from a run without them."""
    with _run_file(tmp_path / "rec.h5", world_size=4) as writer:
        writer.add_late_drops(np.array([[1, 4, 0, 1, 0], [1, 4, 0, 1, 2], [5, 20, 0, 2, 3]]))
    args = [*QUAD, "--algo", "relay", "--topology", "chain", "--record-params", "--workers", 4]
    for backend in ("local", "batched"):
        run_train(
            [*args, "--backend", backend, "--replay-drops", tmp_path / "rec.h5"]
            + ["--out", tmp_path / f"{backend}.h5"],
            check=0,
        )
    run_train([*args, "--backend", "local", "--out", tmp_path / "clean.h5"], check=0)
    local, batched = read_run(tmp_path / "local.h5"), read_run(tmp_path / "batched.h5")
    assert local.late_drops is not None and batched.late_drops is not None
    assert (
        local.late_drops.tolist()
        == batched.late_drops.tolist()
        == [
            [1, 4, 0, 1, 0],
            [1, 4, 0, 1, 2],
            [5, 20, 0, 2, 3],
        ]
    )
    np.testing.assert_array_equal(local.data["bytes_sent"], batched.data["bytes_sent"])
    np.testing.assert_allclose(local.data["params"], batched.data["params"], rtol=0, atol=1e-12)
    clean = read_run(tmp_path / "clean.h5")
    np.testing.assert_array_equal(clean.data["bytes_sent"], local.data["bytes_sent"])
    assert np.abs(clean.data["params"] - local.data["params"]).max() > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "batched"])
def test_a_resumed_replay_keeps_the_late_drops_before_its_checkpoint(
    tmp_path: Path, backend: str
) -> None:
    """Stopped at step 4 (between evaluations at 0 and 8) and resumed from its checkpoint, a
    replay's run file holds every late drop once, as the uninterrupted replay's does."""
    rows = [[1, 4, 0, 1, 0], [2, 8, 0, 2, 1], [5, 20, 0, 2, 3]]
    with _run_file(tmp_path / "rec.h5", world_size=4) as writer:
        writer.add_late_drops(np.array(rows))
    args: list[object] = [*QUAD[:4], "--steps", "8", "--eval-every", "8", "--algo", "relay"]
    args += ["--topology", "chain", "--backend", backend, "--workers", 4]
    args += ["--replay-drops", tmp_path / "rec.h5", "--checkpoint-every", "2"]
    stopped = [*args, "--checkpoint-dir", tmp_path / "ckpt", "--out", tmp_path / "stopped.h5"]
    proc = run_train(stopped, env={"RELAYMPI_INJECT_SIGNAL": "TERM:4"})
    assert proc.returncode == 4, proc.stderr[-2000:]
    run_train(stopped, check=0)
    whole = [*args, "--checkpoint-dir", tmp_path / "ckpt2", "--out", tmp_path / "whole.h5"]
    run_train(whole, check=0)
    resumed, uninterrupted = read_run(tmp_path / "stopped.h5"), read_run(tmp_path / "whole.h5")
    assert resumed.late_drops is not None and uninterrupted.late_drops is not None
    assert resumed.late_drops.tolist() == uninterrupted.late_drops.tolist() == rows


# -- on MPI: a rank held back past the deadline --------------------------------------------------
QUAD = ["--task", "quadratics", "--lr", "0.1", "--steps", "8", "--eval-every", "4"]
SLOW_STEPS = (2, 5)
# each algorithm that takes the deadline, on 4 ranks: rank 1 sleeps past it at SLOW_STEPS
ALGORITHMS = {
    "relay": ["--topology", "chain"],
    "relay-grad": ["--topology", "binary-tree"],
    "dpsgd": ["--topology", "ring"],
    "qgm": ["--topology", "ring", "--momentum", "0.9"],
    "gt": ["--topology", "ring"],
    "sgp": [],
}
NEIGHBOURS_OF_1 = {
    "relay": {0, 2},
    "relay-grad": {0, 3},
    "dpsgd": {0, 2},
    "qgm": {0, 2},
    "gt": {0, 2},
}


LATE_SENDER = """
import json, pathlib, sys, time
import numpy as np
from relaympi.comm import mpi_communicator

# a deadline far above an on-time round's milliseconds, even on a loaded machine, and a hold far
# above the deadline: only round 1's message is late
comm = mpi_communicator(deadline=1.0)
peer, rounds = 1 - comm.rank, []
for round in range(4):
    if comm.rank == 1 and round == 1:
        time.sleep(4.0)  # rank 1's message of round 1 misses rank 0's deadline
    got = np.full(3, -1.0)
    sent = np.full(3, 10.0 * round + comm.rank)
    arrived = comm.exchange({peer: sent}, {peer: got}, round=round).wait()
    rounds.append([sorted(arrived), got.tolist()])
    comm.barrier()  # the next round starts together (rank 0 would be early for every one)
# a file per rank: the two ranks' lines can interleave in mpirun's one stdout
record = {"rank": comm.rank, "rounds": rounds, "late": comm.late_drops}
pathlib.Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(record))
"""


@pytest.mark.slow
@requires_mpirun
def test_a_late_message_is_dropped_and_never_lands_in_a_later_round(tmp_path: Path) -> None:
    program = tmp_path / "late.py"
    program.write_text(LATE_SENDER)
    proc = run_module_file(program, tmp_path)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert found[0]["late"] == [[1, 0, 1, 0]], proc.stdout + proc.stderr[-2000:]
    assert found[0]["rounds"] == [
        [[1], [1.0] * 3],
        [[], [-1.0] * 3],  # dropped: the buffer keeps its content
        [[1], [21.0] * 3],  # round 2's own message, not round 1's late one
        [[1], [31.0] * 3],
    ]
    assert found[1]["late"] == []  # rank 0's messages were there before rank 1 waited
    assert found[1]["rounds"] == [[[0], [10.0 * r] * 3] for r in range(4)]


REUSED_BUFFER = """
import json, pathlib, sys, time
import numpy as np
from relaympi.comm import mpi_communicator

# 1 MiB messages: too large to leave before their receive is posted (rendezvous), on every
# transport; rank 1 sleeps through rounds 3 to 7 of rank 0, so those sends of rank 0 are detached
comm = mpi_communicator(deadline=0.25)
peer, rounds = 1 - comm.rank, []
sent = np.empty(1 << 17)  # every round's message, overwritten as soon as its exchange returns
for round in range(8):
    if comm.rank == 1 and round == 3:
        time.sleep(2.0)
    sent[:] = 10.0 * round + comm.rank
    got = np.full(sent.size, -1.0)
    arrived = comm.exchange({peer: sent}, {peer: got}, round=round).wait()
    sent[:] = -2.0
    spare = comm._spare_copies.get(("send", peer, 0, 0))
    rounds.append([sorted(arrived), np.unique(got).tolist(), None if spare is None else id(spare)])
comm.barrier()
record = {"rounds": rounds, "late": comm.late_drops}
pathlib.Path(sys.argv[1], f"rank{comm.rank}.json").write_text(json.dumps(record))
"""


@pytest.mark.slow
@requires_mpirun
def test_a_send_reuses_its_copy_once_sent_and_a_detached_one_keeps_it(tmp_path: Path) -> None:
    """Under a deadline a send goes from a copy, so its caller may overwrite its buffer when the
    exchange returns: an on-time send's copy is the next round's (no allocation per step), and
    the copy of a send still in flight to a sleeping neighbour is never reused, so every message
    lands with its own round's values."""
    program = tmp_path / "reused.py"
    program.write_text(REUSED_BUFFER)
    proc = run_module_file(program, tmp_path)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert found[0]["late"] == [[r, 0, 1, 0] for r in range(3, 8)], proc.stdout + proc.stderr
    # rank 1 got every message of rank 0 with its round's values, those sent while it slept too
    assert found[1]["late"] == []
    assert [r[:2] for r in found[1]["rounds"]] == [[[0], [10.0 * r]] for r in range(8)]
    for rank in (0, 1):  # on time: each round's send went from the same copy
        copies = [spare for _, _, spare in found[rank]["rounds"][:3]]
        assert copies[0] is not None and copies == [copies[0]] * 3, (rank, copies)
    # in flight at the deadline: the copy stays with its send, none is left for the next
    assert [spare for _, _, spare in found[0]["rounds"][3:]] == [None] * 5


def run_module_file(program: Path, *args: object) -> subprocess.CompletedProcess:
    """``mpirun -n 2 python program ARGS`` from the repository root, its output captured."""
    return subprocess.run(
        [mpirun(), "-n", "2", PY, str(program), *map(str, args)],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.slow
@requires_mpirun
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_a_late_rank_is_dropped_recorded_and_replayed_bit_for_bit(tmp_path: Path, algo) -> None:
    """Rank 1 sleeps 1 s before its exchange at two steps, past a 0.15 s deadline: its
    neighbours drop its messages of those steps (and whatever else the busy machine made late),
    and --replay-drops on --backend local gives every dataset of the MPI run but the timers, bit
    for bit (quadratics: float64)."""
    args = [*QUAD, "--algo", algo, *ALGORITHMS[algo], "--record-params", "--dim", "6"]
    slow = f"1:{','.join(map(str, SLOW_STEPS))}:1.0"
    mpi = run_train(
        [*args, "--message-deadline", "0.15", "--out", tmp_path / "mpi.h5"],
        mpi=4,
        env={"RELAYMPI_INJECT_DELAY": slow},
        check=0,
    )
    matched(r"completed: ", mpi.stdout + mpi.stderr)
    recorded = read_run(tmp_path / "mpi.h5")
    assert recorded.late_drops is not None
    late = {(int(step), int(s), int(d)) for step, _, _, s, d in recorded.late_drops}
    missed_by = {d for step, s, d in late if s == 1 and step in SLOW_STEPS}
    assert {step for step, s, _ in late if s == 1} >= set(SLOW_STEPS), recorded.late_drops
    if algo in NEIGHBOURS_OF_1:
        assert missed_by == NEIGHBOURS_OF_1[algo]
    # what the replay must reproduce includes the parameters, the bytes and the epochs
    assert {"params", "bytes_sent", "suboptimality", "epoch"} <= set(recorded.data)
    replay_bit_for_bit(recorded, args, workers=4, out=tmp_path / "local.h5")
    # the same run without them differs (they changed the numbers) but sent the same bytes
    run_train(
        [*args, "--backend", "local", "--workers", 4, "--out", tmp_path / "clean.h5"], check=0
    )
    clean = read_run(tmp_path / "clean.h5")
    assert not np.array_equal(clean.data["params"], recorded.data["params"])
    np.testing.assert_array_equal(clean.data["bytes_sent"], recorded.data["bytes_sent"])


@pytest.mark.slow
@requires_ulfm
def test_a_heal_keeps_the_late_drops_of_the_steps_before_it(tmp_path: Path) -> None:
    """Rank 3 is lost at the start of step 4, before the evaluation that would gather the late
    drops of step 2: the survivors carry them over the heal, and those of step 6 follow."""
    args = [*QUAD, "--eval-every", "2", "--algo", "dpsgd", "--topology", "ring"]
    proc = run_ulfm(
        [PY, "-m", "relaympi.train", *args, "--message-deadline", "0.15"]
        + ["--on-failure", "continue", "--out", tmp_path / "run.h5"],
        4,
        env={"RELAYMPI_INJECT_FAILURE": "3:4", "RELAYMPI_INJECT_DELAY": "1:2,6:1.0"},
    )
    matched(r"completed: .*rank 3 \(\S+\) lost at step 4", proc.stdout + proc.stderr)
    run = read_run(tmp_path / "run.h5")
    assert run.late_drops is not None
    assert {(step, s, d) for step, _, _, s, d in run.late_drops.tolist()} >= {
        (2, 1, 0),
        (2, 1, 2),
        (6, 1, 0),
        (6, 1, 2),
    }
    assert len(run.late_drops) == len({tuple(row) for row in run.late_drops.tolist()})
