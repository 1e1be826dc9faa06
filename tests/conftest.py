"""Shared fixtures: `spmd` runs one test body on every backend's ranks."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from relaympi.results import Run

ROOT = Path(__file__).resolve().parent.parent
LOCAL_WORLD = 4


def _with_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("with_mpi", default=False))


@pytest.fixture(scope="session")
def mpi_comm(request):
    from relaympi.comm import mpi_communicator

    return mpi_communicator()


@pytest.fixture
def spmd(request):
    """Run ``body(comm, *args)`` as an SPMD program and return this process's results.

    Plain pytest: on LOCAL_WORLD in-process ranks (returns every rank's result). Under
    ``mpirun -n K python -m pytest --with-mpi -m spmd``: on this MPI rank (returns [result]).
    Test bodies must work for any world size >= 2.
    """
    if _with_mpi(request.config):
        comm = request.getfixturevalue("mpi_comm")

        def run(body, *args, drops=None, world_size=None):
            if drops is not None:
                comm.drops = drops
            try:
                return [body(comm, *args)]
            finally:
                from relaympi.comm import DropPolicy

                comm.drops = DropPolicy()

        return run
    from relaympi.comm import run_local

    def run_in_process(body, *args, drops=None, world_size=LOCAL_WORLD):
        return run_local(world_size, body, *args, drops=drops)

    return run_in_process


def mpirun_path() -> str | None:
    exe = Path(sys.executable).parent / "mpirun"
    return str(exe) if exe.exists() else shutil.which("mpirun")


def matched(pattern: str, text: str, flags: int = 0) -> re.Match[str]:
    """``re.search``'s match, which the test requires (it fails naming the pattern if absent)."""
    match = re.search(pattern, text, flags)
    assert match is not None, f"{pattern!r} not found in {text[-2000:]!r}"
    return match


def mpirun() -> str:
    """mpirun's path, in a test that requires it (``requires_mpirun``)."""
    path = mpirun_path()
    assert path is not None, "no mpirun: mark the test @requires_mpirun"
    return path


_NO_MPIRUN = pytest.mark.skipif(
    mpirun_path() is None, reason="no mpirun on PATH (pip install mpich, or load your MPI module)"
)


def requires_mpirun(test):
    """Decorates a test that launches mpirun: marker ``mpirun``, skipped where there is none."""
    return pytest.mark.mpirun(_NO_MPIRUN(test))


def env_for_subprocess() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# -- launching `python -m ...` as the tests do -----------------------------------------------------
PY = sys.executable  # the interpreter running the tests: its environment has the packages


def module_command(module: str, *args, mpi: int | None = None) -> list[str]:
    """``python -m module args`` (arguments str()-ed), under ``mpirun -n mpi`` when mpi is given."""
    command = [PY, "-m", module, *map(str, args)]
    return [mpirun(), "-n", str(mpi), *command] if mpi else command


def train_command(args, *, mpi: int | None = None) -> list[str]:
    """``python -m relaympi.train args``, under ``mpirun -n mpi`` when mpi is given."""
    return module_command("relaympi.train", *args, mpi=mpi)


def run_module(
    module: str,
    *args,
    mpi: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` (see module_command) from the repository root with
    env_for_subprocess() updated by ``env``, capturing text output; with ``check``, assert that it
    exits with that status (the message shows stdout and the end of stderr)."""
    env = {**env_for_subprocess(), **(env or {})}
    proc = subprocess.run(
        module_command(module, *args, mpi=mpi),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check is not None:
        tail = proc.stderr[-4000:]
        assert proc.returncode == check, f"exit {proc.returncode}\n{proc.stdout}\n{tail}"
    return proc


def run_train(args, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python -m relaympi.train args``; keywords as run_module's: mpi, env, timeout, check."""
    return run_module("relaympi.train", *args, **kwargs)


def replay_bit_for_bit(recorded: Run, args: Sequence[object], *, workers: int, out: Path) -> Run:
    """Replay the MPI run ``recorded`` on ``--backend local`` with ``--replay-drops`` and require
    every dataset of the two run files but the timers (``time_*``), the late drops and the skipped
    steps to be equal bit for bit.

    Args:
        recorded: the MPI run, read (its ``path`` is what ``--replay-drops`` reads).
        args: ``python -m relaympi.train``'s arguments for the replay, as the MPI run had them
            (without ``--backend``, ``--workers``, ``--replay-drops`` or ``--out``).
        workers: the MPI run's world size.
        out: the replay's run file.

    Returns:
        The replay's run, for the test's own further checks.
    """
    from relaympi.results import read_run

    run_train(
        [*args, "--backend", "local", "--workers", workers]
        + ["--replay-drops", recorded.path, "--out", out],
        check=0,
    )
    replayed = read_run(out)
    assert set(replayed.data) == set(recorded.data), sorted(set(replayed.data) ^ set(recorded.data))
    for name in sorted(name for name in recorded.data if not name.startswith("time_")):
        np.testing.assert_array_equal(replayed.data[name], recorded.data[name], err_msg=name)
    np.testing.assert_array_equal(replayed.late_drops, recorded.late_drops)
    np.testing.assert_array_equal(replayed.skipped_steps, recorded.skipped_steps)
    return replayed


# -- Open MPI with ULFM (scripts/mpirun-ulfm) ----------------------------------------------------
ULFM_MPIRUN = ROOT / "scripts" / "mpirun-ulfm"  # Open MPI's mpirun with --with-ft ulfm


@functools.cache
def ulfm_missing() -> str | None:
    """None where scripts/mpirun-ulfm finds its Open MPI, else its one-line reason."""
    proc = subprocess.run([str(ULFM_MPIRUN), "--check"], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or proc.stdout.strip())


def requires_ulfm(test):
    """Decorates a test that runs under scripts/mpirun-ulfm: markers ``ulfm`` and ``mpirun`` (so
    the fast loop leaves it out), skipped with the launcher's reason where there is no Open MPI."""
    reason = ulfm_missing()
    skip = pytest.mark.skipif(reason is not None, reason=f"no Open MPI with ULFM: {reason}")
    return pytest.mark.ulfm(pytest.mark.mpirun(skip(test)))


def run_ulfm(
    argv, n: int = 4, *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``scripts/mpirun-ulfm -n n argv`` from the repository root with env_for_subprocess()
    updated by ``env``, capturing text output.

    mpirun's own exit status is no verdict on a run that lost a rank on purpose: judge the output.
    Past ``timeout`` seconds the whole process group is killed and what it had printed comes back
    with returncode 124 (as timeout(1) gives), so that a test can say where it stopped.
    """
    env = {**env_for_subprocess(), **(env or {})}
    command = [str(ULFM_MPIRUN), "-n", str(n), *map(str, argv)]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        returncode = 124
    return subprocess.CompletedProcess(command, returncode, out, err)


def run_train_ulfm(args, n: int = 4, **kwargs) -> subprocess.CompletedProcess:
    """``python -m relaympi.train args`` under scripts/mpirun-ulfm; keywords as run_ulfm's."""
    return run_ulfm([PY, "-m", "relaympi.train", *args], n, **kwargs)


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str = "1m"):
    """A tmpfs of ``size`` at ``mount`` (made here) for the block, unmounted after it; skips the
    test
    where it cannot be mounted (needs root)."""
    mount.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)
