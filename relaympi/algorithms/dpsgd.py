"""D-PSGD (Lian et al. 2017): a local step, then gossip averaging with Metropolis-Hastings
weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import GOSSIP_GRAPHS, RangedAlgorithm, round_id
from relaympi.algorithms.gossip import Mixer, Started, gossip_matrices
from relaympi.algorithms.losses import GossipMatrixForm


class DPSGDMatrix(GossipMatrixForm):
    """X(t+1) = W(t) (X(t) + U(t)); W(t) = W on a fixed graph."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        # W(t) = Ws[t mod len]: one matrix for a fixed graph, one per round for a one-peer topology
        self.Ws = gossip_matrices(matrix_algorithm.topology)

    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        return W @ (X + self.matrix_algorithm.optimizer.update(G, X, lr))


class DPSGD(RangedAlgorithm):
    """x(t+1/2) = x(t) + u(t), then x(t+1) = W(t) x(t+1/2): a range's local step and its sends start
    as soon as its gradient is final; the averaging follows each range's receives. W(t) is the
    graph's fixed matrix, or on a one-peer topology the average with step t's one peer."""

    name = "dpsgd"
    summary = "D-PSGD, Metropolis–Hastings gossip (1/3 on a ring)"
    heal_rule = "gossip weights rebuilt for the survivors' graph (it has no other state)"
    topologies = GOSSIP_GRAPHS
    matrix_form = DPSGDMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        # one mixer per step of the topology's period (a fixed graph: one)
        self.step_mixers: list[Mixer] = [
            self.mixers.gossip(w, x0) for w in gossip_matrices(self.topology)
        ]

    def _start(self, lo: int, hi: int, index: int) -> Started:
        x, grad, lr, step = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)  # x(t+1/2), paper eq. (DP-SGD)
        mixer = self.step_mixers[step % len(self.step_mixers)]
        return mixer.start(x, lo, hi, round_id(step), chunk=index)

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        pending.finish()
