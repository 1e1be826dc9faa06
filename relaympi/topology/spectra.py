"""Eigenvalues of Metropolis-Hastings gossip matrices without dense n x n work where possible.

Closed forms for the fixed families (every entry is a function of n alone), and one rule for
every other graph:

  n <= DENSE_SPECTRUM_MAX_RANKS    numpy's eigvalsh on the dense matrix (~0.2 s at 1024 ranks);
  a tree of height <= 64           (from rank 0; binary trees, double binary trees, spanning trees
                                   of hypercubes and exponential graphs) exact counts of
                                   eigenvalues below shifts (Sylvester's law of inertia,
                                   tree_extremes), any n: 0.7 s for double binary trees at 10^5;
  n <= SPARSE_SPECTRUM_MAX_RANKS   ARPACK Lanczos (scipy eigsh) on the sparse matrix, shift-invert
                                   around each end of the spectrum, at most LANCZOS_MAX_ITERATIONS
                                   restarts; a run that does not converge reports nothing;
  larger n                         not computed (None, with the reason).

Lanczos is quick on binary trees, but path-like graphs (a ring's spanning tree, a ring with a
chord), whose eigenvalues lie ~1/n^2 apart, exhaust its iteration cap already at ~1000 ranks
and report "did not converge"; so do deep trees, beyond the inertia counts' height limit.

Closed forms (W = MH matrix; a d-regular graph has W = (I + A) / (d + 1), A the adjacency):
- circulant graphs (ring: offsets {1, n-1}; SGP's exponential graph: {+-2^k mod n}) have
  A's eigenvalues sum_{s in S} cos(2 pi j s / n), j = 0..n-1 (S symmetric, so real);
- chain (n >= 3): every edge weighs 1/3 (an end has degree 1, an inner rank 2), so
  W = I - L/3 with L the path Laplacian, eigenvalues 2 - 2 cos(pi k / n): (1 + 2 cos(pi k/n)) / 3;
  n = 2: W = J/2, eigenvalues 0 and 1;
- star: every edge weighs 1/n (the hub has degree n-1), so W = I - L/n with the star
  Laplacian's eigenvalues 0, 1 (n-2 times), n: W has 1, 1 - 1/n (n-2 times), 0;
- fully connected: W = J/n, eigenvalues 1 and 0 (n-1 times); one rank: 1;
- hypercube over 2^p ranks: A's eigenvalues p - 2 k with multiplicity C(p, k), the k of rank
  x being its number of set bits, so W's are 1 - 2 popcount(x) / (p + 1).
tests/test_topo_scale.py holds every closed form to eigvalsh at small n.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, eigsh

__all__ = [
    "DENSE_SPECTRUM_MAX_RANKS",
    "SPARSE_SPECTRUM_MAX_RANKS",
    "TREE_INERTIA_MAX_HEIGHT",
    "GossipExtremes",
    "chain_spectrum",
    "circulant_spectrum",
    "extremes_of",
    "fully_connected_spectrum",
    "hypercube_spectrum",
    "not_computed",
    "sparse_metropolis_hastings",
    "sparse_extremes",
    "star_spectrum",
    "tree_extremes",
]

DENSE_SPECTRUM_MAX_RANKS = 1024
SPARSE_SPECTRUM_MAX_RANKS = 16384
LANCZOS_MAX_ITERATIONS = 100  # ARPACK restarts per end of the spectrum (20 Lanczos vectors each)
_LANCZOS_TOLERANCE = 1e-12
TREE_INERTIA_MAX_HEIGHT = 64  # levels are numpy steps: binary trees have log2 n, paths n / 2
_SHIFTS = 3  # shifts per bracket and round: each round narrows a bracket 4x
_ROUNDS = 26  # 2 / 4^26 < 1e-15


@dataclass(frozen=True)
class GossipExtremes:
    """Spectral gap 1 - (second largest |eigenvalue|) and smallest eigenvalue, or why they are not
    known."""

    spectral_gap: float | None
    min_eigenvalue: float | None
    reason: str | None = None


def extremes_of(eigenvalues: np.ndarray) -> GossipExtremes:
    """Gap and smallest eigenvalue of a whole spectrum (one rank: gap 1)."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    lowest = float(eigenvalues.min())
    if eigenvalues.size == 1:
        return GossipExtremes(1.0, lowest)
    magnitudes = np.partition(np.abs(eigenvalues), eigenvalues.size - 2)
    return GossipExtremes(float(1.0 - magnitudes[-2]), lowest)


# -- closed forms (ascending arrays of all n eigenvalues) ----------------------------------


def circulant_spectrum(world_size: int, offsets: tuple[int, ...]) -> np.ndarray:
    """MH eigenvalues of the circulant graph i ~ i + s (mod n), s in offsets (a symmetric set, 0
    excluded)."""
    n = world_size
    shifts = sorted({s % n for s in offsets} | {-s % n for s in offsets})
    j = np.arange(n, dtype=np.float64)
    adjacency = np.zeros(n)
    for s in shifts:
        # j s mod n keeps the angle small and exact
        adjacency += np.cos(2.0 * np.pi * ((j * s) % n) / n)
    eigenvalues = (1.0 + adjacency) / (1.0 + len(shifts))
    # cos() is exact only to rounding: a ring of 3 has eigenvalue (1 + 2 cos(2 pi/3)) / 3 = 0,
    # computed as -7e-17. Nonzero eigenvalues of these graphs stay far above 1e-13 for any n
    # below 1e8.
    eigenvalues[np.abs(eigenvalues) < 1e-13] = 0.0
    return np.sort(eigenvalues)


def chain_spectrum(world_size: int) -> np.ndarray:
    """MH eigenvalues of the path over n >= 2 ranks."""
    n = world_size
    if n == 2:
        return np.array([0.0, 1.0])
    eigenvalues = (1.0 + 2.0 * np.cos(np.pi * np.arange(n) / n)) / 3.0
    eigenvalues[np.abs(eigenvalues) < 1e-13] = (
        0.0  # cos(2 pi / 3) = -1/2 to rounding, as for circulants
    )
    return np.sort(eigenvalues)


def star_spectrum(world_size: int) -> np.ndarray:
    """MH eigenvalues of the star over n >= 2 ranks."""
    n = world_size
    return np.concatenate([[0.0], np.full(n - 2, 1.0 - 1.0 / n), [1.0]])


def fully_connected_spectrum(world_size: int) -> np.ndarray:
    """MH eigenvalues of the complete graph over n >= 1 ranks."""
    return np.concatenate([np.zeros(world_size - 1), [1.0]])


def hypercube_spectrum(world_size: int) -> np.ndarray:
    """MH eigenvalues of the hypercube over n = 2^p ranks."""
    bits = world_size.bit_length() - 1
    ranks = np.arange(world_size, dtype=np.int64)
    popcount = np.zeros(world_size, dtype=np.int64)
    for b in range(bits):
        popcount += (ranks >> b) & 1
    return np.sort(1.0 - 2.0 * popcount / (bits + 1))


# -- the rule for everything else ---------------------------------------------------------


def sparse_metropolis_hastings(world_size: int, edges: np.ndarray) -> csr_matrix:
    """MH weights (see mixing.metropolis_hastings) as a sparse matrix: O(n + m) memory."""
    n = world_size
    i, j = edges[:, 0], edges[:, 1]
    degree = np.bincount(np.concatenate([i, j]), minlength=n)
    w = 1.0 / (1.0 + np.maximum(degree[i], degree[j]))
    off = csr_matrix(
        (np.concatenate([w, w]), (np.concatenate([i, j]), np.concatenate([j, i]))), shape=(n, n)
    )
    diagonal = 1.0 - np.asarray(off.sum(axis=1)).ravel()
    return (off + csr_matrix((diagonal, (np.arange(n), np.arange(n))), shape=(n, n))).tocsc()


def sparse_extremes(world_size: int, edges: np.ndarray) -> GossipExtremes:
    """Gap and smallest eigenvalue by Lanczos (n > 2), or a reason when it does not converge
    quickly.

    Shift-invert around -1 finds the smallest eigenvalue (> -1: every MH diagonal entry is
    positive); around 1 + 1e-3/n, the two largest (1, simple on a connected graph, and lambda_2).
    Every eigenvalue lies in [lambda_min, lambda_2] except 1, so the second largest magnitude is
    max(lambda_2, |lambda_min|). The start vector is fixed: the same graph gives the same digits.
    """
    n = world_size
    matrix = sparse_metropolis_hastings(n, edges)
    # deterministic, not orthogonal to any eigenvector in practice
    start = np.cos(np.arange(n) * 0.7) + 1.5
    try:
        lowest = eigsh(
            matrix,
            k=1,
            sigma=-1.0 - 1e-3,
            which="LM",
            v0=start,
            tol=_LANCZOS_TOLERANCE,
            maxiter=LANCZOS_MAX_ITERATIONS,
            return_eigenvectors=False,
        )
        top = eigsh(
            matrix,
            k=2,
            sigma=1.0 + 1e-3 / n,
            which="LM",
            v0=start,
            tol=_LANCZOS_TOLERANCE,
            maxiter=LANCZOS_MAX_ITERATIONS,
            return_eigenvectors=False,
        )
    except (ArpackNoConvergence, ArpackError):
        return GossipExtremes(
            None,
            None,
            f"not computed: sparse Lanczos did not converge in {LANCZOS_MAX_ITERATIONS} iterations",
        )
    lowest = float(lowest.min())
    second = float(np.sort(top)[0])
    return GossipExtremes(float(1.0 - max(second, abs(lowest))), lowest)


def not_computed(world_size: int) -> GossipExtremes:
    """What a summary says about a graph with no closed form above SPARSE_SPECTRUM_MAX_RANKS."""
    return GossipExtremes(
        None,
        None,
        f"not computed for n > {SPARSE_SPECTRUM_MAX_RANKS} (no closed form, not a tree of height "
        f"<= {TREE_INERTIA_MAX_HEIGHT}; sparse Lanczos converges slowly beyond)",
    )


# -- trees: Sylvester's law of inertia ------------------------------------------------------


def tree_extremes(
    world_size: int, edges: np.ndarray, parent: np.ndarray, depth: np.ndarray
) -> GossipExtremes:
    """Gap and smallest eigenvalue of a tree's MH matrix W by counting eigenvalues below shifts.

    Eliminating leaves first, W - s I = L D L^T with D_v = W_vv - s - sum_{children c} W_vc^2 / D_c
    (a tree has no fill-in), and by Sylvester's law of inertia the number of negative D_v is the
    number of eigenvalues below s. A rank's D depends only on its children, so all ranks of one
    depth are one numpy step, for all shifts at once: the smallest eigenvalue is where the count
    reaches 1, lambda_2 where it reaches n - 1 (1 is simple on a connected graph). Each round
    narrows both brackets 4x; 26 rounds take them from [-1, 1] below 1e-15. O(n) work and
    O(height) numpy steps per round. `parent` (-1 at the root) and `depth` come from one BFS.
    """
    n = world_size
    i, j = edges[:, 0], edges[:, 1]
    degree = np.bincount(np.concatenate([i, j]), minlength=n)
    w = 1.0 / (1.0 + np.maximum(degree[i], degree[j]))
    diagonal = 1.0 - np.bincount(i, weights=w, minlength=n) - np.bincount(j, weights=w, minlength=n)
    child = np.where(parent[i] == j, i, j)  # the endpoint farther from the root
    to_parent = np.zeros(n)
    to_parent[child] = w**2  # W_{c, parent(c)}^2 per child c
    # per depth, deepest first: ranks sorted by parent, and where each parent's run starts
    levels = []
    for d in range(int(depth.max()), -1, -1):
        ranks = np.flatnonzero(depth == d)
        ranks = ranks[np.argsort(parent[ranks], kind="stable")]
        parents, starts = np.unique(parent[ranks], return_index=True)
        levels.append((ranks, parents, starts))
    brackets = np.array([[-1.0, 1.0], [-1.0, 1.0]])  # the smallest eigenvalue; lambda_2
    targets = (1, n - 1)  # the count of eigenvalues below s that each bracket looks for
    steps = np.arange(1, _SHIFTS + 1) / (_SHIFTS + 1)
    for _ in range(_ROUNDS):
        shifts = brackets[:, :1] + (brackets[:, 1:] - brackets[:, :1]) * steps  # [2, S]
        flat = shifts.ravel()
        below = np.zeros(flat.size, dtype=np.int64)
        incoming = np.zeros((n, flat.size))  # sum over children of W_vc^2 / D_c
        for ranks, parents, starts in levels:
            d = diagonal[ranks, None] - flat[None, :] - incoming[ranks]
            d[d == 0.0] = -1e-300  # an exact zero pivot: s is an eigenvalue; count it as below
            below += (d < 0).sum(axis=0)
            if parents[0] >= 0:  # not the root's level
                incoming[parents] += np.add.reduceat(to_parent[ranks, None] / d, starts, axis=0)
        below = below.reshape(2, _SHIFTS)
        for b in range(2):
            reached = np.flatnonzero(below[b] >= targets[b])
            first = int(reached[0]) if reached.size else _SHIFTS
            low = shifts[b, first - 1] if first > 0 else brackets[b, 0]
            high = shifts[b, first] if first < _SHIFTS else brackets[b, 1]
            brackets[b] = (low, high)
    lowest, second = brackets.mean(axis=1)
    return GossipExtremes(float(1.0 - max(second, abs(lowest))), float(lowest))
