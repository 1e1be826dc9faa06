"""The algorithms by name: look-up, their options, the combination check, building one worker's.

Torch-free until an algorithm is used: the table names each class as "module:Class" (imported on
first look-up) beside its options (relaympi.algorithms.options), which the run's configuration
reads without torch. A new algorithm is its module and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, make_dataclass
from typing import TYPE_CHECKING, Any

from relaympi.algorithms.options import (
    AlgorithmError,
    D2Options,
    NoOptions,
    Options,
    RelaySGDOptions,
    RelaySumOptions,
)
from relaympi.registry import Registry

if TYPE_CHECKING:
    import torch

    from relaympi.algorithms.base import Algorithm
    from relaympi.comm import Communicator
    from relaympi.optim import LocalOptimizer, OptimizerConfig
    from relaympi.topology import Topology

# name -> (the class, its options), in the command line's order
_DECLARED: dict[str, tuple[str, type[Options]]] = {
    "allreduce": ("relaympi.algorithms.allreduce:AllReduce", NoOptions),
    "dpsgd": ("relaympi.algorithms.dpsgd:DPSGD", NoOptions),
    "qgm": ("relaympi.algorithms.qgm:QuasiGlobalMomentum", NoOptions),
    "d2": ("relaympi.algorithms.d2:D2", D2Options),
    "gt": ("relaympi.algorithms.gt:GradientTracking", NoOptions),
    "sgp": ("relaympi.algorithms.sgp:SGP", NoOptions),
    "relay": ("relaympi.algorithms.relay:RelaySGD", RelaySGDOptions),
    "relay-grad": ("relaympi.algorithms.relay:RelaySGDGrad", RelaySumOptions),
}

ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm", {name: cls for name, (cls, _) in _DECLARED.items()}, error=AlgorithmError
)
# each algorithm's options class (torch-free)
ALGORITHM_OPTIONS: Registry[type[Options]] = Registry(
    "algorithm", {name: options for name, (_, options) in _DECLARED.items()}, error=AlgorithmError
)
ALGORITHM_NAMES = ALGORITHMS.names


def _every_option() -> type[Options]:
    kinds = list(dict.fromkeys(ALGORITHM_OPTIONS.values()))
    leaves = tuple(
        k for k in kinds if fields(k) and not any(o is not k and issubclass(o, k) for o in kinds)
    )
    return make_dataclass(
        "AlgorithmOptions",
        [],
        bases=leaves,
        frozen=True,
        namespace={
            "__doc__": "Every algorithm's options in one (their classes' fields together), for a "
            "caller that builds algorithms chosen by name (tests, benchmarks): each "
            "algorithm takes "
            "its own.",
            "__module__": __name__,
        },
    )


AlgorithmOptions: Any = _every_option()


def algorithm_options(algo: str, options: Options | Mapping[str, Any] | None = None) -> Options:
    """``algo``'s own options from ``options``.

    Args:
        algo: one of ALGORITHM_NAMES.
        options: any options object, or a run's settings (the fields of its options' names);
            None: its defaults.

    Returns:
        An instance of ``algo``'s options class (``ALGORITHM_OPTIONS[algo]``).

    Raises:
        AlgorithmError: an unknown algorithm.
        ValueError: an option's value is out of range.
    """
    kind = ALGORITHM_OPTIONS[algo]
    if type(options) is kind:
        return options
    return kind.of(options if options is not None else {})


def default_topology(algo: str) -> str:
    """The paper's topology for ``algo`` (e.g. "double-binary-trees" for relay).

    Args:
        algo: one of ALGORITHM_NAMES.

    Returns:
        A topology name, as ``relaympi.topology.build`` takes it.

    Raises:
        AlgorithmError: an unknown algorithm.
    """
    return get_algorithm_class(algo).default_topology


def get_algorithm_class(algo: str) -> type[Algorithm]:
    """The Algorithm subclass called ``algo`` (its module is imported on first use).

    Args:
        algo: one of ALGORITHM_NAMES.

    Returns:
        The class, not an instance.

    Raises:
        AlgorithmError: an unknown algorithm; the message lists the known ones.
    """
    return ALGORITHMS[algo]


def check_combination(
    algo: str,
    topology: Topology,
    optimizer: OptimizerConfig,
    options: Options | Mapping[str, Any] | None = None,
) -> None:
    """Raise AlgorithmError unless ``algo`` runs on ``topology`` with this optimizer and options.

    Args:
        algo: one of ALGORITHM_NAMES.
        topology: the topology to run on.
        optimizer: the local optimizer's settings.
        options: the algorithm's options or a run's settings (None: the defaults).

    Raises:
        AlgorithmError: the combination is refused; the message names the allowed choices.
    """
    get_algorithm_class(algo).check(topology, optimizer, algorithm_options(algo, options))


def check_topology_fits_world(topology: Topology, world_size: int) -> None:
    """Raise AlgorithmError unless ``topology`` is for ``world_size`` workers.

    Args:
        topology: the topology to run on.
        world_size: the number of workers.

    Raises:
        AlgorithmError: the sizes differ; the message gives both.
    """
    if topology.world_size != world_size:
        raise AlgorithmError(
            f"topology {topology.name!r} is for {topology.world_size} workers, "
            f"the world has {world_size}"
        )


def make_algorithm(
    algo: str,
    comm: Communicator,
    topology: Topology,
    optimizer: LocalOptimizer,
    x0: torch.Tensor,
    options: Options | Mapping[str, Any] | None = None,
) -> Algorithm:
    """Build algorithm ``algo`` for this worker; refuses invalid combinations with a clear error.

    Args:
        algo: one of ALGORITHM_NAMES ("relay", "dpsgd", ...).
        comm: this worker's Communicator.
        topology: the topology over ``comm``'s world.
        optimizer: this worker's local optimizer (``relaympi.optim.make_optimizer``).
        x0: this worker's flat initial model; the algorithm's buffers take its dtype and device.
        options: the algorithm's options, or a run's settings to read them from (None: the
            defaults).

    Returns:
        The algorithm; ``step(x, grad, lr, step)`` then updates x in place.

    Raises:
        AlgorithmError: an unknown name, a topology for another world size, or a combination
            the algorithm refuses (a graph that is not a tree for RelaySGD, say).

    Example:
        ```python
        def worker(comm):
            x = torch.zeros(10)
            optimizer = make_optimizer(OptimizerConfig("sgd"), x)
            relay = make_algorithm("relay", comm, build("chain", comm.world_size), optimizer, x)
            relay.step(x, torch.ones(10), lr=0.1, step=0)
            return x

        run_local(4, worker)
        ```
    """
    cls = get_algorithm_class(algo)
    check_topology_fits_world(topology, comm.world_size)
    return cls(comm, topology, optimizer, x0, algorithm_options(algo, options))
