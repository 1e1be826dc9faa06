"""--peer-timeout's parts that need no MPI: the failure detector's settings, their refusal once MPI
started, and telling a stalled process (still there) from a killed one (gone or a zombie)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from relaympi.comm.stalls import (
    PERIODS_PER_TIMEOUT,
    detector_environment,
    enable_detector,
    process_present,
)


@pytest.mark.parametrize("seconds", [0.5, 2.0, 10.0, 600.0])
def test_the_detector_declares_after_the_timeout_with_a_period_open_mpi_accepts(seconds) -> None:
    env = detector_environment(seconds)
    timeout = float(env["OMPI_MCA_mpi_ft_detector_timeout"])
    period = float(env["OMPI_MCA_mpi_ft_detector_period"])
    assert timeout == seconds and period == seconds / PERIODS_PER_TIMEOUT
    assert timeout > 3 * period  # Open MPI refuses a timeout of three periods or less
    assert env["OMPI_MCA_mpi_ft_detector"] == env["OMPI_MCA_mpi_ft_detector_thread"] == "true"
    assert "6" not in env["OMPI_MCA_opal_signal"].split(",")  # SIGABRT: no stack trace


def test_enable_detector_sets_the_environment_before_mpi_and_refuses_after(monkeypatch) -> None:
    for name in detector_environment(1.0):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    enable_detector(4.0)
    assert os.environ["OMPI_MCA_mpi_ft_detector_timeout"] == "4"
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    with pytest.raises(RuntimeError, match="MPI started before"):
        enable_detector(4.0)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[-1].split()[0]


def _until(pid: int, state: str) -> None:
    for _ in range(400):
        if _state(pid) == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {state}")


def test_a_stopped_process_is_present_a_zombie_or_reaped_one_is_not() -> None:
    assert process_present(os.getpid())
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        _until(child.pid, "T")
        assert process_present(child.pid)  # stalled: still there
        child.kill()
        _until(child.pid, "Z")  # dead, not reaped yet
        assert not process_present(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not process_present(child.pid)  # reaped: gone
