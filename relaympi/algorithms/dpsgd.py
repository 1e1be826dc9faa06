"""D-PSGD (Lian et al. 2017): a local step, then gossip averaging with Metropolis-Hastings
weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import ONE_GRAPH, RangedAlgorithm, round_id
from relaympi.algorithms.gossip import Started, mixing_matrix_for
from relaympi.algorithms.losses import GossipMatrixForm


class DPSGDMatrix(GossipMatrixForm):
    """X(t+1) = W (X(t) + U(t))."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        self.W = matrix_algorithm.topology.mixing_matrix(0)

    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        return W @ (X + self.matrix_algorithm.optimizer.update(G, X, lr))


class DPSGD(RangedAlgorithm):
    """x(t+1/2) = x(t) + u(t), then x(t+1) = W x(t+1/2): a range's local step and its sends start as
    soon as its gradient is final; the averaging follows each range's receives."""

    name = "dpsgd"
    summary = "D-PSGD, Metropolis–Hastings gossip (1/3 on a ring)"
    heal_rule = "gossip weights rebuilt for the survivors' graph (it has no other state)"
    default_topology = "ring"
    topologies = ONE_GRAPH
    matrix_form = DPSGDMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        self.mixer = self.mixers.gossip(mixing_matrix_for(self.topology), x0)

    def _start(self, lo: int, hi: int, index: int) -> Started:
        x, grad, lr, step = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)  # x(t+1/2), paper eq. (DP-SGD)
        return self.mixer.start(x, lo, hi, round_id(step), chunk=index)

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        pending.finish()
