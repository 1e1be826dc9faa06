"""Isolated training: every worker trains alone on its own shard and never communicates, the
no-communication floor that decentralized algorithms are measured against."""

from __future__ import annotations

from typing import Any

import numpy as np

from relaympi.algorithms.base import MatrixForm, RangedAlgorithm, Topologies
from relaympi.topology import Topology

# It takes no graph. A run still names a topology (the run file, the report's rows), so it runs
# on the nominal one all-reduce also names, and any other --topology is refused: it would
# change nothing
NOMINAL_TOPOLOGY = "fully-connected"


def _not_nominal(algo: str, topology: Topology) -> str | None:
    if topology.name == NOMINAL_TOPOLOGY:
        return None
    return (
        f"{algo} sends no messages, so it takes no graph: leave out --topology (it runs on the "
        f"nominal {NOMINAL_TOPOLOGY}), not {topology.name!r}"
    )


class IsolatedMatrix(MatrixForm):
    """X(t+1) = X(t) + U(t): the identity as the mixing matrix."""

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return X + self.matrix_algorithm.optimizer.update(G, X, lr)


class Isolated(RangedAlgorithm):
    """x(t+1) = x(t) + u(t) on every worker, from its own gradients only: a range's update is
    applied as soon as its gradient is final, and nothing is sent or received."""

    name = "isolated"
    summary = "every worker trains alone on its own shard, no communication: the floor"
    heal_rule = "nothing to rebuild: each survivor goes on alone (it has no other state)"
    topologies = Topologies(f"none (it runs on the nominal `{NOMINAL_TOPOLOGY}`)", _not_nominal)
    matrix_form = IsolatedMatrix

    def _start(self, lo: int, hi: int, index: int) -> None:
        x, grad, lr, _ = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)

    def _finish(self, lo: int, hi: int, pending: Any) -> None:
        return None
