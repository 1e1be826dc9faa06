"""Gradient tracking (Lorenzo & Scutari 2016) in the paper's update/correction form, one packed
message per edge."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import GOSSIP_GRAPHS, RangedAlgorithm, round_id
from relaympi.algorithms.gossip import Mixer, Started, gossip_matrices
from relaympi.algorithms.losses import GossipMatrixForm


class GradientTrackingMatrix(GossipMatrixForm):
    """X(t+1) = W(t) (X + U + C),  C(t+1) = W(t) (C + U) - U."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        # W(t) = Ws[t mod len]: one matrix for a fixed graph, one per round for a one-peer topology
        self.Ws = gossip_matrices(matrix_algorithm.topology)
        self.C = np.zeros((matrix_algorithm.n, matrix_algorithm.d))

    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        U = self.matrix_algorithm.optimizer.update(G, X, lr)
        X_new = W @ (X + U + self.C)
        # the same W for both halves: a lost message loses both, as they travel in one
        self.C = W @ (self.C + U) - U
        return X_new


class GradientTracking(RangedAlgorithm):
    """x(t+1) = W (x(t) + u(t) + c(t)),  c(t+1) = W (c(t) + u(t)) - u(t).

    (The appendix's correction line has a typo; this is the standard form: y = u + c then
    follows y(t+1) = W y(t) + u(t+1) - u(t).) Both products use one exchange of [x+u+c, c+u]: per
    range [lo, hi) one message packed[2 lo : 2 hi] = [(x+u+c)[lo:hi], (c+u)[lo:hi]] (disjoint ranges
    covering [0, n) tile [0, 2n); the whole step's packed is [x+u+c, c+u]). A range needs only its
    own
    gradient, so its message leaves once that is final.

    A lost message loses both halves: both products use the same row of W with the lost
    neighbour's weight dropped and the rest renormalized (GossipMixer).
    """

    name = "gt"
    summary = "gradient tracking (standard form)"
    heal_rule = (
        "gossip weights rebuilt for the survivors' graph; the correction restarts at zero, so the "
        "corrections sum to zero over the survivors (the tracker's invariant)"
    )
    topologies = GOSSIP_GRAPHS
    matrix_form = GradientTrackingMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        n = x0.shape[-1]  # [x+u+c, c+u] side by side in the last dimension (batched: every row)
        self.packed = torch.zeros((*x0.shape[:-1], 2 * n), dtype=x0.dtype, device=x0.device)
        self.correction = torch.zeros_like(x0)
        # one mixer per step of the topology's period (a fixed graph: one)
        self.step_mixers: list[Mixer] = [
            self.mixers.gossip(w, self.packed) for w in gossip_matrices(self.topology)
        ]

    def _start(self, lo: int, hi: int, index: int) -> Started:
        x, grad, lr, step = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=False)
        u, c = self.optimizer.update_buffer[..., lo:hi], self.correction[..., lo:hi]
        model, corr = self.packed[..., 2 * lo : lo + hi], self.packed[..., lo + hi : 2 * hi]
        torch.add(x[..., lo:hi], u, out=model).add_(c)
        torch.add(c, u, out=corr)
        mixer = self.step_mixers[step % len(self.step_mixers)]
        return mixer.start(self.packed, 2 * lo, 2 * hi, round_id(step), chunk=index)

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        pending.finish()
        u = self.optimizer.update_buffer[..., lo:hi]
        self._ranged[0][..., lo:hi].copy_(self.packed[..., 2 * lo : lo + hi])
        torch.sub(self.packed[..., lo + hi : 2 * hi], u, out=self.correction[..., lo:hi])

    def state_dict(self) -> dict[str, Any]:
        return {"correction": self.correction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.correction.copy_(state["correction"])
