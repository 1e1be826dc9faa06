"""The algorithms by name: look-up, the combination check, construction for one worker."""

from __future__ import annotations

import torch

from relaympi.algorithms.allreduce import AllReduce
from relaympi.algorithms.base import Algorithm, AlgorithmError, AlgorithmOptions
from relaympi.algorithms.d2 import D2
from relaympi.algorithms.dpsgd import DPSGD
from relaympi.algorithms.gt import GradientTracking
from relaympi.algorithms.qgm import QuasiGlobalMomentum
from relaympi.algorithms.relay import RelaySGD, RelaySGDGrad
from relaympi.algorithms.sgp import SGP
from relaympi.comm import Communicator
from relaympi.optim import LocalOptimizer, OptimizerConfig
from relaympi.topology import Topology

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (AllReduce, DPSGD, QuasiGlobalMomentum, D2, GradientTracking, SGP, RelaySGD, RelaySGDGrad)
}
ALGORITHM_NAMES = tuple(ALGORITHMS)


def default_topology(algo: str) -> str:
    return get_algorithm_class(algo).default_topology


def get_algorithm_class(algo: str) -> type[Algorithm]:
    if algo not in ALGORITHMS:
        raise AlgorithmError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[algo]


def check_combination(algo: str, topology: Topology, optimizer: OptimizerConfig, options: AlgorithmOptions) -> None:
    """Raise AlgorithmError unless ``algo`` runs on ``topology`` with this optimizer and options."""
    get_algorithm_class(algo).check(topology, optimizer, options)


def check_topology_fits_world(topology: Topology, world_size: int) -> None:
    """Raise AlgorithmError unless ``topology`` is for ``world_size`` workers."""
    if topology.world_size != world_size:
        raise AlgorithmError(f"topology {topology.name!r} is for {topology.world_size} workers, the world has {world_size}")


def make_algorithm(
    algo: str, comm: Communicator, topology: Topology, optimizer: LocalOptimizer, x0: torch.Tensor, options: AlgorithmOptions | None = None
) -> Algorithm:
    """Build algorithm ``algo`` for this worker; refuses invalid combinations with a clear error."""
    cls = get_algorithm_class(algo)
    check_topology_fits_world(topology, comm.world_size)
    return cls(comm, topology, optimizer, x0, options or AlgorithmOptions())
