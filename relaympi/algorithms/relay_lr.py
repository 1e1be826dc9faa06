"""RelaySGD's learning-rate correction: a closed form in O(n), and the paper's simulation it
equals."""

from __future__ import annotations

import functools

import networkx as nx
import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order

from relaympi.topology import Topology, TopologyError

__all__ = ["lr_correction", "simulated_lr_correction"]

# The simulation stops when no worker's value moved by more than _TOLERANCE within a window
# of steps. Rounding can leave the floating-point dynamics cycling at a floor that grows like
# n^2 (~1e-11 on a 512-star) although the exact dynamics converge, so it also stops when the
# largest change is below _floor(n) and has not halved for a quarter of the steps taken so
# far: a linearly converging simulation halves its change in a few percent of the steps it
# took to get there. Workers must then agree on the limit to _floor(n).
_TOLERANCE = 1e-14


def _floor(n: int) -> float:
    return max(1e-9, 1e-13 * n * n)


def _tree_layers(topology: Topology | nx.Graph, caller: str) -> list[tuple[int, np.ndarray]]:
    """(n, [n-1, 2] edge array) per layer; refuses layers that are not trees over 0..n-1."""
    if isinstance(topology, nx.Graph):
        n = topology.number_of_nodes()
        if n == 0 or set(topology.nodes) != set(range(n)):
            raise TopologyError(f"{caller} needs nodes exactly 0..n-1 (layer 0 of 'graph')")
        if not nx.is_tree(topology):
            _not_a_tree(
                caller, 0, topology.graph.get("name") or "graph", topology.number_of_edges(), n
            )
        return [(n, np.array(topology.edges(), dtype=np.int64).reshape(-1, 2))]
    layers = []
    n = topology.world_size
    for index in range(topology.num_layers):
        edges = topology.edge_array(index)
        if len(edges) != n - 1:  # a Topology's layers are connected: a tree has n - 1 edges
            _not_a_tree(caller, index, topology.name, len(edges), n)
        layers.append((n, edges))
    return layers


def _not_a_tree(caller: str, index: int, name: str, edges: int, n: int) -> None:
    raise TopologyError(
        f"{caller} needs a tree (RelaySGD relays over spanning trees), but layer {index} "
        f"of {name!r} has {edges} edges on {n} nodes and is not a tree; "
        f"use a spanning tree, e.g. 'spanning-tree:{name}'"
    )


def lr_correction(topology: Topology | nx.Graph) -> float:
    """RelaySGD's learning-rate correction 1 / (alpha n) (paper appendix "Learning-rate
    correction").

    The paper's procedure (simulated_lr_correction) runs Algorithm 1 on a scalar model per worker
    after one +1 update everywhere until the workers agree on alpha n. Its limit has a closed
    form, O(n) per tree:

    In steady state (counters at n) Algorithm 1 is the delayed average
        x_i(t+1) = 1/n sum_j x_j(t - delta_ij + 1/2),   delta_ij = max(tau_ij - 1, 0)
    (a neighbour's model arrives in the same step). Read as a Markov chain on (rank j, age a),
    a = 0..max delta, it moves (i, 0) to (j, delta_ij) with probability 1/n and (j, a+1) to
    (j, a) with probability 1. Its stationary distribution is pi(j, a) = c |{i: delta_ij >= a}| / n
    (check: pi(j, 0) = c for every j), so the limit of any start is the pi-weighted average of the
    initial history. The +1 update puts 1 at age 0 of every rank and 0 at older ages:
        alpha n = sum_j pi(j, 0) / sum pi = n^2 / (n^2 + sum_{i,j} delta_ij), i.e.
        1 / (alpha n) = 1 + sum_{i != j} (tau_ij - 1) / n^2 = 1 + (2 W - n (n - 1)) / n^2,
    with W = sum_{i < j} tau_ij the tree's Wiener index = sum over edges of s (n - s), s the
    number of ranks on one side of the edge (each pair's path crosses exactly its edges).
    With several layers (double binary trees) the result is the mean over layers.
    """
    factors = [_tree_correction(n, edges) for n, edges in _tree_layers(topology, "lr_correction")]
    return float(np.mean(factors))


def _tree_correction(n: int, edges: np.ndarray) -> float:
    """1 + (2 W - n (n - 1)) / n^2 for one tree, W from subtree sizes in one BFS (exact
    integers)."""
    if n == 1:
        return 1.0
    rows = np.concatenate([edges[:, 0], edges[:, 1]])
    cols = np.concatenate([edges[:, 1], edges[:, 0]])
    adjacency = csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n, n))
    order, parent = breadth_first_order(adjacency, 0, directed=False, return_predecessors=True)
    size = [1] * n  # ranks in the subtree below each rank (root 0)
    parent_of = parent.tolist()
    for rank in order[:0:-1].tolist():  # leaves first
        size[parent_of[rank]] += size[rank]
    below = np.array(size, dtype=np.int64)  # the root's term is n (n - n) = 0
    wiener = int(np.sum(below * (n - below)))
    return (n * n + 2 * wiener - n * (n - 1)) / (n * n)  # int / int: one correct rounding


def simulated_lr_correction(topology: Topology | nx.Graph) -> float:
    """lr_correction by the paper's procedure: simulate Algorithm 1 (RelaySum/Model with counters)
    on a scalar model per worker that starts at 0 and receives one update of +1 on every worker,
    then no further updates, until all workers settle on a common value alpha n; 1 / (alpha n)
    per tree, the mean over layers. O(n) work per step and up to ~4 n^2 steps (chains): the
    test oracle for lr_correction's closed form, for small n.

    The update is applied once the counters have converged (after diameter steps of zero models):
    the correction is for training in steady state, where every worker divides by n. At t = 0
    the counters' normalization makes any all-equal input exact, which would give alpha n = 1.
    """
    factors = []
    for n, edges in _tree_layers(topology, "simulated_lr_correction"):
        factors.append(1.0 / _settled_value(n, tuple(map(tuple, edges.tolist()))))
    return float(np.mean(factors))


class _DirectedEdges:
    """Index arrays over the 2(n-1) directed edges i->j of a tree, for vectorized message
    passing."""

    def __init__(self, tree: nx.Graph) -> None:
        pairs = sorted(tree.edges()) + sorted((j, i) for i, j in tree.edges())
        index = {pair: e for e, pair in enumerate(pairs)}
        self.source = np.array([i for i, _ in pairs], dtype=np.int64)
        self.target = np.array([j for _, j in pairs], dtype=np.int64)
        self.reverse = np.array([index[(j, i)] for i, j in pairs], dtype=np.int64)


@functools.lru_cache(maxsize=128)
def _settled_value(n: int, tree_edges: tuple[tuple[int, int], ...]) -> float:
    """Common limit of Algorithm 1 on a scalar model after one +1 update on every worker."""
    if n == 1:
        return 1.0
    tree = nx.Graph()
    tree.add_nodes_from(range(n))
    tree.add_edges_from(tree_edges)
    edges = _DirectedEdges(tree)
    diameter = nx.diameter(tree)
    update_step = diameter  # counters c^(t) have reached their final values by then
    window = max(diameter + 1, 16)  # a message needs up to diameter steps to cross the tree
    max_steps = update_step + 100 * window + 400 * n * n  # generous: chains need ~4 n^2

    def inbox(values: np.ndarray) -> np.ndarray:  # sum over j of values_{j->i}, per rank i
        return np.bincount(edges.target, weights=values, minlength=n)

    x = np.zeros(n)  # x_i^(t)
    messages = np.zeros(len(edges.source))  # m_{i->j}^(t-1)
    counters = np.zeros(len(edges.source))  # c_{i->j}^(t-1)
    received = inbox(messages)
    counted = inbox(counters)
    n_bar = 1.0 + counted
    counters_settled = False
    window_change, best_change, best_step = 0.0, np.inf, update_step
    for step in range(max_steps):
        x_half = x + 1.0 if step == update_step else x  # x_i^(t+1/2): the single update
        # Algorithm 1, lines 5-6: own model (count 1) plus what the other neighbours k != j
        # sent last step, i.e. everything received minus what came from j itself.
        messages = x_half[edges.source] + received[edges.source] - messages[edges.reverse]
        received = inbox(messages)
        if not counters_settled:  # counters do not depend on models: once fixed, they stay fixed
            new_counters = 1.0 + counted[edges.source] - counters[edges.reverse]
            counters_settled = bool(np.array_equal(new_counters, counters))
            counters = new_counters
            counted = inbox(counters)
            n_bar = 1.0 + counted  # line 9
        new_x = (x_half + received) / n_bar  # line 10
        if step == update_step and not np.all(n_bar == n):
            raise RuntimeError(f"RelaySum counters did not reach n={n} after {step} steps: {n_bar}")
        window_change = max(window_change, float(np.abs(new_x - x).max()))
        x = new_x
        steps_after = step - update_step
        if steps_after > 0 and steps_after % window == 0:
            if window_change <= _TOLERANCE:
                break
            if window_change < best_change / 2:
                best_change, best_step = window_change, step
            elif best_change <= _floor(n) and step - best_step >= max(steps_after // 4, 4 * window):
                break  # at the rounding floor
            window_change = 0.0
    else:
        raise RuntimeError(
            f"RelaySum simulation on {n} workers did not settle in {max_steps} steps"
        )
    spread = float(np.max(x) - np.min(x))
    if spread > _floor(n):
        raise RuntimeError(f"RelaySum workers settled on different values (spread {spread:.3g})")
    return float(np.mean(x))
