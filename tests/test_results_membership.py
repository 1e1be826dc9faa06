"""Membership changes in the run file (--on-failure continue): the writer's records, rewind and
take-over, the reader, `show`, the end summary and the quality rules with lost workers' NaN."""

# Long module: every rule of the membership records: writing, reading, show, summary, quality

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from relaympi.results import (
    RunExistsError,
    RunWriter,
    finished_workers,
    main,
    nonfinite_workers,
    read_run,
    unstable_loss,
)
from relaympi.results.membership import present
from relaympi.training.run_file import print_summary

N0 = 4


def record(step: int, lost: list[int], world_size: int, heal_s: float = 0.41, **extra: Any):
    return {
        "step": step,
        "lost": lost,
        "lost_nodes": [w // 2 for w in lost],
        "lost_hosts": [f"node{w // 2 + 1}" for w in lost],
        "world_size": world_size,
        "heal_s": heal_s,
        **extra,
    }


def new_run(path: Path, rows: int = 0, n: int = N0) -> RunWriter:
    writer = RunWriter.create(
        path, config={"task": "digits", "epochs": 2}, provenance={}, world_size=n
    )
    for k in range(rows):
        writer.append({"step": 10 * k, "train_loss": np.full(n, 1.0 + k)})
    return writer


def steps_of(path: Path) -> list[int]:
    """Every row's step as stored (a half-written row's -1 included)."""
    try:
        file = h5py.File(path, "r", locking=False)
    except OSError:  # this process is writing it: HDF5 shares that handle
        file = h5py.File(path, "r", locking="best-effort")
    with file:
        return file["step"][:].tolist()


# ----------------------------------------------------------------------------- the writer


def test_add_membership_appends_records_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=3) as writer:
        writer.add_membership(record(20, [3], 3))
        # flushed at once: another reader sees it while the writer is open
        assert len(read_run(path).membership) == 1
        writer.add_membership(record(20, [1, 0], 1, heal_s=2))
    with h5py.File(path, "r") as file:
        stored = json.loads(file.attrs["membership"])
    assert stored == [
        record(20, [3], 3),
        {**record(20, [1, 0], 1), "heal_s": 2.0},
    ]
    run = read_run(path)
    assert run.membership == stored
    assert run.finished_workers == [2]
    assert "membership" not in run.attrs  # parsed, not left as raw text among the attributes


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"lost": [4]}, "lost"),  # not an original rank of a 4-worker run
        ({"lost": []}, "lost"),
        ({"lost": [True]}, "lost"),
        ({"lost_nodes": [0, 1]}, "lost_nodes"),
        ({"lost_hosts": [3]}, "lost_hosts"),
        ({"step": -1}, "step"),
        ({"step": 1.5}, "step"),
        ({"heal_s": "fast"}, "heal_s"),
        ({"heal_s": math.nan}, "heal_s"),
        ({"world_size": 4}, "world_size"),  # one lost of four leaves three
        ({"colour": "red"}, "colour"),
    ],
)
def test_add_membership_names_the_bad_key(tmp_path: Path, bad: dict, key: str) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=1) as writer:
        with pytest.raises(ValueError, match=rf"'{key}'"):
            writer.add_membership({**record(10, [1], 3), **bad})
        assert writer.membership == []
    missing = record(10, [1], 3)
    del missing["heal_s"]
    with RunWriter.take_over(path, from_step=10) as writer:
        with pytest.raises(ValueError, match="'heal_s'"):
            writer.add_membership(missing)


def test_add_membership_checks_against_earlier_records(tmp_path: Path) -> None:
    with new_run(tmp_path / "run.h5") as writer:
        writer.add_membership(record(50, [2], 3))
        with pytest.raises(ValueError, match="'lost'.*lost before"):
            writer.add_membership(record(60, [2], 2))
        with pytest.raises(ValueError, match="'step' 40 is before"):
            writer.add_membership(record(40, [1], 2))
        with pytest.raises(ValueError, match="'world_size'.*2, got 3"):
            writer.add_membership(record(60, [1], 3))
        assert len(writer.membership) == 1


def test_membership_is_not_a_free_attribute(tmp_path: Path) -> None:
    with new_run(tmp_path / "run.h5") as writer:
        with pytest.raises(ValueError, match="owned by the writer"):
            writer.set_attrs(membership="[]")


def test_rewind_drops_the_step_and_later(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=5) as writer:  # steps 0 10 20 30 40
        writer.rewind(30)
        assert writer.num_rows == 3
        assert steps_of(path) == [0, 10, 20]
        writer.rewind(25)  # between rows: nothing at or after it left
        assert steps_of(path) == [0, 10, 20]
        writer.append({"step": 30, "train_loss": np.full(N0, 7.0)})
    run = read_run(path)
    assert run.data["step"].tolist() == [0, 10, 20, 30]
    np.testing.assert_array_equal(run.data["train_loss"][:, 0], [1, 2, 3, 7])
    assert run.status == "running" and "resumed_at_steps" not in run.attrs


def test_take_over_a_running_file_whose_writer_died(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    writer = new_run(path, rows=4)  # steps 0 10 20 30
    writer.add_membership(record(15, [1], 3))
    writer.close()  # the dead rank 0's process: its file handle is gone
    with RunWriter.take_over(path, from_step=20) as taker:
        assert taker.world_size == N0 and taker.num_rows == 2
        taker.append({"step": 20, "train_loss": np.full(N0, 9.0)})
        taker.add_membership(record(25, [0], 2))
    run = read_run(path)
    assert run.status == "running"
    assert run.data["step"].tolist() == [0, 10, 20]
    assert run.data["train_loss"][-1, 0] == 9.0
    assert [c["step"] for c in run.membership] == [15, 25]
    assert "resumed_at_steps" not in run.attrs and "resumed_at_times" not in run.attrs


def _writer_then(path: Path, signal_name: str) -> str:
    """A program that writes three rows of a 2-worker run file at ``path``, then sends itself
    that signal (the writer's process killed or stopped mid-run)."""
    return (
        "import os, signal, numpy as np\n"
        "from relaympi.results import RunWriter\n"
        f"w = RunWriter.create({str(path)!r}, config={{}}, provenance={{}}, world_size=2)\n"
        "for k in range(3):\n"
        "    w.append({'step': 10 * k, 'train_loss': np.ones(2)})\n"
        f"os.kill(os.getpid(), signal.{signal_name})\n"
    )


def test_take_over_after_the_writer_was_killed(tmp_path: Path) -> None:
    """MPI: rank 0's process SIGKILLs itself while it holds the file open (and HDF5's lock)."""
    import subprocess
    import sys

    path = tmp_path / "run.h5"
    script = _writer_then(path, "SIGKILL")
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == -9
    with RunWriter.take_over(path, from_step=20) as writer:
        writer.append({"step": 20, "train_loss": np.full(2, 4.0)})
    run = read_run(path)
    assert run.status == "running" and run.data["step"].tolist() == [0, 10, 20]
    assert run.data["train_loss"][:, 1].tolist() == [1.0, 1.0, 4.0]


def test_take_over_from_a_stopped_writer_that_holds_the_lock(tmp_path: Path) -> None:
    """--peer-timeout evicted rank 0: its process is stopped, not gone, and keeps HDF5's lock."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "run.h5"
    script = _writer_then(path, "SIGSTOP")
    stopped = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(600):  # until it stops, holding the file
            with open(f"/proc/{stopped.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[-1].split()[0] == "T":
                    break
            time.sleep(0.05)
        with pytest.raises(BlockingIOError):  # as a taker that does not know finds it
            RunWriter.take_over(path, from_step=20)
        with RunWriter.take_over(path, from_step=20, writer_stalled=True) as writer:
            writer.append({"step": 20, "train_loss": np.full(2, 4.0)})
    finally:
        stopped.send_signal(signal.SIGKILL)
        stopped.wait()
    run = read_run(path)
    assert run.status == "running" and run.data["step"].tolist() == [0, 10, 20]
    assert run.data["train_loss"][:, 1].tolist() == [1.0, 1.0, 4.0]


def test_take_over_in_the_process_that_still_holds_the_file(tmp_path: Path) -> None:
    """The local backend: rank 0's thread vanished, its h5py handle is still open here."""
    path = tmp_path / "run.h5"
    dead = new_run(path, rows=3)
    with RunWriter.take_over(path, from_step=10) as taker:
        taker.append({"step": 10, "train_loss": np.full(N0, 5.0)})
    assert read_run(path).data["train_loss"][:, 0].tolist() == [1.0, 5.0]
    dead.close()


def test_take_over_drops_a_half_written_row(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=2) as writer:
        pass
    with h5py.File(path, "r+") as file:  # rank 0 died inside an append: step not written
        for name in ("train_loss", "step"):
            file[name].resize(3, axis=0)
    assert steps_of(path) == [0, 10, -1]
    with RunWriter.take_over(path, from_step=100) as writer:
        assert writer.num_rows == 2
        writer.append({"step": 20, "train_loss": np.full(N0, 3.0)})
    assert read_run(path).data["step"].tolist() == [0, 10, 20]


@pytest.mark.parametrize("status", ["completed", "diverged", "failed", "preempted"])
def test_take_over_refuses_a_run_not_running(tmp_path: Path, status: str) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=2) as writer:
        writer.set_status(status)
    with pytest.raises(RunExistsError, match=f"{status} run"):
        RunWriter.take_over(path, from_step=0)
    assert steps_of(path) == [0, 10]


def test_take_over_refuses_missing_and_damaged_files(tmp_path: Path) -> None:
    from relaympi.results import RunFileError

    with pytest.raises(FileNotFoundError):
        RunWriter.take_over(tmp_path / "none.h5", from_step=0)
    (tmp_path / "bad.h5").write_bytes(b"")
    with pytest.raises(RunFileError, match="empty"):
        RunWriter.take_over(tmp_path / "bad.h5", from_step=0)


# ----------------------------------------------------------------------------- the reader


def test_old_files_read_without_membership(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=2):
        pass
    run = read_run(path)
    assert run.membership == [] and run.finished_workers == [0, 1, 2, 3]
    assert run.present().all()


def test_a_damaged_membership_attribute_is_a_run_file_error(tmp_path: Path) -> None:
    from relaympi.results import RunFileError

    path = tmp_path / "run.h5"
    with new_run(path, rows=1):
        pass
    with h5py.File(path, "r+") as file:
        file.attrs["membership"] = "[{not json"
    with pytest.raises(RunFileError, match="'membership' is not valid JSON"):
        read_run(path)


def test_present_marks_rows_from_the_change_on() -> None:
    changes = [record(20, [3], 3), record(40, [0, 2], 1)]
    mask = present(np.array([0, 10, 20, 30, 40, 50]), N0, changes)
    expected = np.ones((6, N0), dtype=bool)
    expected[2:, 3] = False
    expected[4:, 0] = expected[4:, 2] = False
    np.testing.assert_array_equal(mask, expected)
    assert finished_workers(N0, changes) == [1]


# ------------------------------------------------------- a run file with a lost worker: show

LOST_STEP = 1230


def bytes_rate(w: np.ndarray) -> np.ndarray:
    return 1000.0 + 10.0 * w


def inter_rate(w: np.ndarray) -> np.ndarray:
    return 100.0 * (w % 3)


def lost_worker_run(
    path: Path, *, status: str = "completed", n: int = 16, counted: bool = False
) -> Path:
    """16 workers on 8 nodes, evaluations every 100 steps to 2000; worker 7 (node 3, host node4)
    lost at step 1230, its columns NaN from the evaluation of step 1300 on. ``counted``: with
    the byte counters, worker w sending bytes_rate(w) bytes a step, inter_rate(w) of them to
    other nodes."""
    steps = np.arange(0, 2001, 100)
    epochs = steps / 200.0
    rng = np.random.default_rng(0)
    accuracy = 0.5 + 0.4 * np.linspace(0, 1, len(steps))[:, None] + 0.01 * rng.random((21, n))
    loss = 2.0 - accuracy
    lost = steps >= LOST_STEP
    accuracy[lost, 7] = loss[lost, 7] = np.nan
    rows = {
        "step": steps,
        "epoch": epochs,
        "time_s": steps / 100.0,
        "train_loss": loss,
        "test_accuracy": accuracy,
    }
    if counted:
        workers = np.arange(n)
        rows["bytes_sent"] = steps[:, None] * bytes_rate(workers)[None, :]
        rows["inter_node_bytes_sent"] = steps[:, None] * inter_rate(workers)[None, :]
        for name in ("bytes_sent", "inter_node_bytes_sent"):
            rows[name][lost, 7] = np.nan
    with RunWriter.create(
        path,
        config={"task": "digits", "algo": "relay", "world_size": n},
        provenance={},
        world_size=n,
    ) as writer:
        writer.extend(rows)
        writer.set_attrs(num_classes=10)
        writer.add_membership(
            {
                "step": LOST_STEP,
                "lost": [7],
                "lost_nodes": [3],
                "lost_hosts": ["node4"],
                "world_size": n - 1,
                "heal_s": 0.41,
            }
        )
        writer.set_status(status)
    return path


def test_show_prints_each_membership_change(tmp_path: Path, capsys) -> None:
    path = lost_worker_run(tmp_path / "run.h5")
    with h5py.File(path, "r+") as file:  # a second change, with a host that was not known
        changes = json.loads(file.attrs["membership"])
        changes.append(
            {
                "step": 1500,
                "lost": [2, 9],
                "lost_nodes": [1, 4],
                "lost_hosts": [None, "node5"],
                "world_size": 13,
                "heal_s": 1.25,
            }
        )
        file.attrs["membership"] = json.dumps(changes)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("membership")]
    assert lines == [
        "membership: step 1230: lost rank 7 (node 3, host node4); 15 workers after; "
        "healed in 0.41 s",
        "membership: step 1500: lost rank 2 (node 1), rank 9 (node 4, host node5); 13 workers "
        "after; healed in 1.25 s",
    ]
    assert "warning" not in out  # the lost workers' NaN is no unstable or non-finite run


def test_show_prints_no_membership_for_a_run_without_changes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=2):
        pass
    assert main(["show", str(path)]) == 0
    assert "\nmembership" not in capsys.readouterr().out


def test_show_time_to_target_over_the_workers_present(tmp_path: Path, capsys) -> None:
    """The worst worker per evaluation is the worst of those that took part: a lost worker's NaN
    would otherwise make every later evaluation miss any target."""
    path = lost_worker_run(tmp_path / "run.h5")
    run = read_run(path)
    accuracy = run.data["test_accuracy"]
    target = float(np.min(np.delete(accuracy[-1], 7)) - 1e-9)
    assert main(["show", str(path), "--target-accuracy", f"{target:.12f}"]) == 0
    out = capsys.readouterr().out
    worst = np.nanmin(accuracy, axis=1)  # independent: the lost column is NaN from step 1300 on
    first = int(np.flatnonzero(worst >= float(f"{target:.12f}"))[0])
    assert re.search(rf": {run.data['time_s'][first]:.3g} s$", out, re.M), out


def shown_bytes(out: str) -> tuple[float, float, float, float]:
    """(bytes/step, its max worker, inter-node bytes/step, its max worker) from `show`'s output."""
    found = re.search(
        r"bytes/step (\S+) \(max worker (\S+)\), inter-node bytes/step (\S+) \(max worker "
        r"(\S+)\)",
        out,
    )
    assert found, out
    return tuple(float(v) for v in found.groups())  # type: ignore[return-value]


def test_show_bytes_per_step_over_the_workers_that_finished(tmp_path: Path, capsys) -> None:
    path = lost_worker_run(tmp_path / "run.h5", counted=True)
    assert main(["show", str(path)]) == 0
    finished = np.delete(np.arange(16), 7)
    sent, inter = bytes_rate(finished), inter_rate(finished)
    expected = (sent.mean(), sent.max(), inter.mean(), inter.max())
    np.testing.assert_allclose(shown_bytes(capsys.readouterr().out), expected, rtol=5e-4)


def test_show_bytes_per_step_of_a_readmitted_worker_since_it_came_back(
    tmp_path: Path, capsys
) -> None:
    path = readmitted_run(tmp_path / "run.h5", counted=True)
    assert main(["show", str(path)]) == 0
    workers = np.arange(16)
    # every worker finished; rank 7 counts from 0 again at step 1600, at 3x its old rate
    sent, inter = bytes_rate(workers), inter_rate(workers)
    sent[7], inter[7] = 3 * sent[7], 3 * inter[7]
    expected = (sent.mean(), sent.max(), inter.mean(), inter.max())
    np.testing.assert_allclose(shown_bytes(capsys.readouterr().out), expected, rtol=5e-4)


# ----------------------------------------------------------------------- the end summary


def test_summary_line_says_who_finished_and_uses_their_metrics(tmp_path: Path, capsys) -> None:
    path = lost_worker_run(tmp_path / "run.h5")
    print_summary(path, "completed")
    line = capsys.readouterr().out.strip()
    assert "| 15 of 16 workers finished; rank 7 (node4) lost at step 1230, healed in 0.4 s" in line
    accuracy = read_run(path).data["test_accuracy"]
    final = np.delete(accuracy[-1], 7)
    assert (
        f"final test accuracy: worst worker {final.min():.4f}, mean {final.mean():.4f}, "
        f"best {final.max():.4f}" in line
    )
    epochs = np.arange(0, 2001, 100) / 200.0
    window = epochs > epochs[-1] - 5
    last5 = np.delete(accuracy[window], 7, axis=1).mean(axis=0)
    assert f"worst worker {last5.min():.4f}, mean {last5.mean():.4f}" in line
    assert "nan" not in line and "WARNING" not in line


def test_summary_line_joins_several_changes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=3) as writer:
        writer.add_membership(record(10, [3], 3, heal_s=0.04))
        writer.add_membership(record(20, [0, 1], 1, heal_s=12.34))
        writer.set_status("completed")
    print_summary(path, "completed")
    line = capsys.readouterr().out
    assert (
        "| 1 of 4 workers finished; rank 3 (node2) lost at step 10, healed in 0.04 s; "
        "rank 0 (node1) and rank 1 (node1) lost at step 20, healed in 12.3 s" in line
    )


def test_summary_line_still_shows_a_nan_of_a_worker_that_finished(tmp_path: Path, capsys) -> None:
    path = lost_worker_run(tmp_path / "run.h5")
    with h5py.File(path, "r+") as file:
        file["test_accuracy"][-1, 2] = np.nan  # worker 2 was never lost
    print_summary(path, "completed")
    assert "worst worker nan" in capsys.readouterr().out


# -------------------------------------------------------------------- the quality rules


def test_unstable_loss_ignores_the_lost_workers_nan(tmp_path: Path) -> None:
    steps = np.array([0, 10, 20, 30])
    loss = np.array([[1.0, 1.0, 1.0], [1.5, 1.5, 9.0], [2.5, 2.5, np.nan], [3.0, 3.0, np.nan]])
    changes = [{**record(20, [2], 2), "lost_nodes": [0], "lost_hosts": [None]}]
    mask = present(steps, 3, changes)
    # without the membership, the NaN reads as a non-finite final loss: not judged
    assert unstable_loss(loss) is None
    # with it: first 1.0, final 3.0 (the two survivors) > 2x: unstable
    assert unstable_loss(loss, mask) == (1.0, 3.0)
    calm = loss.copy()
    calm[3, :2] = 1.9
    assert unstable_loss(calm, mask) is None


def test_a_nan_of_a_worker_not_lost_is_still_non_finite() -> None:
    steps = np.array([0, 10, 20])
    loss = np.array([[1.0, 1.0, 1.0], [1.0, np.nan, 1.0], [3.0, 3.0, np.nan]])
    changes = [{**record(20, [2], 2), "lost_nodes": [0], "lost_hosts": [None]}]
    mask = present(steps, 3, changes)
    assert nonfinite_workers(loss, mask) == [1]
    assert nonfinite_workers(loss) == [1, 2]
    final_nan = loss.copy()
    final_nan[2, 0] = np.nan  # worker 0 finished: its final NaN makes the final mean non-finite
    final_nan[1, 1] = 1.0
    assert unstable_loss(final_nan, mask) is None
    final_nan[2, 0] = 3.0
    assert unstable_loss(final_nan, mask) == (1.0, 3.0)


def test_summary_names_workers_at_chance_by_their_original_rank(tmp_path: Path, capsys) -> None:
    path = lost_worker_run(tmp_path / "run.h5")
    with h5py.File(path, "r+") as file:
        accuracy = file["test_accuracy"][...]
        accuracy[:, 9] = 0.05  # below 1.5/10: at chance; index 8 among the 15 that finished
        file["test_accuracy"][...] = accuracy
    print_summary(path, "completed")
    assert "WARNING: worker(s) 9 at chance accuracy" in capsys.readouterr().out


# ------------------------------------------------ re-admission: a rerun back to full strength


def readmit(step: int, workers: list[int], world_size: int, heal_s: float = 0.2) -> dict:
    return {
        "step": step,
        "lost": [],
        "lost_nodes": [],
        "lost_hosts": [],
        "world_size": world_size,
        "heal_s": heal_s,
        "readmitted": workers,
    }


def test_add_membership_takes_a_readmission_and_a_loss_again(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=3) as writer:
        writer.add_membership(record(10, [3, 1], 2))
        writer.add_membership(readmit(20, [3], 3))  # rank 1 stays out
        writer.add_membership(record(20, [3], 2))  # re-admitted, then lost again
        writer.add_membership(readmit(30, [1, 3], 4, heal_s=1))
    with h5py.File(path, "r") as file:
        stored = json.loads(file.attrs["membership"])
    assert stored == [
        record(10, [3, 1], 2),
        readmit(20, [3], 3),
        record(20, [3], 2),
        {**readmit(30, [1, 3], 4), "heal_s": 1.0},
    ]
    assert "readmitted" not in stored[0] and "readmitted" not in stored[2]
    run = read_run(path)
    assert run.membership == stored
    assert run.finished_workers == [0, 1, 2, 3]


def test_a_loss_with_an_empty_readmitted_list_is_stored_as_a_plain_loss(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=1) as writer:
        writer.add_membership({**record(10, [2], 3), "readmitted": []})
    with h5py.File(path, "r") as file:
        assert json.loads(file.attrs["membership"]) == [record(10, [2], 3)]


@pytest.mark.parametrize(
    "bad, match",
    [
        (readmit(30, [2], 4), r"'readmitted' names worker\(s\) \[2\] not lost"),  # never lost
        (readmit(30, [1], 4), r"'readmitted' names worker\(s\) \[1\] not lost"),  # back already
        (readmit(30, [0, 0], 4), r"'readmitted' must be a list of distinct"),
        (readmit(30, [4], 4), r"'readmitted' must be a list of distinct worker ids in \[0, 4\)"),
        ({**readmit(30, [0], 4), "readmitted": 0}, r"'readmitted' must be a list"),
        ({**readmit(30, [0], 4), "readmitted": [True]}, r"'readmitted' must be a list"),
        ({**record(30, [2], 3), "readmitted": [0]}, r"'lost' must be \[\].*not both"),
        ({**readmit(30, [0], 4), "lost_nodes": [0]}, r"'lost_nodes' must be 0 node"),
        ({**readmit(30, [0], 4), "lost_hosts": [None]}, r"'lost_hosts' must be 0 host"),
        (readmit(30, [0], 3), r"'world_size' must be the workers re-admitted after.*4, got 3"),
        (readmit(15, [0], 4), r"'step' 15 is before the previous change's 20"),
        ({**record(30, [0], 3), "lost": []}, r"'lost' must be a non-empty list"),
    ],
)
def test_a_bad_readmission_names_the_problem(tmp_path: Path, bad: dict, match: str) -> None:
    """After: rank 1 lost at 10, re-admitted at 20, rank 0 lost at 20 (3 workers, 0 out)."""
    with new_run(tmp_path / "run.h5") as writer:
        writer.add_membership(record(10, [1], 3))
        writer.add_membership(readmit(20, [1], 4))
        writer.add_membership(record(20, [0], 3))
        with pytest.raises(ValueError, match=match):
            writer.add_membership(bad)
        assert len(writer.membership) == 3


def test_a_readmitted_key_that_is_no_list_is_a_run_file_error(tmp_path: Path) -> None:
    from relaympi.results import RunFileError

    path = tmp_path / "run.h5"
    with new_run(path, rows=1):
        pass
    with h5py.File(path, "r+") as file:
        file.attrs["membership"] = json.dumps([{**readmit(10, [0], 4), "readmitted": "7"}])
    with pytest.raises(RunFileError, match="'membership' is a record whose 'readmitted'"):
        read_run(path)


def test_present_is_false_only_while_a_worker_was_out() -> None:
    changes = [
        record(20, [3, 1], 2),
        readmit(40, [3], 3),
        record(50, [3], 2),  # out again from 50, back from 70
        readmit(70, [3], 3),
    ]
    steps = np.arange(0, 90, 10)
    mask = present(steps, N0, changes)
    # by hand, row by row: (step, the workers out)
    out = {0: [], 10: [], 20: [1, 3], 30: [1, 3], 40: [1], 50: [1, 3], 60: [1, 3], 70: [1], 80: [1]}
    expected = np.array([[w not in out[int(s)] for w in range(N0)] for s in steps])
    np.testing.assert_array_equal(mask, expected)
    assert finished_workers(N0, changes) == [0, 2, 3]
    # finished = present at the last row
    assert finished_workers(N0, changes) == np.flatnonzero(mask[-1]).tolist()


def test_a_readmission_at_the_loss_step_leaves_no_gap() -> None:
    mask = present(np.array([0, 10, 20]), N0, [record(10, [2], 3), readmit(10, [2], 4)])
    assert mask.all()


READMIT_STEP = 1600


def readmitted_run(path: Path, counted: bool = False) -> Path:
    """lost_worker_run, then a rerun that re-admitted rank 7 at step 1600: its columns hold numbers
    again from that row on (1300 .. 1500 stay NaN). ``counted``: with the byte counters, rank 7's
    again from 0 at step 1600, at 3 times its rate before."""
    lost_worker_run(path, counted=counted)
    with h5py.File(path, "r+") as file:
        steps = file["step"][:]
        again = steps >= READMIT_STEP
        for name in ("test_accuracy", "train_loss"):
            values = file[name][:]
            values[again, 7] = 0.3 + 0.001 * steps[again]
            file[name][...] = values
        rates = {"bytes_sent": bytes_rate, "inter_node_bytes_sent": inter_rate}
        for name, rate in rates.items() if counted else ():
            values = file[name][:]
            values[again, 7] = (steps[again] - READMIT_STEP) * 3 * rate(np.array(7))
            file[name][...] = values
        changes = json.loads(file.attrs["membership"])
        file.attrs["membership"] = json.dumps(changes + [readmit(READMIT_STEP, [7], 16)])
    return path


def test_show_prints_a_readmission(tmp_path: Path, capsys) -> None:
    path = readmitted_run(tmp_path / "run.h5")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("membership")]
    assert lines == [
        "membership: step 1230: lost rank 7 (node 3, host node4); 15 workers after; "
        "healed in 0.41 s",
        "membership: step 1600: re-admitted rank 7; 16 workers after; in 0.20 s",
    ]
    assert "warning" not in out  # the NaN while rank 7 was out is not a non-finite value


def test_summary_line_says_who_was_readmitted(tmp_path: Path, capsys) -> None:
    path = readmitted_run(tmp_path / "run.h5")
    print_summary(path, "completed")
    line = capsys.readouterr().out.strip()
    assert (
        "| 16 of 16 workers finished; rank 7 (node4) lost at step 1230, healed in 0.4 s; "
        "rank 7 re-admitted at step 1600" in line
    )
    accuracy = read_run(path).data["test_accuracy"]
    final = accuracy[-1]  # every worker, rank 7 included: it finished
    assert f"final test accuracy: worst worker {final.min():.4f}" in line
    # the last 5 epochs (steps 1100 .. 2000): rank 7 only over its rows present (1100, 1200 and
    # 1600 .. 2000), by hand
    steps = np.arange(0, 2001, 100)
    window = steps / 200.0 > 10 - 5
    was_in = window & ((steps < LOST_STEP) | (steps >= READMIT_STEP))
    means = accuracy[window].mean(axis=0)
    means[7] = accuracy[was_in, 7].mean()
    assert np.isfinite(means).all()
    assert f"worst worker {means.min():.4f}, mean {means.mean():.4f}" in line
    assert "nan" not in line and "WARNING" not in line


def test_summary_line_with_a_worker_still_out_after_a_readmission(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=4) as writer:
        writer.add_membership(record(10, [3, 0], 2, heal_s=0.04))
        writer.add_membership(readmit(30, [0], 3))
        writer.set_status("completed")
    print_summary(path, "completed")
    assert (
        "| 3 of 4 workers finished; rank 3 (node2) and rank 0 (node1) lost at step 10, healed in "
        "0.04 s; rank 0 re-admitted at step 30" in capsys.readouterr().out
    )


# ------------------------------------------------------------------- a stalled worker evicted


def test_a_stalled_worker_is_recorded_and_said_as_stalled(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=3) as writer:
        writer.add_membership(record(10, [3], 3, heal_s=2.13, stalled=[3], silent_s=2.11))
        writer.add_membership(record(20, [0, 1], 1, heal_s=0.04))
        writer.set_status("completed")
    changes = read_run(path).membership
    assert changes[0]["stalled"] == [3] and changes[0]["silent_s"] == 2.11
    assert "stalled" not in changes[1]  # a kill keeps the record it always had
    print_summary(path, "completed")
    line = capsys.readouterr().out
    assert (
        "| 1 of 4 workers finished; rank 3 (node2, stalled: silent 2.1 s) lost at step 10, "
        "healed in 2.1 s; rank 0 (node1) and rank 1 (node1) lost at step 20" in line
    )
    assert main(["show", str(path)]) == 0
    assert (
        "membership: step 10: lost rank 3 (node 1, host node2, stalled: silent 2.1 s); "
        "3 workers after; healed in 2.13 s" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"stalled": [2], "silent_s": 2.0}, r"'stalled' must be .* among 'lost' \[1\]"),
        ({"stalled": [], "silent_s": 2.0}, "'stalled' must be a non-empty list"),
        ({"stalled": [1, 1], "silent_s": 2.0}, "'stalled' must be"),
        ({"stalled": [1]}, "'silent_s' must be seconds >= 0, got None"),
        ({"silent_s": 2.0}, "'stalled' must be"),
        ({"stalled": [1], "silent_s": -1.0}, "'silent_s' must be seconds >= 0"),
        ({"stalled": [1], "silent_s": math.inf}, "'silent_s' must be seconds >= 0"),
    ],
)
def test_a_bad_stalled_record_names_the_problem(tmp_path: Path, bad: dict, match: str) -> None:
    with new_run(tmp_path / "run.h5", rows=1) as writer:
        with pytest.raises(ValueError, match=match):
            writer.add_membership({**record(10, [1], 3), **bad})
        assert writer.membership == []


def test_take_over_abandoned_gets_a_running_file_nobody_writes(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    new_run(path, rows=3).close()  # its writer's process is gone
    writer = RunWriter.take_over_abandoned(path)
    assert writer is not None and writer.is_open and writer.num_rows == 3  # rows untouched
    writer.set_status("failed", error="RuntimeError: the heal did not finish")
    writer.close()
    assert not writer.is_open
    run = read_run(path)
    assert run.status == "failed" and run.data["step"].tolist() == [0, 10, 20]
    assert RunWriter.take_over_abandoned(path) is None  # ended: nothing left to record


def test_take_over_abandoned_leaves_a_live_writer_and_an_ended_run_alone(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with new_run(path, rows=2):  # a live writer holds the lock
        assert RunWriter.take_over_abandoned(path) is None
    for status in ("completed", "diverged", "failed", "preempted"):
        ended = tmp_path / f"{status}.h5"
        with new_run(ended, rows=1) as writer:
            writer.set_status(status)
        assert RunWriter.take_over_abandoned(ended) is None, status
        assert read_run(ended).status == status
    assert RunWriter.take_over_abandoned(tmp_path / "none.h5") is None
    (tmp_path / "bad.h5").write_bytes(b"")
    assert RunWriter.take_over_abandoned(tmp_path / "bad.h5") is None


@pytest.mark.slow
def test_take_over_abandoned_goes_to_one_process_of_several(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process took the file over: this one is refused while it holds the lock (even past
    the first check), and finds the run ended once it released it."""
    import subprocess
    import sys

    from relaympi.results import writer as writer_module

    path = tmp_path / "run.h5"
    new_run(path, rows=2).close()
    script = (
        "import sys\n"
        "from relaympi.results import RunWriter\n"
        f"w = RunWriter.take_over_abandoned({str(path)!r})\n"
        "print('got' if w is not None else 'none', flush=True)\n"
        "sys.stdin.readline()\n"
        "w.set_status('failed', error='RuntimeError: ended')\n"
        "w.close()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline().strip() == "got"
        assert RunWriter.take_over_abandoned(path) is None
        with monkeypatch.context() as patch:  # as if this one had checked before the other opened
            patch.setattr(writer_module, "_locked_by_a_writer", lambda path: False)
            assert RunWriter.take_over_abandoned(path) is None
        other.stdin.write("\n")
        other.stdin.close()
        assert other.wait(timeout=60) == 0
    finally:
        other.kill()
    assert RunWriter.take_over_abandoned(path) is None
    run = read_run(path)
    assert run.status == "failed" and run.attrs["error"] == "RuntimeError: ended"
