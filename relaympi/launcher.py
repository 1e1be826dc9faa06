"""What the launcher (mpirun, mpiexec, srun) tells a process through its environment, read in one
place.

Torch-free and MPI-free: it is read before MPI starts, so that a usage error is printed by rank 0
alone and a `--backend local` run can tell it was started as one of several ranks. MPICH (Hydra)
announces PMI_*, Open MPI OMPI_COMM_WORLD_* (and PMIx PMIX_*), Intel MPI PMI_* and MPI_LOCAL*, srun
SLURM_*. A SLURM batch script's own environment already holds SLURM_NTASKS (the job's task count,
not this process's world) and SLURM_PROCID/SLURM_LOCALID 0: only PMI/PMIx/Open MPI variables say
that a launcher started this very process, and SLURM_NTASKS is never read as a world size.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

# the first variable holding a number wins, in this order
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
# MPI_LOCALNRANKS (node-local ranks, Hydra) last: more than one there means more than one rank
# in all
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE")
# set only in a process an MPI launcher started (even as its only rank); not in a batch script
LAUNCHED_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
NODE_VARIABLES = ("SLURMD_NODENAME",)


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, as the launcher announced it (plain `python`: rank 0 of
    1)."""

    launched: bool  # an MPI launcher started this process (mpirun -n 1 included)
    rank: int  # world rank (0 when none is announced)
    size: int  # world size (1 when none above 1 is announced)
    local_rank: int | None  # rank among this node's processes (None: not announced)
    local_size: int | None  # processes on this node (None: not announced)
    node: str  # the node's name (SLURM's, else the host name)


def _number(env: Mapping[str, str], variables: tuple[str, ...], above: int = -1) -> int | None:
    """The first of ``variables`` holding a whole number greater than ``above``, or None."""
    for var in variables:
        value = env.get(var, "").strip()
        if value.isdigit() and int(value) > above:
            return int(value)
    return None


def launch(env: Mapping[str, str] | None = None) -> Launch:
    """Read the launcher's variables from ``env`` (default: this process's environment)."""
    env = os.environ if env is None else env
    rank = _number(env, RANK_VARIABLES)
    size = _number(env, SIZE_VARIABLES, above=1)
    node = next((env[var] for var in NODE_VARIABLES if env.get(var)), None) or platform.node()
    return Launch(
        launched=any(var in env for var in LAUNCHED_VARIABLES),
        rank=0 if rank is None else rank,
        size=1 if size is None else size,
        local_rank=_number(env, LOCAL_RANK_VARIABLES),
        local_size=_number(env, LOCAL_SIZE_VARIABLES, above=0),
        node=node,
    )


# a diagnostic switch of the overlapped step on GPUs, read here only
ALLOW_CUDA_OVERLAP_ENV = "RELAYMPI_ALLOW_CUDA_OVERLAP"


def cuda_overlap_mode() -> str | None:
    """The diagnostic switch that lifts the refusal of ``--device cuda --overlap`` (a run with it
    hung on a GPU): None (unset, empty or 0: refused), "owner" (1: the hooks on autograd's CUDA
    thread leave the delivery to the thread running the step) or "hooks" (they deliver themselves,
    as when the run hung). Read here only."""
    value = os.environ.get(ALLOW_CUDA_OVERLAP_ENV, "").strip().lower()
    modes = {"": None, "0": None, "1": "owner", "hooks": "hooks"}
    if value not in modes:
        raise ValueError(f"{ALLOW_CUDA_OVERLAP_ENV}={value!r}: expected 1, hooks or 0")
    return modes[value]
