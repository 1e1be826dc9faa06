"""A worker lost at every moment of a run (RELAYMPI_INJECT_FAILURE=RANK:STEP:PHASE) under Open MPI
with ULFM: the job ends soon after the loss, the run file says completed and records exactly the
lost ranks, and the survivors' numbers equal the in-process engine's with the same injection; a
heal or end agreement stuck for good ends its process with one line, and the run file says so."""

from __future__ import annotations

import json
import time
from datetime import datetime

import h5py
import pytest

from benchmarks.kill_loop import differences
from relaympi.results import read_run
from tests.conftest import PY, requires_mpirun, requires_ulfm, run_train, run_ulfm

STEPS = 12
QUAD = [
    *("--task", "quadratics", "--algo", "relay", "--steps", STEPS, "--eval-every", "2"),
    *("--record-params", "--on-failure", "continue"),
]
CHECKPOINTED = ["--checkpoint-every", "4"]  # with a --checkpoint-dir of the test's own

# (phase, injection): one loss at each phase of a step, of the run's end and of a heal
PHASES = [
    ("start", "2:5"),
    ("last-step", f"1:{STEPS}"),  # the run's last evaluation: this deadlocked the survivors
    ("gradient", "2:5:gradient"),
    ("exchange", "2:5:exchange"),
    ("agreement", "2:5:agreement"),
    ("evaluation", "2:6:evaluation"),
    ("checkpoint", "2:8:checkpoint"),
    ("flush", "0:6:flush"),  # the run file's writer: the lowest survivor takes the file over
    ("end", f"3:{STEPS}:end"),  # after the last step, before the end agreement
    ("heal", "1:5,2:5:heal"),  # a second loss inside the first one's heal
]


def _membership(path) -> list[tuple[int, list[int], int]]:
    with h5py.File(path) as f:
        records = json.loads(f.attrs["membership"])
    return [(r["step"], sorted(r["lost"]), r["world_size"]) for r in records]


def _started(path) -> float:
    with h5py.File(path) as f:
        text = f.attrs["start_time"]
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
@requires_ulfm
@pytest.mark.parametrize("phase, inject", PHASES, ids=[p[0] for p in PHASES])
def test_a_loss_at_every_phase_heals_and_equals_the_local_replay(tmp_path, phase, inject):
    env = {"RELAYMPI_INJECT_FAILURE": inject}
    extra = CHECKPOINTED if phase == "checkpoint" else []
    mpi_out, local_out = tmp_path / "mpi.h5", tmp_path / "local.h5"
    mpi_args = [*QUAD, *extra, "--out", mpi_out]
    if extra:
        mpi_args += ["--checkpoint-dir", tmp_path / "mpi-ckpt"]
    passed = ["-x", "RELAYMPI_INJECT_FAILURE", "-x", "PYTHONPATH"]
    proc = run_ulfm([*passed, PY, "-m", "relaympi.train", *mpi_args], 4, env=env, timeout=240)
    ended = time.time()
    output = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode != 124, output  # no hang
    # every loss happens after the run file opened: the job ended within 60 s of it
    assert ended - _started(mpi_out) < 60, output
    run = read_run(mpi_out)
    assert run.status == "completed", output
    lost = sorted(int(item.split(":")[0]) for item in inject.split(","))
    assert sorted(r for change in run.membership for r in change["lost"]) == lost
    assert f"{4 - len(lost)} of 4 workers finished" in proc.stdout
    local_args = [*QUAD, *extra, "--backend", "local", "--workers", 4, "--out", local_out]
    if extra:
        local_args += ["--checkpoint-dir", tmp_path / "local-ckpt"]
    run_train(local_args, env=env, check=0)
    assert _membership(mpi_out) == _membership(local_out)
    assert differences(mpi_out, local_out) == []


def _refused(cases: dict[str, str], args: list[str], tmp_path, capsys) -> None:
    """Each RELAYMPI_INJECT_FAILURE value of ``cases`` makes ``train`` with ``args`` exit as misuse
    with its message."""
    from relaympi import train

    for index, (inject, message) in enumerate(cases.items()):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RELAYMPI_INJECT_FAILURE", inject)
            status = train.main([*args, "--out", str(tmp_path / f"r{index}.h5")])
        assert status == train.EXIT_USAGE
        assert message in capsys.readouterr().err


def test_a_rank_named_at_a_phase_the_run_never_reaches_is_refused(tmp_path, capsys):
    from relaympi import train

    cases = {
        f"1:{STEPS - 1}:end": f"phase end needs STEP {STEPS}, the run's last step",
        "1:4:checkpoint": "no checkpoint is saved at step 4",
    }
    args = [*map(str, QUAD), "--backend", "local", "--workers", "4"]
    _refused(cases, args, tmp_path, capsys)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RELAYMPI_INJECT_FAILURE", "1:4:exchange")
        batched = [*args[: args.index("--backend")], "--backend", "batched", "--workers", "4"]
        status = train.main([*batched, "--out", str(tmp_path / "b.h5")])
    assert status == train.EXIT_USAGE
    assert "this engine loses workers only at a step's start" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0], ids=["rank1", "writer"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["failed", "preempted"])
def test_a_heal_stuck_for_good_ends_the_process_and_the_run_file_says_so(
    tmp_path, checkpoint, lost
):
    """A heal that never finishes (stalled on purpose) ends the process after
    RELAYMPI_HEAL_TIMEOUT with one line naming the phase; the run file says failed, or preempted
    where a checkpoint was saved (a rerun resumes it), never running: also where the lost worker
    was the run file's writer (rank 0), so that no survivor writes it."""
    out = tmp_path / "r.h5"
    env = {
        "RELAYMPI_INJECT_FAILURE": f"{lost}:6",
        "RELAYMPI_INJECT_STALL": "heal",
        "RELAYMPI_HEAL_TIMEOUT": "2",
    }
    args = [*QUAD, "--backend", "local", "--workers", 4, "--out", out]
    if checkpoint:
        args += [*CHECKPOINTED, "--checkpoint-dir", tmp_path / "ckpt"]
    started = time.monotonic()
    proc = run_train(args, env=env, check=4 if checkpoint else 1, timeout=120)
    assert time.monotonic() - started < 60
    lines = [line for line in proc.stderr.splitlines() if "did not finish" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "the heal did not finish within 2 s (RELAYMPI_HEAL_TIMEOUT)" in lines[0]
    run = read_run(out)
    assert run.status == ("preempted" if checkpoint else "failed")
    if checkpoint:
        assert run.attrs["stopped_step"] == 4 and run.attrs["checkpoint_saved"]


@pytest.mark.slow
@requires_ulfm
def test_a_stuck_heal_after_the_writer_was_killed_leaves_the_file_failed(tmp_path):
    """MPI: rank 0, the run file's writer, SIGKILLs itself and the survivors' heal stalls for good:
    each survivor ends after RELAYMPI_HEAL_TIMEOUT, and one of them, taking over the file nobody
    writes any more, marks it failed."""
    out = tmp_path / "r.h5"
    env = {
        "RELAYMPI_INJECT_FAILURE": "0:6",
        "RELAYMPI_INJECT_STALL": "heal",
        "RELAYMPI_HEAL_TIMEOUT": "2",
    }
    passed = [arg for name in env for arg in ("-x", name)] + ["-x", "PYTHONPATH"]
    args = [*passed, PY, "-m", "relaympi.train", *QUAD, "--out", out]
    proc = run_ulfm(args, 3, env=env, timeout=120)
    output = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, output
    assert proc.stderr.count("the heal did not finish within 2 s") == 2, output
    run = read_run(out)
    assert run.status == "failed", output
    assert run.attrs["error"] == "RuntimeError: the heal did not finish within 2 s " + (
        "(RELAYMPI_HEAL_TIMEOUT)"
    )
    assert run.data["step"].tolist() == [0, 2, 4]  # as the writer left it (lost at step 6)


@pytest.mark.slow
@requires_ulfm
def test_a_rank_that_fails_at_start_up_ends_the_job(tmp_path):
    """A rank whose start-up fails (as a failed MPI_Comm_dup would) ends the whole job with exit
    status 1 instead of leaving the others waiting for it in a start-up collective (and itself in
    MPI_Finalize); no run file is left running."""
    out = tmp_path / "r.h5"
    env = {"RELAYMPI_INJECT_FAILURE": "1:0:startup"}
    args = ["-x", "RELAYMPI_INJECT_FAILURE", "-x", "PYTHONPATH", PY, "-m", "relaympi.train"]
    started = time.monotonic()
    proc = run_ulfm([*args, *QUAD, "--out", out], 3, env=env, timeout=120)
    output = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, output  # 124: the job hung
    assert time.monotonic() - started < 60, output
    line = "failed: rank 1: RuntimeError: injected failure on rank 1 at start-up"
    assert proc.stderr.count(line) == 1, output
    assert not out.exists() or read_run(out).status != "running"


@pytest.mark.slow
@requires_mpirun
def test_a_rank_that_fails_at_start_up_ends_the_job_under_the_default_mpi(tmp_path):
    """The same under the default MPI (MPICH), without --on-failure continue."""
    out = tmp_path / "r.h5"
    env = {"RELAYMPI_INJECT_FAILURE": "1:0:startup"}
    proc = run_train([*QUAD[:-2], "--out", out], mpi=2, env=env, timeout=120, check=1)
    line = "failed: rank 1: RuntimeError: injected failure on rank 1 at start-up"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # one line, and no second report of it
    assert not out.exists()


def test_a_start_up_failure_is_refused_off_mpi_and_past_step_0(tmp_path, capsys):

    args = [*map(str, QUAD), "--backend", "local", "--workers", "4"]
    cases = {
        "1:3:startup": "phase startup takes STEP 0 (it fails before any step)",
        "1:0:startup": "only MPI ranks (--backend mpi) fail at start-up",
    }
    _refused(cases, args, tmp_path, capsys)


@pytest.mark.slow
def test_survivors_that_cannot_go_on_record_the_failure_where_the_writer_was_lost(tmp_path):
    """Ranks 0, 1 and 2 (each the run file's writer in turn) lost: the last survivor cannot
    rebuild the topology, and records that in the file the lost writer left running."""
    out = tmp_path / "r.h5"
    env = {"RELAYMPI_INJECT_FAILURE": "0:3,1:4,2:5"}
    args = [*QUAD, "--backend", "local", "--workers", 4, "--out", out]
    proc = run_train(args, env=env, check=1, timeout=120)
    run = read_run(out)
    assert run.status == "failed", proc.stderr[-3000:]
    assert "cannot be built again over the 1 surviving workers" in run.attrs["error"]
    assert run.data["step"].tolist() == [0, 2, 4]  # the rows of the steps before the failure
    assert [r for change in run.membership for r in change["lost"]] == [0, 1]


def test_a_bad_heal_timeout_is_refused_in_one_line(tmp_path):
    proc = run_train(
        [*QUAD, "--backend", "local", "--workers", 2, "--out", tmp_path / "r.h5"],
        env={"RELAYMPI_HEAL_TIMEOUT": "soon"},
        check=2,
    )
    assert "RELAYMPI_HEAL_TIMEOUT='soon'; expected seconds > 0" in proc.stderr
