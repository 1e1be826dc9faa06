"""Matrix-form oracle: every algorithm vectorized over all n workers (numpy), an independent formulation.

Used as the test oracle for the message-passing implementations and as the fast engine for
large random-quadratics studies. Rows of X are workers. Nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from relaympi.optim import OptimizerConfig


class MatrixOptimizer:
    """The local optimizers, vectorized over workers (rows)."""

    def __init__(self, config: OptimizerConfig, shape: tuple[int, int]):
        self.config = config
        self.m = np.zeros(shape)
        self.v = np.zeros(shape)
        self.steps = 0

    def update(self, G: np.ndarray, X: np.ndarray, lr: float) -> np.ndarray:
        c = self.config
        G = G + c.weight_decay * X if c.weight_decay else G
        if c.name == "adam":
            b1, b2 = c.betas
            self.steps += 1
            self.m = b1 * self.m + (1 - b1) * G
            self.v = b2 * self.v + (1 - b2) * G * G
            m_hat = self.m / (1 - b1**self.steps)
            v_hat = self.v / (1 - b2**self.steps)
            return -lr * m_hat / (np.sqrt(v_hat) + c.eps)
        if c.momentum == 0:
            return -lr * G
        self.m = c.momentum * self.m + G
        return -lr * (G + c.momentum * self.m) if c.nesterov else -lr * self.m


def effective_delays(topology: Any, layer: int) -> np.ndarray:
    """e_ij = max(tau_ij - 1, 0): worker j's x(s + 1/2) enters x_i(t + 1) for s = t - e_ij (Algorithm 1's timing)."""
    return np.maximum(topology.delays(layer) - 1, 0)


@dataclass
class MatrixAlgorithm:
    """x(t) -> x(t+1) for all workers at once; construct with make_matrix_algorithm."""

    algo: str
    topology: Any
    optimizer: MatrixOptimizer
    x0: np.ndarray  # [d]
    relay_mode: str = "counts"
    d2_exact_diffusion: bool = False
    d2_force: bool = False
    # relay: columns are width // period copies of one period-vector, each split into the
    # layers' coordinate blocks (None: the whole width is one vector)
    coordinate_period: int | None = None

    def __post_init__(self) -> None:
        n, d = self.optimizer.m.shape
        self.n, self.d = n, d
        self.history: list[np.ndarray] = []  # relay: x(s+1/2) (or u(s) for relay-grad), newest last
        self.C = np.zeros((n, d))  # d2 / gt corrections
        self.M = np.zeros((n, d))  # qgm momentum
        if self.algo in ("dpsgd", "qgm", "d2", "gt"):
            self.W = self.topology.mixing_matrix(0)
            if self.algo == "d2":
                from relaympi.algorithms.d2 import d2_mixing_matrix

                self.W = d2_mixing_matrix(self.topology, self.d2_exact_diffusion, self.d2_force)
        if self.algo in ("relay", "relay-grad"):
            L = self.topology.num_layers
            period = self.coordinate_period or d
            if d % period:
                raise ValueError(f"width {d} is not a multiple of the coordinate period {period}")
            blocks = self.topology.coordinate_blocks(period)  # layer k relays block k (contiguous)
            if period == d:
                self.layer_coords = list(blocks)
            else:
                starts = np.arange(0, d, period)[:, None]
                self.layer_coords = [(starts + np.arange(b.start, b.stop)[None, :]).ravel() for b in blocks]
            delays = [effective_delays(self.topology, k) for k in range(L)]
            self.tau_max = max(int(e.max()) for e in delays)
            # masks[layer][e][i, j] = 1 where j's value from e steps ago reaches i now
            self.masks = [[(delay == e).astype(float) for e in range(self.tau_max + 1)] for delay in delays]

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        algo = self.algo
        if algo == "allreduce":
            Gbar = np.repeat(G.mean(axis=0, keepdims=True), self.n, axis=0)
            return X + self.optimizer.update(Gbar, X, lr)
        if algo == "qgm":
            c, beta = self.optimizer.config, self.optimizer.config.momentum
            G = G + c.weight_decay * X if c.weight_decay else G
            D = beta * self.M + G
            if c.nesterov:
                D = G + beta * D
            X_new = self.W @ (X - lr * D)
            if lr > 0:
                self.M = beta * self.M + (1 - beta) * (X - X_new) / lr
            return X_new
        U = self.optimizer.update(G, X, lr)
        if algo == "dpsgd":
            return self.W @ (X + U)
        if algo == "d2":
            X_new = self.W @ (X + U + self.C)
            self.C = X_new - X - U
            return X_new
        if algo == "gt":
            X_new = self.W @ (X + U + self.C)
            self.C = self.W @ (self.C + U) - U
            return X_new
        if algo == "sgp":
            from relaympi.topology import ExponentialSchedule

            schedule, Y = ExponentialSchedule(self.n), X + U
            for r in range(2):
                Y = schedule.mixing_matrix(2 * t + r) @ Y
            return Y
        if algo == "relay":
            return self._relay(X, X + U, t)
        if algo == "relay-grad":
            return X + self._delayed_sum(U, t)[0] / self.n
        raise ValueError(f"no matrix form for {algo!r}")

    def _delayed_sum(self, current: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """sum_j current_j(t - e_ij) over the j whose value has arrived, and how many arrived (per coordinate)."""
        self.history.append(current)
        del self.history[: -(self.tau_max + 1)]
        total = np.zeros((self.n, self.d))
        count = np.zeros((self.n, self.d))
        for coords, masks in zip(self.layer_coords, self.masks, strict=True):
            for e in range(min(t, self.tau_max) + 1):
                total[:, coords] += masks[e] @ self.history[-1 - e][:, coords]
                count[:, coords] += masks[e].sum(axis=1, keepdims=True)
        return total, count

    def _relay(self, X: np.ndarray, X_half: np.ndarray, t: int) -> np.ndarray:
        total, count = self._delayed_sum(X_half, t)
        if self.relay_mode == "counts":
            return total / count
        missing = self.n - count
        fill = X if self.relay_mode == "previous" else np.broadcast_to(self.x0, X.shape)
        return (total + missing * fill) / self.n


def make_matrix_algorithm(
    algo: str, topology: Any, n: int, x0: np.ndarray, optimizer: OptimizerConfig, relay_mode: str = "counts",
    d2_exact_diffusion: bool = False, d2_force: bool = False, coordinate_period: int | None = None,
) -> MatrixAlgorithm:
    """The matrix form of ``algo``; D² refuses a matrix with eigenvalue < -1/3 like the message-passing D²."""
    return MatrixAlgorithm(
        algo, topology, MatrixOptimizer(optimizer, (n, x0.shape[0])), np.asarray(x0, dtype=np.float64), relay_mode, d2_exact_diffusion, d2_force,
        coordinate_period,
    )
