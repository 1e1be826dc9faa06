"""Stochastic Gradient Push on the time-varying exponential graph (paper appendix Algorithm "SGP"),
two rounds per step."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import (
    EXPONENTIAL,
    Delivered,
    MatrixForm,
    RangedAlgorithm,
    round_id,
)
from relaympi.algorithms.options import AlgorithmError
from relaympi.topology import ExponentialSchedule, TopologyError

ROUNDS = 2  # two communication rounds per gradient step equalize bandwidth with RelaySGD


class SGPMatrix(MatrixForm):
    """X(t+1) = W(2t + 1) W(2t) (X + U), W(t') the exponential schedule's averaging matrix of round
    t'."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        self.schedule = ExponentialSchedule(matrix_algorithm.n, any_size=True)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        Y = X + self.matrix_algorithm.optimizer.update(G, X, lr)
        for r in range(ROUNDS):
            Y = self.schedule.mixing_matrix(ROUNDS * t + r) @ Y
        return Y

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        Y = X + self.matrix_algorithm.optimizer.update(G, X, lr)
        for r in range(ROUNDS):  # global round counter k = 2t + r
            Y = _lossy_round(Y, ROUNDS * t + r, round_id(t, r), delivered)
        return Y


def _lossy_round(Y: np.ndarray, k: int, round: int, delivered: Delivered) -> np.ndarray:
    """Communication round k of SGP (appendix Algorithm "SGP"): with o = 2^(k mod log2 n), worker i
    receives x_{i+o} and sets x_i <- (x_i + x_{i+o}) / 2; if that message is lost, x_i stays as it
    was."""
    n = Y.shape[0]
    o = 2 ** (k % (n.bit_length() - 1))
    out = Y.copy()
    for i in range(n):
        src = (i + o) % n
        if delivered(round, 0, src, i):
            out[i] = (Y[i] + Y[src]) / 2
    return out


class SGP(RangedAlgorithm):
    """Round r (global counter t' = 2 step + r): send x to i - 2^(t' mod log2 n), receive from
    i + 2^(t' mod log2 n), x <- (x + x_received) / 2. With exactly one in- and one out-neighbour
    per round the push-sum weights stay 1, so they are not carried. Each round is a gossip mix with
    the schedule's W(t') (one mixer per hop length); a lost message leaves the receiver's model as
    it was (its weight dropped, x's renormalized to 1).

    So no push-sum weight travels: the only scalars are each round's mixing weights, the same for
    every coordinate, and a drop decision covers all ranges of its round's message. A range's local
    step and first round start once its gradient is final; finish_step completes every range's
    first round (starting that range's second round as it completes), then the second rounds."""

    name = "sgp"
    summary = "SGP on the time-varying exponential graph, two rounds per step"
    heal_rule = (
        "the exponential schedule over the survivors' count: hops 1, 2, 4, ... below it (mixing "
        "is exact after log2 n rounds only for a power of two); the push-sum weights stay 1"
    )
    topologies = EXPONENTIAL
    matrix_form = SGPMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        try:
            # the topology refused a count that is not a power of two, unless survivors built it
            self.schedule = ExponentialSchedule(self.topology.world_size, any_size=True)
        except TopologyError as exc:
            raise AlgorithmError(f"sgp: {exc}") from exc
        # one gossip mixer per hop length: W(t') sends to i - o and mixes in i + o with weights 1/2
        self.hops = [
            self.mixers.gossip(self.schedule.mixing_matrix(k), x0)
            for k in range(self.schedule.period)
        ]

    def _start(self, lo: int, hi: int, index: int) -> tuple:
        x, grad, lr, _ = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)
        return self._round(0, lo, hi, index)

    def _round(self, r: int, lo: int, hi: int, index: int) -> tuple:
        x, _, _, step = self._ranged
        return (
            r,
            index,
            self.hops[(ROUNDS * step + r) % self.schedule.period].start(
                x, lo, hi, round_id(step, r), chunk=index
            ),
        )

    def _test(self, pending: tuple) -> None:
        pending[2].test()

    def _finish(self, lo: int, hi: int, pending: tuple) -> tuple | None:
        r, index, started = pending
        started.finish()
        return self._round(r + 1, lo, hi, index) if r + 1 < ROUNDS else None
