"""The one algorithm x topology table the algorithm tests run.

A ``Case`` is one algorithm on one topology with a number of workers, its local optimizer and its
options. ``CASES`` holds every algorithm, every relay mode and each local optimizer, on trees of
degree 1, 2, 3 and n - 1 and on node-aware topologies: the rows that test_algorithms.py (message
passing against the matrix oracle), test_algorithms_with_drops.py (message passing against the
loss model) and test_batched_algorithms.py (the batched engine against message passing and the
oracles) all run, and, marked with ``only``, the few rows one of them alone needs (larger graphs,
RelaySum's chunks and in-place exchange under loss). ``cases(test)`` is a test's rows. An algorithm
without rows of its own gets rows from its declaration (its default topology, momentum and Adam);
rows for what it needs beyond that go here, and only here. test_ranged_step_baselines.py writes its
own rows (the ranged step of the algorithms that have one) with the same ``Case``.

Topology names may carry a node layout ("chain@3", "chain@3rr"): see tests/node_layouts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaympi.algorithms import (
    ALGORITHM_NAMES,
    AlgorithmOptions,
    communication,
    default_topology,
    needs_momentum,
)
from relaympi.optim import OptimizerConfig

SGD = OptimizerConfig()
MOMENTUM = OptimizerConfig(momentum=0.9, weight_decay=1e-3)
HEAVY_BALL = OptimizerConfig(momentum=0.5, nesterov=False)
ADAM = OptimizerConfig(name="adam", weight_decay=1e-3)

# the tests that run the table: the matrix oracle, the loss model, the batched engine
TESTS = ("oracle", "drops", "batched")


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
    only: str | None = None  # the one test of TESTS that runs this row (None: all of them)

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
        """Whether simulated message loss applies: as the algorithm's communication declares."""
        return communication(self.algo).lossy


def _drops(*rows: Case) -> list[Case]:
    return [Case(**{**vars(row), "only": "drops"}) for row in rows]


def _batched(*rows: Case) -> list[Case]:
    return [Case(**{**vars(row), "only": "batched"}) for row in rows]


CASES = (
    [
        Case("allreduce", "fully-connected", 4, MOMENTUM),  # a collective: drops do not apply
        Case("allreduce", "fully-connected", 5, ADAM),
        Case("dpsgd", "ring", 7),
        Case("dpsgd", "star", 6, MOMENTUM),
        Case("dpsgd", "binary-tree", 7, ADAM),
        Case("dpsgd", "chain", 5, ADAM),
        Case("qgm", "ring", 7, MOMENTUM),
        Case("qgm", "chain", 5, HEAVY_BALL),
        Case("d2", "ring", 7),
        Case("d2", "chain", 6, MOMENTUM),
        Case("gt", "ring", 7),
        Case("gt", "binary-tree", 7, MOMENTUM),
        Case("sgp", "exponential", 8),
        Case("sgp", "exponential", 4, MOMENTUM),
        # one-peer time-varying topologies: W(t) changes every step
        Case("dpsgd", "alternating-ring", 6),
        Case("dpsgd", "one-peer-exponential", 8, MOMENTUM),
        Case("qgm", "one-peer-exponential", 4, MOMENTUM),
        Case("qgm", "alternating-ring", 6, MOMENTUM),
        Case("gt", "alternating-ring", 4, ADAM),
        Case("gt", "one-peer-exponential", 8, MOMENTUM),
        Case("relay-grad", "chain", 6),
        Case("relay-grad", "double-binary-trees", 8, SGD, relay_chunk=3),
        Case("relay", "binary-tree", 7, ADAM),
        Case("relay", "double-binary-trees", 8, MOMENTUM, "previous"),
        Case("relay", "double-binary-trees", 7, SGD, "initial", relay_in_place=True, relay_chunk=2),
    ]
    + [
        Case("relay", topo, n, SGD, mode)
        for topo, n in (("chain", 6), ("star", 6), ("binary-tree", 7), ("double-binary-trees", 7))
        for mode in ("counts", "previous", "initial")
    ]
    + [
        Case("relay", topo, n, MOMENTUM)
        for topo, n in (("chain", 5), ("binary-tree", 6), ("star", 5), ("double-binary-trees", 8))
    ]
    + [
        # node-aware topologies ("@3": nodes of 3 ranks in blocks, "@3rr":
        # round-robin; tests/node_layouts.py)
        Case("relay", "double-binary-trees@3", 9, SGD, "counts"),
        Case("relay", "double-binary-trees@3rr", 12, MOMENTUM, "previous"),
        Case("relay", "chain@3rr", 7, SGD, "initial", relay_chunk=2),
        Case("relay-grad", "binary-tree@3", 9),
        Case("dpsgd", "ring@3rr", 8),
        Case("gt", "ring@3rr", 8),
    ]
    # the loss model alone: larger graphs, every relay mode on more trees, in-place and chunked
    # RelaySum under loss
    + _drops(
        Case("dpsgd", "hypercube", 8),
        Case("d2", "social-network", 32, SGD, d2_exact_diffusion=True),
        Case("relay-grad", "binary-tree", 7, MOMENTUM),
        Case("relay-grad", "double-binary-trees", 7),
        Case("relay", "social-network-tree", 32),
        *[
            Case("relay", "double-binary-trees", 8, SGD, m)
            for m in ("counts", "previous", "initial")
        ],
        Case("relay", "binary-tree", 7, SGD, "previous", relay_in_place=True),
        Case("relay", "double-binary-trees", 7, MOMENTUM, "counts", relay_in_place=True),
        Case("relay", "star", 5, SGD, "initial", relay_in_place=True),
        # messages in chunks of 2 elements: a lost message loses all its chunks, counter included
        Case("relay", "binary-tree", 7, SGD, "counts", relay_chunk=2),
        Case("relay", "double-binary-trees", 8, MOMENTUM, "previous", relay_chunk=2),
    )
    # the batched engine alone: exact diffusion, more relay modes under momentum
    + _batched(
        Case("d2", "ring", 6, SGD, d2_exact_diffusion=True),
        Case("relay-grad", "double-binary-trees", 8, MOMENTUM),
        Case("relay", "double-binary-trees", 8, MOMENTUM, "initial"),
        Case("relay", "double-binary-trees@3", 10, MOMENTUM, "counts"),
        Case("relay", "double-binary-trees@3rr", 11, SGD, "previous"),
    )
)


# WORKERS workers take every topology family an algorithm defaults to (exponential: a power of 2)
WORKERS = 8


def _declared_rows(written: list[Case]) -> list[Case]:
    """An algorithm without rows written above runs on its declared default topology with
    momentum, and with Adam unless it needs momentum: a new algorithm is tested by the oracles as
    soon as it is registered (write it rows of its own for more)."""
    rows = []
    for algo in ALGORITHM_NAMES:
        if any(case.algo == algo for case in written):
            continue
        optimizers = (MOMENTUM,) if needs_momentum(algo) else (MOMENTUM, ADAM)
        rows += [Case(algo, default_topology(algo), WORKERS, opt) for opt in optimizers]
    return rows


CASES += _declared_rows(CASES)


def cases(test: str) -> list[Case]:
    """The rows ``test`` (one of TESTS) runs: the shared ones and its own."""
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    return [case for case in CASES if case.only in (None, test)]
