"""The algorithm x topology table the algorithm tests share.

A ``Case`` is one algorithm on one topology with a number of workers, its local optimizer and its
options. ``CASES`` holds every algorithm, every relay mode and each local optimizer, on trees of
degree 1, 2, 3 and n - 1: the rows that test_algorithms_with_drops.py (message passing against the
loss model) and test_batched_algorithms.py (the batched engine against message passing and the
oracles) both run. Each of them adds the rows only it needs; test_ranged_step_baselines.py writes
its own rows with the same Case, and test_algorithms.py (the matrix oracle on the ``spmd`` fixture's
world, no worker count) its own (algorithm, topology, optimizer, relay mode) rows. A new algorithm
needs rows here and in those two.

Topology names may carry a node layout ("chain@3", "chain@3rr"): see tests/node_layouts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaympi.algorithms import AlgorithmOptions
from relaympi.optim import OptimizerConfig

SGD = OptimizerConfig()
MOMENTUM = OptimizerConfig(momentum=0.9, weight_decay=1e-3)
HEAVY_BALL = OptimizerConfig(momentum=0.5, nesterov=False)
ADAM = OptimizerConfig(name="adam", weight_decay=1e-3)


@dataclass(frozen=True)
class Case:
    """One row of the table: an algorithm on a topology, its local optimizer and options."""

    algo: str
    topology: str
    workers: int  # in-process ranks (under mpirun: the MPI world size instead)
    optimizer: OptimizerConfig = SGD
    relay_mode: str = "counts"
    relay_in_place: bool = False
    relay_chunk: int | None = None  # elements per message chunk (None: the default, one chunk)
    d2_exact_diffusion: bool = False

    @property
    def id(self) -> str:
        opt = self.optimizer
        momentum = "sgd" if opt.momentum == 0 else f"mom{opt.momentum}"
        tag = opt.name if opt.name == "adam" else momentum
        mode = f"-{self.relay_mode}" if self.algo == "relay" else ""
        place = "-in-place" if self.relay_in_place else ""
        chunk = f"-chunk{self.relay_chunk}" if self.relay_chunk else ""
        diffusion = "-exact-diffusion" if self.d2_exact_diffusion else ""
        return f"{self.algo}-{self.topology}-n{self.workers}-{tag}{mode}{place}{chunk}{diffusion}"

    @property
    def options(self) -> AlgorithmOptions:
        return AlgorithmOptions(
            relay_mode=self.relay_mode,
            d2_exact_diffusion=self.d2_exact_diffusion,
            relay_in_place=self.relay_in_place,
            relay_chunk=self.relay_chunk,
        )

    @property
    def loses_messages(self) -> bool:
        """Whether simulated message loss applies: not to all-reduce, a collective."""
        return self.algo != "allreduce"


# every algorithm, every relay mode, each local optimizer somewhere, trees of degree 1, 2, 3, n - 1
CASES = [
    Case("allreduce", "fully-connected", 4, MOMENTUM),  # a collective: drops do not apply
    Case("dpsgd", "ring", 7),
    Case("dpsgd", "star", 6, MOMENTUM),
    Case("dpsgd", "binary-tree", 7, ADAM),
    Case("qgm", "ring", 7, MOMENTUM),
    Case("qgm", "chain", 5, HEAVY_BALL),
    Case("d2", "ring", 7),
    Case("d2", "chain", 6, MOMENTUM),
    Case("gt", "ring", 7),
    Case("gt", "binary-tree", 7, MOMENTUM),
    Case("sgp", "exponential", 8),
    Case("sgp", "exponential", 4, MOMENTUM),
    Case("dpsgd", "alternating-ring", 6),  # one-peer time-varying topologies
    Case("dpsgd", "one-peer-exponential", 8, MOMENTUM),
    Case("qgm", "one-peer-exponential", 4, MOMENTUM),
    Case("gt", "alternating-ring", 4, ADAM),
    Case("relay-grad", "chain", 6),
    Case("relay-grad", "double-binary-trees", 8, SGD, relay_chunk=3),
    Case("relay", "binary-tree", 7, ADAM),
    Case("relay", "double-binary-trees", 8, MOMENTUM, "previous"),
    Case("relay", "double-binary-trees", 7, SGD, "initial", relay_in_place=True, relay_chunk=2),
] + [
    Case("relay", topo, n, SGD, mode)
    for topo, n in (("chain", 6), ("star", 6), ("double-binary-trees", 7))
    for mode in ("counts", "previous", "initial")
]
