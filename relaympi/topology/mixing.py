"""Metropolis-Hastings gossip weights and the spectral quantities gossip methods depend on."""

from __future__ import annotations

import networkx as nx
import numpy as np

from .errors import TopologyError

__all__ = ["dense_metropolis_hastings", "metropolis_hastings", "spectral_gap", "min_eigenvalue"]


def metropolis_hastings(graph: nx.Graph) -> np.ndarray:
    """Metropolis-Hastings weights of an undirected graph with nodes 0..n-1.

    W_ij = 1 / (1 + max(deg_i, deg_j)) for every edge {i, j}, W_ii = 1 - sum_{j != i} W_ij,
    zero elsewhere (Xiao & Boyd 2004). The result is symmetric and doubly stochastic
    with nonnegative entries; on a ring (n >= 3) every nonzero entry is 1/3.
    """
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise TopologyError(
            "metropolis_hastings needs an undirected simple networkx.Graph, got "
            f"{type(graph).__name__}"
        )
    n = graph.number_of_nodes()
    if set(graph.nodes) != set(range(n)):
        raise TopologyError(
            f"metropolis_hastings needs nodes exactly 0..{n - 1}, got "
            f"{sorted(graph.nodes, key=repr)[:8]}..."
        )
    if nx.number_of_selfloops(graph):
        raise TopologyError("metropolis_hastings needs a graph without self-loops")
    edges = np.array(graph.edges(), dtype=np.int64).reshape(-1, 2)
    return dense_metropolis_hastings(n, edges)


def dense_metropolis_hastings(world_size: int, edges: np.ndarray) -> np.ndarray:
    """metropolis_hastings of the graph with these edges (an [m, 2] integer array) over ranks
    0..n-1."""
    n = world_size
    degree = np.bincount(edges.ravel(), minlength=n).astype(np.int64)
    weights = np.zeros((n, n), dtype=np.float64)
    if len(edges):
        i, j = edges.T
        w = 1.0 / (1.0 + np.maximum(degree[i], degree[j]))
        weights[i, j] = w
        weights[j, i] = w
    weights[np.diag_indices(n)] = 1.0 - weights.sum(axis=1)
    return weights


def _symmetric_eigenvalues(matrix: np.ndarray) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise TopologyError(f"expecting a non-empty square matrix, got shape {matrix.shape}")
    if not np.allclose(matrix, matrix.T, rtol=0.0, atol=1e-12):
        raise TopologyError("expecting a symmetric gossip matrix")
    return np.linalg.eigvalsh(matrix)  # ascending


def spectral_gap(matrix: np.ndarray) -> float:
    """1 - (second largest |eigenvalue|) of a symmetric doubly stochastic gossip matrix.

    Positive exactly when gossip with this matrix converges to the average;
    a 1x1 matrix has gap 1.
    """
    eigenvalues = _symmetric_eigenvalues(matrix)
    if eigenvalues.size == 1:
        return 1.0
    magnitudes = np.sort(np.abs(eigenvalues))
    return float(1.0 - magnitudes[-2])


def min_eigenvalue(matrix: np.ndarray) -> float:
    """Smallest eigenvalue of a symmetric gossip matrix (D² bounds it: relaympi.algorithms.d2)."""
    return float(_symmetric_eigenvalues(matrix)[0])
