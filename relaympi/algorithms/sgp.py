"""Stochastic Gradient Push on the time-varying exponential graph (paper appendix Algorithm "SGP"), two rounds per step."""

from __future__ import annotations

import numpy as np
import torch

from relaympi.algorithms.base import EXPONENTIAL, Algorithm, AlgorithmError, MatrixForm, round_id
from relaympi.topology import ExponentialSchedule, TopologyError

ROUNDS = 2  # two communication rounds per gradient step equalize bandwidth with RelaySGD


class SGPMatrix(MatrixForm):
    """X(t+1) = W(2t + 1) W(2t) (X + U), W(t') the exponential schedule's averaging matrix of round t'."""

    def __init__(self, engine):
        super().__init__(engine)
        self.schedule = ExponentialSchedule(engine.n)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        Y = X + self.engine.optimizer.update(G, X, lr)
        for r in range(ROUNDS):
            Y = self.schedule.mixing_matrix(ROUNDS * t + r) @ Y
        return Y


class SGP(Algorithm):
    """Round r (global counter t' = 2 step + r): send x to i - 2^(t' mod log2 n), receive from
    i + 2^(t' mod log2 n), x <- (x + x_received) / 2. With exactly one in- and one out-neighbour
    per round the push-sum weights stay 1, so they are not carried. A lost message leaves the
    receiver's model as it was."""

    name = "sgp"
    default_topology = "exponential"
    topology_kind = EXPONENTIAL
    matrix_form = SGPMatrix

    def __init__(self, comm, topology, optimizer, x0, options):
        super().__init__(comm, topology, optimizer, x0, options)
        try:
            self.schedule = ExponentialSchedule(comm.world_size)
        except TopologyError as exc:
            raise AlgorithmError(f"sgp: {exc}") from exc
        self.received = torch.zeros_like(x0)

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.optimizer.update(grad, x, lr, apply=True)
        if self.comm.world_size == 1:
            return
        rank = self.comm.rank
        for r in range(ROUNDS):
            t = ROUNDS * step + r
            to, frm = self.schedule.send_peer(t, rank), self.schedule.recv_peer(t, rank)
            request = self.comm.exchange({to: x}, {frm: self.received}, tag=0, round=round_id(step, r))
            if frm in request.wait():
                x.add_(self.received).mul_(0.5)
