"""Stochastic Gradient Push on the time-varying exponential graph (paper appendix Algorithm "SGP"), two rounds per step."""

from __future__ import annotations

import numpy as np
import torch

from relaympi.algorithms.base import EXPONENTIAL, Algorithm, AlgorithmError, MatrixForm, round_id
from relaympi.topology import ExponentialSchedule, TopologyError

ROUNDS = 2  # two communication rounds per gradient step equalize bandwidth with RelaySGD


class SGPMatrix(MatrixForm):
    """X(t+1) = W(2t + 1) W(2t) (X + U), W(t') the exponential schedule's averaging matrix of round t'."""

    def __init__(self, matrix_algorithm):
        super().__init__(matrix_algorithm)
        self.schedule = ExponentialSchedule(matrix_algorithm.n)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        Y = X + self.matrix_algorithm.optimizer.update(G, X, lr)
        for r in range(ROUNDS):
            Y = self.schedule.mixing_matrix(ROUNDS * t + r) @ Y
        return Y


class SGP(Algorithm):
    """Round r (global counter t' = 2 step + r): send x to i - 2^(t' mod log2 n), receive from
    i + 2^(t' mod log2 n), x <- (x + x_received) / 2. With exactly one in- and one out-neighbour
    per round the push-sum weights stay 1, so they are not carried. Each round is a gossip mix with
    the schedule's W(t') (one mixer per hop length); a lost message leaves the receiver's model as
    it was (its weight dropped, x's renormalized to 1)."""

    name = "sgp"
    default_topology = "exponential"
    topology_kind = EXPONENTIAL
    matrix_form = SGPMatrix

    def __init__(self, comm, topology, optimizer, x0, options, mixers=None):
        super().__init__(comm, topology, optimizer, x0, options, mixers)
        try:
            self.schedule = ExponentialSchedule(topology.world_size)
        except TopologyError as exc:
            raise AlgorithmError(f"sgp: {exc}") from exc
        # one gossip mixer per hop length: W(t') sends to i - o and mixes in i + o with weights 1/2
        self.hops = [self.mixers.gossip(self.schedule.mixing_matrix(k), x0) for k in range(self.schedule.period)]

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.optimizer.update(grad, x, lr, apply=True)
        for r in range(ROUNDS):
            self.hops[(ROUNDS * step + r) % self.schedule.period].mix(x, round_id(step, r))
