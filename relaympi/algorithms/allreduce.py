"""All-reduce (centralized) baseline: average gradients over all workers, then the local optimizer."""

from __future__ import annotations

import numpy as np
import torch

from relaympi.algorithms.base import FULLY_CONNECTED, Algorithm, MatrixForm


class AllReduceMatrix(MatrixForm):
    """X(t+1) = X(t) + the local optimizers' update of the mean gradient (the same on every row)."""

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        mean = np.repeat(G.mean(axis=0, keepdims=True), self.matrix_algorithm.n, axis=0)
        return X + self.matrix_algorithm.optimizer.update(mean, X, lr)


class AllReduce(Algorithm):
    """Synchronous data-parallel SGD: every worker applies the same averaged gradient, so all
    models stay identical (momentum/Adam then act on the global gradient, as centralized training).

    The all-reduce is a collective: simulated message loss (--drop-prob) does not apply to it."""

    name = "allreduce"
    default_topology = "fully-connected"
    topology_kind = FULLY_CONNECTED
    matrix_form = AllReduceMatrix

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.mixers.allreduce_mean(grad)
        self.optimizer.update(grad, x, lr, apply=True)
