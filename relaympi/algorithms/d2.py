"""D² (Tang et al. 2018) with local momentum and time-varying step size (paper appendix, Algorithm
"D² with momentum")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import (
    ONE_GRAPH,
    RangedAlgorithm,
    round_id,
)
from relaympi.algorithms.d2_rule import D2_MIN_EIGENVALUE, d2_allows
from relaympi.algorithms.gossip import Started, mixing_matrix_for
from relaympi.algorithms.losses import GossipMatrixForm
from relaympi.algorithms.options import AlgorithmError, D2Options
from relaympi.optim import OptimizerConfig
from relaympi.topology import Topology


def d2_mixing_matrix(topology: Topology, exact_diffusion: bool, force: bool) -> np.ndarray:
    """The gossip matrix D² uses; refuses one whose smallest eigenvalue is below
    D2_MIN_EIGENVALUE (a one-peer topology is refused before, by D2.topologies: its correction
    assumes one fixed W)."""
    w = mixing_matrix_for(topology)
    if exact_diffusion:
        w = (
            w + np.eye(w.shape[0])
        ) / 2  # Exact Diffusion's matrix, as the paper uses on the social network
    smallest = float(np.linalg.eigvalsh((w + w.T) / 2).min())
    if not d2_allows(smallest) and not force:
        raise AlgorithmError(
            f"D² needs a gossip matrix with smallest eigenvalue >= {D2_MIN_EIGENVALUE}, "
            f"but {topology.name!r} with "
            f"{w.shape[0]} workers has {smallest:.4f}; use --d2-exact-diffusion (W+I)/2, "
            "another topology, "
            "or --d2-force to run it anyway"
        )
    return w


class D2Matrix(GossipMatrixForm):
    """X(t+1) = W (X + U + C),  C(t+1) = X(t+1) - X - U."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        self.Ws = [
            d2_mixing_matrix(
                matrix_algorithm.topology,
                matrix_algorithm.options.d2_exact_diffusion,
                matrix_algorithm.options.d2_force,
            )
        ]
        self.C = np.zeros((matrix_algorithm.n, matrix_algorithm.d))

    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        U = self.matrix_algorithm.optimizer.update(G, X, lr)
        X_new = W @ (X + U + self.C)
        # from the x(t+1) obtained, lost messages included
        self.C = X_new - X - U
        return X_new


class D2(RangedAlgorithm):
    """u = local (momentum) update;  x(t+1/2) = x(t) + u + c;  x(t+1) = W x(t+1/2);
    c(t+1) = x(t+1) - x(t) - u  (= c + x(t+1) - x(t+1/2), so x(t) need not be kept).

    A lost message: its weight in W is dropped and the worker's row renormalized (GossipMixer),
    and c(t+1) is computed from the x(t+1) actually obtained. The paper reports that D² diverges
    with lost messages; this is the plain rule, not a fix.

    A range's local step, correction and sends start once its gradient is final; its averaging and
    new correction follow its receives."""

    name = "d2"
    summary = (
        "D² with momentum and time-varying lr (the appendix algorithm); refuses a gossip matrix "
        "W with λ_min < -1/3"
    )
    heal_rule = (
        "D² weights rebuilt for the survivors' graph; the correction restarts at zero, so the "
        "first step after the heal is D²'s first step"
    )
    topologies = ONE_GRAPH
    matrix_form = D2Matrix
    options: D2Options

    @classmethod
    def check(cls, topology: Topology, optimizer: OptimizerConfig, options: D2Options) -> None:  # type: ignore[override]
        super().check(topology, optimizer, options)
        d2_mixing_matrix(topology, options.d2_exact_diffusion, options.d2_force)

    def _setup(self, x0: torch.Tensor) -> None:
        options = self.options
        self.mixer = self.mixers.gossip(
            d2_mixing_matrix(self.topology, options.d2_exact_diffusion, options.d2_force), x0
        )
        self.correction = torch.zeros_like(x0)
        self._half = torch.zeros_like(x0)

    def _start(self, lo: int, hi: int, index: int) -> Started:
        x, grad, lr, step = self._ranged
        self.optimizer.update_range(grad, x, lr, lo, hi, apply=True)
        half = x[..., lo:hi].add_(self.correction[..., lo:hi])  # x(t+1/2)
        self._half[..., lo:hi].copy_(half)
        return self.mixer.start(x, lo, hi, round_id(step), chunk=index)

    def _finish(self, lo: int, hi: int, pending: Started) -> None:
        pending.finish()
        self.correction[..., lo:hi].add_(self._ranged[0][..., lo:hi]).sub_(self._half[..., lo:hi])

    def state_dict(self) -> dict[str, Any]:
        return {"correction": self.correction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.correction.copy_(state["correction"])
