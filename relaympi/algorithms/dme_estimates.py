"""Distributed mean estimation in closed form: RelaySum's and gossip's estimates and their expected
MSE.

The vectorized counterpart of relaympi.algorithms.dme.RelaySumMeanEstimator (paper appendix
"RelaySum for distributed mean estimation"), for many repetitions at once, and the gossip
baseline it is compared with. samples [R, T, n]: repetition r, step t, worker j.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relaympi.algorithms.matrix import effective_delays
from relaympi.topology import Topology


def relaysum_dme_estimates(
    samples: np.ndarray, topology: Topology, checkpoints: Sequence[int]
) -> np.ndarray:
    """RelaySum mean estimates (appendix Algorithm "RelaySum for Distributed Mean Estimation"),
    vectorized.

    After T steps worker i holds worker j's samples of steps 0 .. T-1-e_ij (neighbours' samples
    arrive in the same step), so its estimate is their plain mean: sum_j S_j(T - e_ij) /
    sum_j max(T - e_ij, 0), with S_j(m) the sum of j's first m samples. Returns
    [R, len(checkpoints), n].
    """
    R, T, n = samples.shape
    if topology.num_layers != 1 or not topology.is_tree or topology.world_size != n:
        raise ValueError(
            f"RelaySum mean estimation needs one spanning tree over {n} workers, got {topology!r}"
        )
    # [R, T+1, n]
    prefix = np.concatenate([np.zeros((R, 1, n)), np.cumsum(samples, axis=1)], axis=1)
    delay = effective_delays(topology, 0)
    workers = np.arange(n)[None, :]
    out = np.empty((R, len(checkpoints), n))
    for k, steps in enumerate(checkpoints):
        if not 1 <= steps <= T:
            raise ValueError(f"checkpoints must be in [1, {T}], got {steps}")
        held = np.maximum(steps - delay, 0)  # [i, j]: how many of j's samples worker i holds
        out[:, k, :] = prefix[:, held, workers].sum(axis=2) / held.sum(axis=1)
    return out


def gossip_dme_estimates(
    samples: np.ndarray, mixing: np.ndarray, checkpoints: Sequence[int]
) -> np.ndarray:
    """Gossip baseline: y(t+1) = W (y(t) + d(t)) from y(0) = 0; the estimate after T steps is y(T) /
    T.

    With W = I this is every worker's own running mean, with W = 11^T / n the global one; W is
    doubly stochastic, so y(T) / T is a running mean of samples gossiped over the graph.
    Returns [R, len(checkpoints), n].
    """
    R, T, n = samples.shape
    wanted = {steps: k for k, steps in enumerate(checkpoints)}
    out = np.empty((R, len(checkpoints), n))
    y = np.zeros((R, n))
    for t in range(T):
        y = (y + samples[:, t, :]) @ mixing.T
        if t + 1 in wanted:
            out[:, wanted[t + 1], :] = y / (t + 1)
    return out


def relaysum_dme_expected_mse(topology: Topology, steps: int, variance: float = 1.0) -> float:
    """E (estimate - mean)^2 averaged over workers: worker i's estimate is a mean of N_i(T)
    samples."""
    held = np.maximum(steps - effective_delays(topology, 0), 0).sum(axis=1)
    return float(np.mean(variance / held))


def gossip_dme_expected_mse(mixing: np.ndarray, steps: int, variance: float = 1.0) -> float:
    """(1 / T^2) sum_{k=1..T} (W^{2k})_ii averaged over workers (W symmetric): the gossip baseline's
    MSE."""
    eigenvalues, vectors = np.linalg.eigh(mixing)
    squares = eigenvalues**2
    total = np.empty_like(squares)
    near_one = np.isclose(squares, 1.0)
    total[near_one] = steps
    q = squares[~near_one]
    total[~near_one] = q * (1 - q**steps) / (1 - q)  # sum_{k=1..T} q^k
    diagonal = (vectors**2) @ total  # sum_k (W^{2k})_ii
    return float(variance * diagonal.mean() / steps**2)
