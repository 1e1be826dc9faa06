"""Communication: the Communicator interface and its MPI and in-process backends."""

from collections.abc import Sequence

from relaympi.comm.base import (
    CommError,
    Communicator,
    DropPolicy,
    PeerLost,
    RemoteFailure,
    Request,
    Vanished,
)
from relaympi.comm.buffers import BufferError, query_cuda_aware_mpi
from relaympi.comm.local import LocalCommunicator, LocalWorld, WorldAborted, run_local


def mpi_communicator(
    drops: DropPolicy | None = None,
    cuda_aware: bool | None = None,
    nodes: Sequence[int] | None = None,
    deadline: float | None = None,
) -> Communicator:
    """The MPI backend over COMM_WORLD (imports mpi4py only when called).

    Args:
        drops: simulated message loss; None drops nothing.
        cuda_aware: whether MPI takes device buffers directly; None asks the MPI library
            (``query_cuda_aware_mpi``). Without it, device memory is staged through pinned host
            buffers.
        nodes: each rank's node to emulate, numbered 0, 1, ... in the order of each node's
            lowest rank; None: the nodes MPI placed the ranks on.
        deadline: seconds a receive waits once its exchange is waited for before its message
            counts as dropped (``--message-deadline``); None: receives wait for their message.

    Returns:
        This rank's Communicator (an ``MPICommunicator``).

    Raises:
        ImportError: mpi4py is not installed.
        ValueError: ``nodes`` does not give one well-numbered node id per rank.

    Example:
        Under ``mpirun -n 4 python script.py``:

        ```python
        comm = mpi_communicator()
        x = np.full(3, float(comm.rank))
        comm.allreduce_mean(x)  # every rank now holds [1.5, 1.5, 1.5]
        ```
    """
    from relaympi.comm.mpi import MPICommunicator

    comm = MPICommunicator(drops=drops, cuda_aware=cuda_aware, nodes=nodes)
    comm.deadline = deadline
    return comm


__all__ = [
    "BufferError",
    "CommError",
    "Communicator",
    "DropPolicy",
    "LocalCommunicator",
    "LocalWorld",
    "PeerLost",
    "RemoteFailure",
    "Request",
    "Vanished",
    "WorldAborted",
    "mpi_communicator",
    "query_cuda_aware_mpi",
    "run_local",
]
