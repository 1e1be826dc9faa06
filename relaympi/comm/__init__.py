"""Communication: the Communicator interface and its MPI and in-process backends."""

from collections.abc import Sequence

from relaympi.comm.base import CommError, Communicator, DropPolicy, RemoteFailure, Request
from relaympi.comm.buffers import BufferError, query_cuda_aware_mpi
from relaympi.comm.local import LocalCommunicator, LocalWorld, WorldAborted, run_local


def mpi_communicator(
    drops: DropPolicy | None = None,
    cuda_aware: bool | None = None,
    nodes: Sequence[int] | None = None,
) -> Communicator:
    """The MPI backend over COMM_WORLD (imports mpi4py only when called); ``nodes``: each rank's
    node
    to emulate (None: the nodes MPI placed the ranks on)."""
    from relaympi.comm.mpi import MPICommunicator

    return MPICommunicator(drops=drops, cuda_aware=cuda_aware, nodes=nodes)


__all__ = [
    "BufferError",
    "CommError",
    "Communicator",
    "DropPolicy",
    "LocalCommunicator",
    "LocalWorld",
    "RemoteFailure",
    "Request",
    "WorldAborted",
    "mpi_communicator",
    "query_cuda_aware_mpi",
    "run_local",
]
