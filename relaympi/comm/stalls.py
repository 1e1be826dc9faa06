"""``--peer-timeout``: a stalled rank evicted as a lost one (docs/membership.md#a-stalled-worker).

ULFM sees a process that died, not one that stopped: a SIGSTOPped rank is alive for MPI, so every
survivor waits for it forever. Open MPI's heartbeat failure detector closes that gap: each process
sends a heartbeat from a thread of its own every period to the process that observes it, and an
observer that hears nothing for the timeout declares the process failed, on every host. From then
on the survivors see exactly what a dead process shows them (an MPI error, a shrink that leaves it
out), so the heal is the loss's. A live process keeps beating while it computes (the detector's
thread), so only a frozen process is evicted, however slow its steps. A declared process that
resumes aborts itself at its next MPI call with Open MPI's one line (``ompi_proc_mark_as_failed: I
have been reported dead by someone else ...``) before it sends or writes anything more.

This module is torch- and mpi4py-free: the detector is switched on through Open MPI's MCA
variables in the environment, which MPI_Init reads, so ``enable_detector`` runs before mpi4py is
imported.
"""

from __future__ import annotations

import os
import sys

# the detector needs its timeout above three periods (Open MPI refuses less): four heartbeats per
# timeout, so a stalled process is declared between 3/4 of the timeout and the timeout after its
# last heartbeat
PERIODS_PER_TIMEOUT = 4
# Open MPI's signals that print a stack trace: its default less SIGABRT, so that an evicted
# process that resumes ends with the detector's one line (it aborts) and no trace
SIGNALS_TRACED = "7,8,11"


def detector_environment(seconds: float) -> dict[str, str]:
    """The MCA variables that declare a process failed after ``seconds`` without a heartbeat.

    Args:
        seconds: the peer timeout (> 0).

    Returns:
        Environment variables for Open MPI's MPI_Init.
    """
    return {
        "OMPI_MCA_mpi_ft_detector": "true",
        "OMPI_MCA_mpi_ft_detector_thread": "true",
        "OMPI_MCA_mpi_ft_detector_timeout": f"{seconds:g}",
        "OMPI_MCA_mpi_ft_detector_period": f"{seconds / PERIODS_PER_TIMEOUT:g}",
        "OMPI_MCA_opal_signal": SIGNALS_TRACED,
    }


def enable_detector(seconds: float) -> None:
    """Switch the failure detector on for this process's MPI (before MPI_Init).

    Args:
        seconds: the peer timeout (> 0).

    Raises:
        RuntimeError: mpi4py's MPI is loaded already (MPI_Init has read its variables).
    """
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("--peer-timeout: MPI started before its failure detector was set up")
    os.environ.update(detector_environment(seconds))


def process_present(pid: int) -> bool:
    """Whether process ``pid`` of this host still exists and has not ended (not a zombie): a lost
    rank's process that is still there was evicted for silence, not killed."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            stat = file.read()
    except OSError:
        return False
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses
    state = stat.rsplit(")", 1)[-1].split()
    return bool(state) and state[0] not in ("Z", "X")
