"""Checkpoint directories belong to one run, --out replaces only run files, and a run stopped by
Ctrl-C, SIGTERM or a full disk ends recorded, readable and resumable."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from relaympi.results import read_run, run_status
from tests.conftest import ROOT, env_for_subprocess, mounted_tmpfs, requires_mpirun, train_command
from tests.conftest import run_train as train

# 4 workers, 60 steps, an evaluation (and a checkpoint) every 10
DIGITS = [
    "--task",
    "digits",
    "--backend",
    "local",
    "--workers",
    "4",
    "--algo",
    "relay",
    "--alpha",
    "0.01",
    "--steps",
    "60",
    "--eval-every",
    "10",
    "--seed",
    "2",
]


def stopped_at(step, how="TERM"):
    return {"RELAYMPI_INJECT_SIGNAL": f"{how}:{step}"}


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- a checkpoint directory belongs to one run ---------------------------------------------------
@pytest.mark.slow
def test_another_run_refuses_the_checkpoint_and_the_owner_resumes_without_a_gap(tmp_path):
    ck, a, a2 = tmp_path / "ck", tmp_path / "A.h5", tmp_path / "A2.h5"
    first = train([*DIGITS, "--checkpoint-dir", ck, "--out", a], env=stopped_at(20))
    assert first.returncode == 4, first.stderr[-3000:]
    meta = ck / "meta.json"
    before = meta.read_text()
    other = train([*DIGITS, "--checkpoint-dir", ck, "--out", a2])
    assert other.returncode == 2, other.stderr[-3000:]
    assert (
        str(a.resolve()) in other.stderr
        and "--overwrite" in other.stderr
        and "Traceback" not in other.stderr
    )
    assert not a2.exists() and meta.read_text() == before
    # another --alpha with the default --out (another run file) is refused the same way
    alpha = train(
        [
            *DIGITS[:-6],
            "--alpha",
            "0.1",
            *DIGITS[-4:],
            "--checkpoint-dir",
            ck,
            "--out",
            tmp_path / "B.h5",
        ]
    )
    assert alpha.returncode == 2 and str(a.resolve()) in alpha.stderr and meta.read_text() == before
    again = train([*DIGITS, "--checkpoint-dir", ck, "--out", a])
    assert again.returncode == 0, again.stderr[-3000:]
    run = read_run(a)
    assert run.status == "completed" and run.data["step"].tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert run.attrs["resumed_at_steps"] == [19]


@pytest.mark.slow
def test_overwrite_takes_the_checkpoint_over_and_then_the_old_owner_is_refused(tmp_path):
    ck, a, a2 = tmp_path / "ck", tmp_path / "A.h5", tmp_path / "A2.h5"
    assert train([*DIGITS, "--checkpoint-dir", ck, "--out", a], env=stopped_at(20)).returncode == 4
    taken = train([*DIGITS, "--checkpoint-dir", ck, "--out", a2, "--overwrite"])
    assert taken.returncode == 0 and read_run(a2).data["step"].tolist() == [
        0,
        10,
        20,
        30,
        40,
        50,
        60,
    ]
    old = train([*DIGITS, "--checkpoint-dir", ck, "--out", a])
    assert old.returncode == 2 and str(a2.resolve()) in old.stderr, old.stderr[-3000:]
    # untouched
    assert run_status(a) == "preempted" and read_run(a).data["step"].tolist() == [0, 10]


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_the_run_file_does_not_reach(tmp_path):
    ck, a = tmp_path / "ck", tmp_path / "A.h5"
    assert train([*DIGITS, "--checkpoint-dir", ck, "--out", a], env=stopped_at(20)).returncode == 4
    shutil.copy(a, tmp_path / "old.h5")  # the same run's file, from before it went on
    assert train([*DIGITS, "--checkpoint-dir", ck, "--out", a], env=stopped_at(45)).returncode == 4
    shutil.copy(tmp_path / "old.h5", a)  # rows end at step 10; the checkpoint is of step 45
    refused = train([*DIGITS, "--checkpoint-dir", ck, "--out", a])
    assert (
        refused.returncode == 2
        and "gap" in refused.stderr
        and "step 40 is missing" in refused.stderr
    ), refused.stderr[-3000:]
    assert read_run(a).data["step"].tolist() == [0, 10]


# -- --out replaces only run files ---------------------------------------------------------------
def _problem_file(path):
    from relaympi.tasks import quadratics

    quadratics.generate(4, quadratics.QuadraticsSpec(dim=3), seed=1).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["problem", "text", "text-h5", "checkpoint"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_out_never_replaces_a_file_that_is_not_a_run_file(tmp_path, kind, overwrite):
    if kind == "problem":
        target = _problem_file(tmp_path / "p.h5")
    elif kind in ("text", "text-h5"):
        target = tmp_path / ("notes.txt" if kind == "text" else "notes.h5")
        target.write_text("my notes\n")
    else:
        (tmp_path / "ckpt").mkdir()
        target = tmp_path / "ckpt" / "rank00000.step0000000900.pt"
        import torch

        torch.save({"x": torch.zeros(3)}, target)
    before = digest(target)
    proc = train(
        [*DIGITS[:-4], "--steps", 3, "--out", target, *(["--overwrite"] if overwrite else [])]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    # a name without .h5 is refused for that before its content is looked at
    why = "not a relaympi run file" if target.suffix == ".h5" else "must end in .h5"
    assert why in proc.stderr and "Traceback" not in proc.stderr
    assert digest(target) == before


@pytest.mark.slow
def test_an_empty_out_file_is_replaced_only_with_overwrite(tmp_path):
    target = tmp_path / "r.h5"
    target.write_bytes(b"")
    proc = train([*DIGITS[:-4], "--steps", 3, "--out", target])
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and target.stat().st_size == 0
    assert train([*DIGITS[:-4], "--steps", 3, "--out", target, "--overwrite"]).returncode == 0
    assert run_status(target) == "completed"


def test_run_writer_refuses_a_file_that_is_not_a_run_file(tmp_path):
    from relaympi.results import NotARunFileError, RunWriter

    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(NotARunFileError):
        RunWriter.create(target, config={}, provenance={}, world_size=1, overwrite=True)
    assert target.read_text() == "keep me"


# -- stopping: Ctrl-C and SIGTERM ----------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_without_a_checkpoint_dir_says_a_rerun_starts_over(tmp_path):
    proc = train([*DIGITS, "--out", tmp_path / "r.h5"], env=stopped_at(20))
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert (
        "stopped at step 20; no checkpoint (no --checkpoint-dir): a rerun starts over"
        in proc.stdout
    )
    run = read_run(tmp_path / "r.h5")
    assert (
        run.status == "preempted"
        and run.attrs["stopped_step"] == 20
        and run.attrs["checkpoint_saved"] is False
    )


@pytest.mark.slow
def test_sigint_checkpoints_like_sigterm_and_the_same_command_resumes(tmp_path):
    args = [*DIGITS, "--checkpoint-dir", tmp_path / "ck", "--out", tmp_path / "r.h5"]
    proc = train(args, env=stopped_at(30, "INT"))
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert "stopped at step 30; checkpoint saved in" in proc.stdout
    run = read_run(tmp_path / "r.h5")
    assert run.status == "preempted" and run.attrs["checkpoint_saved"] is True
    assert train(args).returncode == 0
    full = train([*DIGITS, "--out", tmp_path / "full.h5"])
    assert full.returncode == 0
    resumed, uninterrupted = read_run(tmp_path / "r.h5"), read_run(tmp_path / "full.h5")
    for key in ("step", "train_loss", "test_accuracy", "bytes_sent"):
        np.testing.assert_array_equal(resumed.data[key], uninterrupted.data[key], err_msg=key)


def _ctrl_c_at(command: list[str], progress: str) -> tuple[subprocess.Popen, str, str]:
    """Start ``command`` in its own process group, send the group SIGINT (Ctrl-C) once its stderr
    shows ``progress``; (process, stdout, stderr) once it ended."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env_for_subprocess(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    assert proc.stderr is not None
    for line in proc.stderr:
        if progress in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
        assert time.monotonic() < deadline
    out, err = proc.communicate(timeout=120)
    return proc, out, err


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_the_batched_run_with_a_checkpoint(tmp_path):
    args = [
        "--task",
        "digits",
        "--backend",
        "batched",
        "--workers",
        "4",
        "--algo",
        "relay",
        "--steps",
        "100000",
        "--eval-every",
        "10",
        "--log-every",
        "10",
        "--checkpoint-dir",
        tmp_path / "ck",
        "--out",
        tmp_path / "r.h5",
    ]
    proc, out, err = _ctrl_c_at(train_command(args), "step 20/")
    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err and "checkpoint saved in" in out
    run = read_run(tmp_path / "r.h5")
    assert run.status == "preempted" and (tmp_path / "ck" / "meta.json").exists()


@pytest.mark.slow
@requires_mpirun
def test_mpi_ctrl_c_checkpoints_on_every_rank(tmp_path):
    args = [
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        "100000",
        "--dim",
        "4",
        "--eval-every",
        "100",
        "--log-every",
        "100",
        "--checkpoint-dir",
        tmp_path / "ck",
        "--out",
        tmp_path / "r.h5",
    ]
    _, out, err = _ctrl_c_at(train_command(args, mpi=2), "step 200/")
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    run = read_run(tmp_path / "r.h5")
    assert run.status == "preempted" and run.attrs["checkpoint_saved"] is True
    step = run.attrs["stopped_step"]
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.pt")) == [
        f"rank{r:05d}.step{step:010d}.pt" for r in range(2)
    ]


# -- stopping: a full disk ------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root); a run file of 16 workers outgrows it within a few evaluations."""
    with mounted_tmpfs(tmp_path / "small") as mount:
        yield mount


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "batched"])
def test_a_full_disk_fails_the_run_with_one_line_and_a_readable_file(small_disk, backend):
    out = small_disk / "r.h5"
    proc = train(
        [
            "--task",
            "digits",
            "--backend",
            backend,
            "--workers",
            16,
            "--algo",
            "relay",
            "--steps",
            400,
            "--eval-every",
            5,
            "--out",
            out,
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith(
        "failed: no space left on device"
    )
    run = read_run(out)
    assert run.status == "failed" and "no space left on device" in run.attrs["error"]
    # whole rows, no gap
    assert run.data["step"].tolist() == [5 * k for k in range(len(run.data["step"]))]


@pytest.mark.slow
def test_a_full_disk_for_checkpoints_leaves_nothing_partial(small_disk, tmp_path):
    ck = small_disk / "ck"
    proc = train(
        [
            *DIGITS[:2],
            "--backend",
            "local",
            "--workers",
            16,
            "--algo",
            "relay",
            "--steps",
            20,
            "--eval-every",
            5,
            "--checkpoint-dir",
            ck,
            "--out",
            tmp_path / "r.h5",
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("failed: cannot write the checkpoint")
    import torch

    assert not list(ck.glob("*.tmp"))
    for path in ck.glob("*.pt"):  # what is there is whole
        torch.load(path, weights_only=True)
    if (ck / "meta.json").exists():  # an earlier checkpoint that fitted: complete on every rank
        step = json.loads((ck / "meta.json").read_text())["step"]
        assert all((ck / f"rank{r:05d}.step{step:010d}.pt").exists() for r in range(16))
    run = read_run(tmp_path / "r.h5")
    assert run.status == "failed" and "cannot write the checkpoint" in run.attrs["error"]


@pytest.mark.slow  # imports torch
def test_a_checkpoint_follows_no_link_planted_in_its_folder(tmp_path):
    """In a checkpoint folder others can write to, links planted at the temporary files' old
    fixed names (and at meta.json's) lead nowhere: the files they point to are untouched, the
    checkpoint and meta.json are written whole, owner-only (0600), and load back; prune removes
    the temporary file a killed write left."""
    import torch

    from relaympi.training import checkpoint_files

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ck = tmp_path / "ck"
    ck.mkdir()
    os.chmod(ck, 0o1777)  # a shared folder, as /tmp
    for name in ("rank00000.step0000000003.pt.tmp", "meta.json.tmp"):
        (ck / name).symlink_to(victim)
    checkpoint_files.save(ck, 0, 3, {"x": torch.arange(4)})
    checkpoint_files.write_meta(ck, {"step": 3})
    assert victim.read_text() == "precious"
    for name in ("rank00000.step0000000003.pt", "meta.json"):
        assert not (ck / name).is_symlink() and (ck / name).stat().st_mode & 0o777 == 0o600
    assert torch.equal(checkpoint_files.load(ck, 0, 3)["x"], torch.arange(4))
    assert checkpoint_files.read_meta(ck) == {"step": 3}
    left = sorted(p.name for p in ck.iterdir() if not p.is_symlink())
    assert left == ["meta.json", "rank00000.step0000000003.pt"]  # no temporary file left
    (ck / ".rank00000.step0000000004.pt.x1y2.tmp").write_bytes(b"half")  # a killed write's
    checkpoint_files.prune(ck, 0, 3)
    assert sorted(p.name for p in ck.iterdir() if not p.is_symlink()) == left
