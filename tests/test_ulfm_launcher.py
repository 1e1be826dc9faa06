"""scripts/mpirun-ulfm around Open MPI's mpirun: a SIGTERM to it preempts the run as the trainer's
exit statuses say (exit 4, the summary line, the same command resumes), and Open MPI's line per
survivor of a heal ("NBC_Progress: an error 75 ...") does not reach the user."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import h5py
import pytest

from relaympi.results import read_run
from tests.conftest import PY, ROOT, ULFM_MPIRUN, env_for_subprocess, requires_ulfm, run_ulfm

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


def _rows(path: Path) -> int:
    """The rows the writer has flushed so far (0 while the file cannot be read yet)."""
    try:
        with h5py.File(path, "r", locking=False) as file:
            return len(file["step"]) if "step" in file else 0
    except (OSError, KeyError):
        return 0


@requires_ulfm
def test_sigterm_to_the_launcher_preempts_and_the_same_command_resumes(tmp_path: Path) -> None:
    out, checkpoints = tmp_path / "run.h5", tmp_path / "ckpt"
    train = [PY, "-m", "relaympi.train", "--task", "digits", "--steps", "300"]
    train += ["--eval-every", "10", "--on-failure", "continue"]
    train += ["--checkpoint-dir", str(checkpoints), "--out", str(out)]
    command = [str(ULFM_MPIRUN), "-n", "4", "-x", "PYTHONPATH", *train]
    launcher = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env_for_subprocess(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal goes to the launcher's pid alone, not a group
    )
    output: dict[str, str] = {}
    reader = threading.Thread(
        target=lambda: output.update(zip(("out", "err"), launcher.communicate(), strict=True))
    )
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while _rows(out) < 3 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert launcher.poll() is None, "the run ended before it could be stopped"
        assert _rows(out) >= 3, "no rows within 240 s"
        launcher.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert not reader.is_alive(), "the launcher did not end within 120 s of SIGTERM"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        reader.join()
    assert launcher.returncode == 4, output.get("err", "")[-3000:]
    summary = output["out"].strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith(f"preempted: {out} | stopped at step ")
    assert f"checkpoint saved in {checkpoints}: run the same command again to resume" in summary[0]
    stopped = read_run(out)
    assert stopped.status == "preempted" and stopped.attrs["checkpoint_saved"]

    again = run_ulfm(["-x", "PYTHONPATH", *train], 4, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(f"completed: {out} |"), again.stdout
    resumed = read_run(out)
    assert resumed.status == "completed" and len(resumed.attrs["resumed_at_steps"]) == 1
    assert list(resumed.data["step"][-1:]) == [300]


def _mpirun_arguments(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """The arguments scripts/mpirun-ulfm gives mpirun (a stand-in that prints them) for ``args``."""
    prefix = tmp_path / "openmpi"
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    (prefix / "lib").mkdir(exist_ok=True)
    (prefix / "lib" / "libmpi.so.40").touch()
    stand_in = prefix / "bin" / "mpirun"
    stand_in.write_text('#!/bin/sh\necho "$*"\n')
    stand_in.chmod(0o755)
    scheduler = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PBS_NODEFILE", "PE_HOSTFILE", "LSB_HOSTS")
    clean = {k: v for k, v in env_for_subprocess().items() if k not in scheduler}
    proc = subprocess.run(
        [str(ULFM_MPIRUN), *args],
        env={**clean, "RELAYMPI_OPENMPI": str(prefix), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_on_one_node_mpis_tcp_is_pinned_to_loopback_and_a_host_list_is_left_alone(
    tmp_path: Path,
) -> None:
    loopback = "--mca btl_tcp_if_include lo "
    assert loopback in _mpirun_arguments(tmp_path, ["-n", "4", "true"])
    assert loopback in _mpirun_arguments(
        tmp_path, ["-n", "4", "true"], {"SLURM_JOB_NUM_NODES": "1"}
    )
    several = [
        (["--hostfile", "hosts", "-n", "4", "true"], None),
        (["--host=a,b", "-n", "4", "true"], None),
        (["-H", "a:2,b:2", "-n", "4", "true"], None),
        (["--machinefile", "hosts", "-n", "4", "true"], None),
        (["--mca", "btl_tcp_if_exclude", "docker0", "-n", "4", "true"], None),
        (["-n", "4", "true"], {"SLURM_JOB_NUM_NODES": "4"}),
        (["-n", "4", "true"], {"PBS_NODEFILE": "/var/spool/nodes"}),
    ]
    for args, env in several:
        assert "btl_tcp_if_include" not in _mpirun_arguments(tmp_path, args, env), (args, env)
    pinned = _mpirun_arguments(tmp_path, ["--iface", "rmpi7", "-n", "4", "true"])
    assert "--mca btl_tcp_if_include rmpi7 --mca oob_tcp_if_include rmpi7 " in pinned
    assert "btl_tcp_if_include lo" not in pinned
