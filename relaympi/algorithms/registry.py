"""The algorithms by name: look-up, their options, the combination check, building one worker's.

Torch-free until an algorithm is used: each algorithm's line (``Declared``) names its class as
"module:Class" (imported on first look-up) beside what the run's configuration, the plan and the
report read without torch: its options (relaympi.algorithms.options), its report label and how it
communicates. A new algorithm is its module and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from relaympi.algorithms.options import (
    AlgorithmError,
    D2Options,
    NoOptions,
    Options,
    RelaySGDOptions,
    RelaySumOptions,
    option_names,
)
from relaympi.registry import Registry

if TYPE_CHECKING:
    import torch

    from relaympi.algorithms.base import Algorithm
    from relaympi.comm import Communicator
    from relaympi.optim import LocalOptimizer, OptimizerConfig
    from relaympi.topology import Topology


@dataclass(frozen=True)
class Communication:
    """How an algorithm communicates, as far as the code outside it cares: the configuration's
    refusals, the plan, the checkpoints and the report derive their rules from these facts.

    Attributes:
        what: how it communicates, words that follow "--algo NAME" in a refusal ("sends no
            messages").
        lossy: it sends point-to-point messages that simulated loss (``--drop-prob``) can drop.
        placed: it mixes over the topology's edges, so where ranks sit on the topology
            (``--placement``) changes its numbers, and a default lr tuned for one worker count
            may not suit far fewer (the plan warns).
        follows_nodes: the ranks' nodes shape its communication whatever the placement (the
            all-reduce's tree is built over them), so a resume must find each rank on its node.
    """

    what: str
    lossy: bool
    placed: bool
    follows_nodes: bool = False


# point-to-point messages over the topology's edges: gossip and RelaySum
MESSAGES = Communication("sends messages over the topology's edges", lossy=True, placed=True)
# the collective all-reduce (a fixed tree over the nodes), not simulated as lossy
COLLECTIVE = Communication(
    "communicates by a collective, which is not simulated as lossy",
    lossy=False,
    placed=False,
    follows_nodes=True,
)
NO_COMMUNICATION = Communication("sends no messages", lossy=False, placed=False)


@dataclass(frozen=True)
class Declared:
    """An algorithm's line in the registry: what the rest of the code knows of it without
    importing it (torch-free: the configuration, `--help` and the refusals before torch read it).
    Its class declares the rest (``Algorithm``: the topologies it takes, its matrix form and
    behaviour under loss, its heal rule); tests/test_algorithm_declarations.py checks that every
    algorithm declares everything.

    Attributes:
        cls: its ``Algorithm`` subclass as ``"package.module:Class"`` (imported on first use).
        label: its name in the report's tables ("RelaySGD").
        options: its options class (relaympi.algorithms.options); ``NoOptions`` without any.
        communication: how it communicates (``MESSAGES``, ``COLLECTIVE``, ``NO_COMMUNICATION``
            or a ``Communication`` of its own).
        default_topology: the topology it runs on without ``--topology`` (the paper's, table
            "Motivation of topology choices"); one its class's ``topologies`` take.
        needs_momentum: it takes only SGD with momentum > 0 as the local optimizer.
    """

    cls: str
    label: str
    options: type[Options] = NoOptions
    communication: Communication = MESSAGES
    default_topology: str = field(kw_only=True)
    needs_momentum: bool = field(default=False, kw_only=True)


# name -> its declaration, in the command line's and the report's order. A new algorithm is its
# module and one line here
_DECLARED: dict[str, Declared] = {
    "allreduce": Declared(
        "relaympi.algorithms.allreduce:AllReduce",
        "All-reduce",
        communication=COLLECTIVE,
        default_topology="fully-connected",
    ),
    "relay": Declared(
        "relaympi.algorithms.relay:RelaySGD",
        "RelaySGD",
        RelaySGDOptions,
        default_topology="double-binary-trees",
    ),
    "relay-grad": Declared(
        "relaympi.algorithms.relay:RelaySGDGrad",
        "RelaySGD/Grad",
        RelaySumOptions,
        default_topology="double-binary-trees",
    ),
    "dpsgd": Declared("relaympi.algorithms.dpsgd:DPSGD", "D-PSGD", default_topology="ring"),
    "qgm": Declared(
        "relaympi.algorithms.qgm:QuasiGlobalMomentum",
        "D-PSGD + quasi-global momentum",
        default_topology="ring",
        needs_momentum=True,  # quasi-global *momentum*: meaningless without it
    ),
    "d2": Declared("relaympi.algorithms.d2:D2", "D2", D2Options, default_topology="ring"),
    "gt": Declared(
        "relaympi.algorithms.gt:GradientTracking", "Gradient tracking", default_topology="ring"
    ),
    "sgp": Declared("relaympi.algorithms.sgp:SGP", "SGP", default_topology="exponential"),
    # its nominal topology: it sends nothing, so no other one would mean anything
    "isolated": Declared(
        "relaympi.algorithms.isolated:Isolated",
        "Isolated",
        communication=NO_COMMUNICATION,
        default_topology="fully-connected",
    ),
}

DECLARED: Registry[Declared] = Registry("algorithm", _DECLARED, error=AlgorithmError)
ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm", {name: d.cls for name, d in _DECLARED.items()}, error=AlgorithmError
)
# each algorithm's options class (torch-free)
ALGORITHM_OPTIONS: Registry[type[Options]] = Registry(
    "algorithm", {name: d.options for name, d in _DECLARED.items()}, error=AlgorithmError
)
ALGORITHM_NAMES = ALGORITHMS.names


def communication(algo: str) -> Communication:
    """How ``algo`` communicates (torch-free).

    Args:
        algo: one of ALGORITHM_NAMES.

    Returns:
        Its declared ``Communication``.

    Raises:
        AlgorithmError: an unknown algorithm.
    """
    return DECLARED[algo].communication


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
    """The paper's topology for ``algo`` (e.g. "double-binary-trees" for relay), torch-free.

    Args:
        algo: one of ALGORITHM_NAMES.

    Returns:
        A topology name, as ``relaympi.topology.build`` takes it.

    Raises:
        AlgorithmError: an unknown algorithm.
    """
    return DECLARED[algo].default_topology


def needs_momentum(algo: str) -> bool:
    """Whether ``algo`` takes only SGD with momentum > 0 as its local optimizer (torch-free).

    Args:
        algo: one of ALGORITHM_NAMES.

    Returns:
        True for an algorithm declared ``needs_momentum``.

    Raises:
        AlgorithmError: an unknown algorithm.
    """
    return DECLARED[algo].needs_momentum


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
    if needs_momentum(algo) and (optimizer.name != "sgd" or not optimizer.momentum):
        raise AlgorithmError(
            f"{algo} needs --optimizer sgd with --momentum > 0 (got "
            f"{optimizer.name}, momentum {optimizer.momentum})"
        )


def algorithm_table() -> str:
    """docs/algorithms.md's table of the algorithms, made from their declarations (their classes
    and their lines here; ``python -m scripts.doc_tables`` writes it).

    Returns:
        The Markdown table, one row per algorithm in the registry's order.
    """
    rows = [
        "| `--algo` | what | topologies | default topology | communication | options | report "
        "label |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, declared in DECLARED.items():
        cls = get_algorithm_class(name)
        what = cls.summary + (" (needs `--momentum`)" if declared.needs_momentum else "")
        options = ", ".join(
            f"`--{option.replace('_', '-')}`" for option in option_names(declared.options)
        )
        rows.append(
            f"| `{name}` | {what} | {cls.topologies.what} | `{declared.default_topology}` | "
            f"{declared.communication.what} | {options or 'none'} | {declared.label} |"
        )
    return "\n".join(rows) + "\n"


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
    check_topology_fits_world(topology, comm.world_size)
    check_combination(algo, topology, optimizer.config, options)
    return get_algorithm_class(algo)(
        comm, topology, optimizer, x0, algorithm_options(algo, options)
    )
