"""D-PSGD with quasi-global momentum (Lin et al. 2021): the momentum buffer tracks the model's
change after gossip."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import GOSSIP_GRAPHS, RangedAlgorithm, round_id
from relaympi.algorithms.gossip import Mixer, Started, gossip_matrices
from relaympi.algorithms.losses import GossipMatrixForm


class QuasiGlobalMomentumMatrix(GossipMatrixForm):
    """D = beta M + G (Nesterov: G + beta D);  X(t+1) = W(t) (X - lr D);
    M <- beta M + (1 - beta) (X - X(t+1)) / lr."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        # W(t) = Ws[t mod len]: one matrix for a fixed graph, one per round for a one-peer topology
        self.Ws = gossip_matrices(matrix_algorithm.topology)
        self.M = np.zeros((matrix_algorithm.n, matrix_algorithm.d))

    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        c = self.matrix_algorithm.optimizer.config
        beta = c.momentum
        G = G + c.weight_decay * X if c.weight_decay else G
        D = beta * self.M + G
        if c.nesterov:
            D = G + beta * D
        X_new = W @ (X - lr * D)
        if lr > 0:
            self.M = beta * self.M + (1 - beta) * (X - X_new) / lr
        return X_new


class QuasiGlobalMomentum(RangedAlgorithm):
    """x(t+1/2) = x(t) - lr (g + beta (beta m + g))  (Nesterov form; heavy ball: x - lr (beta m +
    g)),
    gossip, then  m <- beta m + (1 - beta) (x(t) - x(t+1)) / lr.

    The buffer m is never updated from the local gradient alone: it follows the averaged
    model's motion, which is what makes it robust to heterogeneous data.
    """

    name = "qgm"
    summary = "D-PSGD with quasi-global momentum"
    heal_rule = (
        "gossip weights rebuilt for the survivors' graph; the quasi-global momentum restarts at "
        "zero (it followed the averaged model of the old neighbourhood)"
    )
    topologies = GOSSIP_GRAPHS
    matrix_form = QuasiGlobalMomentumMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        self.beta = self.optimizer.config.momentum
        # one mixer per step of the topology's period (a fixed graph: one)
        self.step_mixers: list[Mixer] = [
            self.mixers.gossip(w, x0) for w in gossip_matrices(self.topology)
        ]
        self.momentum_buffer = torch.zeros_like(x0)
        self._x_before = torch.zeros_like(x0)
        self._direction = torch.zeros_like(x0)

    def _start(self, lo: int, hi: int, index: int) -> Started:
        x, grad, lr, step = self._ranged
        cfg, beta = self.optimizer.config, self.beta
        x, grad, m, d = (
            x[..., lo:hi],
            grad[..., lo:hi],
            self.momentum_buffer[..., lo:hi],
            self._direction[..., lo:hi],
        )
        g = grad.add(x, alpha=cfg.weight_decay) if cfg.weight_decay else grad
        torch.add(g, m, alpha=beta, out=d)  # beta m + g
        if cfg.nesterov:
            d.mul_(beta).add_(g)  # g + beta (beta m + g)
        self._x_before[..., lo:hi].copy_(x)
        x.add_(d, alpha=-lr)
        mixer = self.step_mixers[step % len(self.step_mixers)]
        return mixer.start(self._ranged[0], lo, hi, round_id(step), chunk=index)

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        pending.finish()
        x, _, lr, _ = self._ranged
        beta = self.beta
        if lr > 0:  # during a warm-up from lr = 0 the model did not move: keep m
            self.momentum_buffer[..., lo:hi].mul_(beta).add_(
                self._x_before[..., lo:hi].sub_(x[..., lo:hi]), alpha=(1 - beta) / lr
            )

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum_buffer.copy_(state["momentum_buffer"])
