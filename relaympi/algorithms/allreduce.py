"""All-reduce (centralized) baseline: average gradients over all workers, then the local
optimizer."""

from __future__ import annotations

import numpy as np

from relaympi.algorithms.base import FULLY_CONNECTED, MatrixForm, RangedAlgorithm
from relaympi.algorithms.gossip import Started


class AllReduceMatrix(MatrixForm):
    """X(t+1) = X(t) + the local optimizers' update of the mean gradient (the same on every row)."""

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        mean = np.repeat(G.mean(axis=0, keepdims=True), self.matrix_algorithm.n, axis=0)
        return X + self.matrix_algorithm.optimizer.update(mean, X, lr)


class AllReduce(RangedAlgorithm):
    """Synchronous data-parallel SGD: every worker applies the same averaged gradient, so all
    models stay identical (momentum/Adam then act on the global gradient, as centralized training).

    A range's all-reduce starts once its gradient is final (Mixers.start_allreduce_mean: pieces sum
    to the whole buffer's bits, on MPI by relaympi.comm.mpi's fixed-tree all-reduce); its local
    update
    follows the mean, in finish_step.

    The all-reduce is a collective: simulated message loss (--drop-prob) does not apply to it."""

    name = "allreduce"
    summary = "centralized baseline: averaged gradients"
    heal_rule = "the fixed-tree sum over the survivors (no other state)"
    topologies = FULLY_CONNECTED
    matrix_form = AllReduceMatrix

    def _start(self, lo: int, hi: int, index: int) -> Started:
        return self.mixers.start_allreduce_mean(self._ranged[1][..., lo:hi])

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        x, grad, lr, _ = self._ranged
        pending.finish()
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)
