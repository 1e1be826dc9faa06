"""Matrix-form oracle: every algorithm vectorized over all n workers (numpy), an independent
formulation.

Used as the test oracle for the message-passing implementations and as the fast path for
large random-quadratics studies. Rows of X are workers. Nothing here communicates. Each
algorithm's matrix form sits beside its message passing (``Algorithm.matrix_form``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relaympi.algorithms.base import Delivered, MatrixForm
from relaympi.algorithms.options import Options
from relaympi.algorithms.registry import algorithm_options, get_algorithm_class
from relaympi.algorithms.relay import effective_delays
from relaympi.optim import OptimizerConfig
from relaympi.topology import Topology

__all__ = ["MatrixAlgorithm", "MatrixOptimizer", "effective_delays", "make_matrix_algorithm"]


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


@dataclass
class MatrixAlgorithm:
    """x(t) -> x(t+1) for all workers at once; construct with make_matrix_algorithm."""

    algo: str
    topology: Topology
    optimizer: MatrixOptimizer
    x0: np.ndarray  # [d]
    options: Options | None = None  # the same options as the message passing's (None: its defaults)
    # relay: columns are width // period copies of one period-vector, each split into the
    # layers' coordinate blocks (None: the whole width is one vector)
    coordinate_period: int | None = None

    def __post_init__(self) -> None:
        self.n, self.d = self.optimizer.m.shape
        self.options = algorithm_options(self.algo, self.options)
        self.form: MatrixForm = get_algorithm_class(self.algo).matrix_form(self)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return self.form.step(X, G, lr, t)

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        """``step`` with the messages ``delivered`` says were lost (``MatrixForm.lossy_step``)."""
        return self.form.lossy_step(X, G, lr, t, delivered)


def make_matrix_algorithm(
    algo: str,
    topology: Topology,
    n: int,
    x0: np.ndarray,
    optimizer: OptimizerConfig,
    relay_mode: str = "counts",
    d2_exact_diffusion: bool = False,
    d2_force: bool = False,
    coordinate_period: int | None = None,
    options: Options | None = None,
) -> MatrixAlgorithm:
    """The matrix form of ``algo`` with ``options`` (or these keywords, those of its options);
    D² refuses the matrices the message-passing D² refuses (d2_mixing_matrix)."""
    if options is None:
        options = algorithm_options(
            algo,
            {
                "relay_mode": relay_mode,
                "d2_exact_diffusion": d2_exact_diffusion,
                "d2_force": d2_force,
            },
        )
    return MatrixAlgorithm(
        algo,
        topology,
        MatrixOptimizer(optimizer, (n, x0.shape[0])),
        np.asarray(x0, dtype=np.float64),
        options,
        coordinate_period,
    )
