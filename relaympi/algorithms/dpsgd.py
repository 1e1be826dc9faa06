"""D-PSGD (Lian et al. 2017): a local step, then gossip averaging with Metropolis-Hastings weights."""

from __future__ import annotations

import numpy as np
import torch

from relaympi.algorithms.base import ONE_GRAPH, Algorithm, MatrixForm, round_id
from relaympi.algorithms.gossip import mixing_matrix_for


class DPSGDMatrix(MatrixForm):
    """X(t+1) = W (X(t) + U(t))."""

    def __init__(self, matrix_algorithm):
        super().__init__(matrix_algorithm)
        self.W = matrix_algorithm.topology.mixing_matrix(0)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return self.W @ (X + self.matrix_algorithm.optimizer.update(G, X, lr))


class DPSGD(Algorithm):
    name = "dpsgd"
    default_topology = "ring"
    topology_kind = ONE_GRAPH
    matrix_form = DPSGDMatrix

    def __init__(self, comm, topology, optimizer, x0, options, mixers=None):
        super().__init__(comm, topology, optimizer, x0, options, mixers)
        self.mixer = self.mixers.gossip(mixing_matrix_for(topology), x0)

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.optimizer.update(grad, x, lr, apply=True)  # x(t+1/2), paper eq. (DP-SGD)
        self.mixer.mix(x, round_id(step))
