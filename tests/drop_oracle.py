"""The loss model the message passing is held to under drops: each algorithm's matrix form stepped
with lost messages (its ``MatrixForm.lossy_step``, written from the paper's semantics and the loss
rules in docs/algorithms.md's "Message loss" section, with the pieces of
relaympi.algorithms.losses), and RelaySum for mean estimation.

Which messages are lost is an input: ``delivered(round, tag, src, dst)``, normally
``not DropPolicy.dropped(...)``, asked with the round and tag numbering the algorithms use
(``round_id(step, sub)``; tag = tree layer for RelaySum, 0 otherwise). Nothing here communicates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relaympi.algorithms.base import Delivered
from relaympi.algorithms.losses import LossyRelaySum
from relaympi.algorithms.matrix import make_matrix_algorithm
from relaympi.comm import DropPolicy
from relaympi.optim import OptimizerConfig


def delivered_by(drops: DropPolicy) -> Delivered:
    """The loss pattern of a DropPolicy, as the question 'did this message arrive?'."""
    return lambda round, tag, src, dst: not drops.dropped(round, tag, src, dst)


class LossyOracle:
    """x(t) -> x(t+1) for all workers at once, with the messages ``delivered`` says were lost: the
    algorithm's matrix form, stepped by its ``lossy_step``."""

    def __init__(
        self,
        algo: str,
        topology: Any,
        x0: np.ndarray,
        optimizer_config: OptimizerConfig,
        delivered: Delivered,
        relay_mode: str = "counts",
        d2_exact_diffusion: bool = False,
    ) -> None:
        self.delivered = delivered
        self.form = make_matrix_algorithm(
            algo,
            topology,
            topology.world_size,
            x0,
            optimizer_config,
            relay_mode=relay_mode,
            d2_exact_diffusion=d2_exact_diffusion,
        )

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return self.form.lossy_step(X, G, lr, t, self.delivered)


class LossyMeanEstimator:
    """RelaySum for distributed mean estimation (appendix Algorithm "RelaySum for DME") with lost
    messages: y_i += d_i(t) + sum_j m_ji(t),  s_i += 1 + sum_j c_ji(t),  estimate y_i / s_i."""

    def __init__(self, topology: Any, d: int, delivered: Delivered):
        self.relay = LossyRelaySum(topology, d)
        self.delivered = delivered
        self.total = np.zeros((topology.world_size, d))
        self.count = np.zeros((topology.world_size, d))

    def step(self, samples: np.ndarray, round: int) -> np.ndarray:
        S, nbar = self.relay.step(samples, round, self.delivered)
        self.total += samples + S
        self.count += nbar
        return self.total / self.count
